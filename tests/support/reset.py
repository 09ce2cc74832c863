"""The reset after each transactional test, made cheap on PostgreSQL.

Django empties the database after a ``TransactionTestCase`` (pytest-django's
``transactional_db``, which every queue test uses: the driver works on its own connection) with
``flush``: one ``TRUNCATE`` of every table, then ``post_migrate``, which creates every content
type and permission again. On this suite's server that cost about 0.15 s a test (a
``TRUNCATE`` makes new files for each table and its indexes, and the signal writes a few
hundred rows), over a thousand times per run.

:func:`reset_tables` leaves the same database for a fraction of that: it deletes every row of
the tables ``flush`` would truncate, inside one transaction that first takes the lock
``TRUNCATE`` takes (so a write a test left running finishes first, and is deleted, as it was),
and keeps the content types and permissions, which ``post_migrate`` would only make again as
they were. Deletes run with ``session_replication_role = replica`` so that neither foreign keys
nor the queue's delete guards (a subscription with deliveries, a topic with messages) depend on
the order of the tables; every row of every such table goes, so nothing is left dangling.
A table of more than ``TRUNCATE_FROM_BYTES`` (a test that seeded a backlog) is truncated
instead: deleted, its dead rows would stay in its pages and indexes until a vacuum, and the
next test's scans (the query-plan tests count the pages a claim touches) would read them.

Django's own flush runs instead whenever the cheap reset would not leave what it leaves:
another vendor, a role that is not a superuser (needed for the replication role), a test that
names ``available_apps`` or ``serialized_rollback``, and a test that changed the content types
or permissions (their row count or highest id differs from the last flush's), after which the
flush's ``post_migrate`` makes them again."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.db import connections, transaction
from django.test import TransactionTestCase

# Written by post_migrate (create_contenttypes, create_permissions): kept, and checked instead.
KEPT_TABLES = ("django_content_type", "auth_permission")

# A table whose main fork is larger than this is truncated rather than deleted from.
TRUNCATE_FROM_BYTES = 8192  # more than one page

_FINGERPRINT_SQL = (
    "SELECT (SELECT count(*) FROM django_content_type), (SELECT max(id) FROM django_content_type),"
    " (SELECT count(*) FROM auth_permission), (SELECT max(id) FROM auth_permission),"
    " current_setting('is_superuser') = 'on'"
)

# Per alias: the kept tables' fingerprint as Django's flush last left them.
_fingerprints: dict[str, tuple[Any, ...]] = {}


def install() -> Callable[[], None]:
    """Make :func:`reset_tables` the reset of every ``TransactionTestCase``; returns the undo."""
    django_flush = TransactionTestCase._fixture_teardown

    def fixture_teardown(case: TransactionTestCase) -> None:
        aliases = list(case._databases_names(include_mirrors=False))
        cheap = (
            case.available_apps is None
            and not case.serialized_rollback
            and all(reset_tables(alias) for alias in aliases)
        )
        if not cheap:
            django_flush(case)
            for alias in aliases:
                _remember_fingerprint(alias)

    TransactionTestCase._fixture_teardown = fixture_teardown

    def undo() -> None:
        TransactionTestCase._fixture_teardown = django_flush

    return undo


def reset_tables(alias: str) -> bool:
    """Delete every row ``flush`` would, on ``alias``; False (nothing done) when only Django's
    flush leaves the database as it should be."""
    connection = connections[alias]
    if connection.vendor != "postgresql":
        return False
    tables = [
        connection.ops.quote_name(table)
        for table in connection.introspection.django_table_names(
            only_existing=True, include_views=False
        )
        if table not in KEPT_TABLES
    ]
    with connection.cursor() as cursor:
        cursor.execute(
            f"{_FINGERPRINT_SQL}, ARRAY(SELECT t FROM unnest(%s::text[]) AS t"
            " WHERE pg_relation_size(t::regclass) > %s)",
            [tables, TRUNCATE_FROM_BYTES],
        )
        *fingerprint, superuser, large = cursor.fetchone()
    if not superuser or _fingerprints.get(alias) != tuple(fingerprint):
        return False
    statements = [
        "SET LOCAL session_replication_role = replica",
        f"LOCK TABLE {', '.join(tables)} IN ACCESS EXCLUSIVE MODE",
        *(f"DELETE FROM {table}" for table in tables if table not in large),
    ]
    if large:
        # CASCADE: a table that references one of these, emptied here too, may be small.
        statements.append(f"TRUNCATE {', '.join(large)} CASCADE")
    with transaction.atomic(using=alias), connection.cursor() as cursor:
        cursor.execute(";\n".join(statements))
    return True


def _remember_fingerprint(alias: str) -> None:
    connection = connections[alias]
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        cursor.execute(_FINGERPRINT_SQL)
        *fingerprint, _superuser = cursor.fetchone()
    _fingerprints[alias] = tuple(fingerprint)
