"""The reset after each transactional test, made cheap on PostgreSQL.

Django empties the database after a ``TransactionTestCase`` (pytest-django's
``transactional_db``, which every queue test uses: the driver works on its own connection) with
``flush``: one ``TRUNCATE`` of every table, then ``post_migrate``, which creates every content
type and permission again. On this suite's server that cost 0.1 to 0.15 s a test (a
``TRUNCATE`` makes new files for each table and its indexes, and the signal writes a few
hundred rows), over a thousand times per run.

:func:`reset_tables` leaves an equivalent database for a fraction of that: it deletes every row
of the tables ``flush`` would truncate, inside one transaction that first takes the lock
``TRUNCATE`` takes (so a write a test left running finishes first, and is deleted, as it was),
and keeps the content types and permissions, which ``post_migrate`` would make again with the
same names (only their ids would change). Deletes run with ``session_replication_role =
replica`` so that neither foreign keys nor the queue's delete guards (a subscription with
deliveries, a topic with messages) depend on the order of the tables; every row of every such
table goes, so nothing is left dangling.

A table that grew more than a page beyond its size after the last flush, in its heap, any of
its indexes or its TOAST data (a test that seeded a backlog, or bloated an index on purpose),
is truncated instead: deleted, its dead rows and index entries would stay until a vacuum, and
later tests would read them (the query-plan tests count the pages a claim touches; the health
report names a sparse index).

Django's own flush runs instead whenever the cheap reset would not leave what it leaves:
another vendor, a role that is not a superuser (needed for the replication role), a test that
names ``available_apps`` or ``serialized_rollback``, and a test that changed the content types
or permissions (their rows differ from what the last flush left), after which the flush's
``post_migrate`` makes them again."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import connections, transaction
from django.test import TransactionTestCase

# Written by post_migrate (create_contenttypes, create_permissions): kept, and checked instead.
KEPT_TABLES = ("django_content_type", "auth_permission")

# How much a relation may grow past its size after the last flush before its table is
# truncated rather than deleted from: the page a first row (or index entry) takes.
GROWTH_BEFORE_TRUNCATE = 8192

# The kept tables' rows, whole (a renamed permission counts as a change), and whether the
# session may use the replication role.
_STATE_SQL = (
    "SELECT (SELECT md5(string_agg(c::text, ',' ORDER BY c.id)) FROM django_content_type c),"
    " (SELECT md5(string_agg(p::text, ',' ORDER BY p.id)) FROM auth_permission p),"
    " current_setting('is_superuser') = 'on'"
)

# Each table's relations (heap, indexes, TOAST heap and its index) and their sizes.
_SIZES_SQL = """
SELECT t, r.oid, pg_relation_size(r.oid)
  FROM unnest(%s::text[]) AS t
 CROSS JOIN LATERAL (
        SELECT t::regclass::oid AS oid
         UNION ALL SELECT i.indexrelid FROM pg_index i WHERE i.indrelid = t::regclass
         UNION ALL SELECT c.reltoastrelid FROM pg_class c
                    WHERE c.oid = t::regclass AND c.reltoastrelid <> 0
         UNION ALL SELECT i.indexrelid FROM pg_class c
                     JOIN pg_index i ON i.indrelid = c.reltoastrelid
                    WHERE c.oid = t::regclass
       ) AS r
"""


@dataclass(frozen=True)
class _Flushed:
    """What the last flush of an alias left: the kept tables' rows, and each relation's size."""

    kept: tuple[Any, ...]
    sizes: dict[int, int]


_flushed: dict[str, _Flushed] = {}


def install() -> Callable[[], None]:
    """Make :func:`reset_tables` the reset of every ``TransactionTestCase``; returns the undo."""
    django_flush = TransactionTestCase._fixture_teardown

    def fixture_teardown(case: TransactionTestCase) -> None:
        aliases = list(case._databases_names(include_mirrors=False))
        whole = case.available_apps is None and not case.serialized_rollback
        if whole and all(reset_tables(alias) for alias in aliases):
            return
        django_flush(case)
        for alias in aliases:
            if whole:
                _remember_flushed(alias)
            else:
                # That flush sent no post_migrate: the next reset must be a whole flush too.
                _flushed.pop(alias, None)

    TransactionTestCase._fixture_teardown = fixture_teardown

    def undo() -> None:
        TransactionTestCase._fixture_teardown = django_flush

    return undo


def reset_tables(alias: str) -> bool:
    """Delete every row ``flush`` would, on ``alias``; False (nothing done) when only Django's
    flush leaves the database as it should be."""
    connection = connections[alias]
    flushed = _flushed.get(alias)
    if connection.vendor != "postgresql" or flushed is None:
        return False
    with connection.cursor() as cursor:
        cursor.execute(_STATE_SQL)
        *kept, superuser = cursor.fetchone()
        if not superuser or tuple(kept) != flushed.kept:
            return False
        tables = _tables(alias)
        cursor.execute(_SIZES_SQL, [tables])
        grown = {
            table
            for table, relation, size in cursor.fetchall()
            if size > flushed.sizes.get(relation, 0) + GROWTH_BEFORE_TRUNCATE
        }
    statements = [
        "SET LOCAL session_replication_role = replica",
        f"LOCK TABLE {', '.join(tables)} IN ACCESS EXCLUSIVE MODE",
        *(f"DELETE FROM {table}" for table in tables if table not in grown),
    ]
    if grown:
        # CASCADE: a table that references one of these, emptied here too, may not have grown.
        statements.append(f"TRUNCATE {', '.join(sorted(grown))} CASCADE")
    with transaction.atomic(using=alias), connection.cursor() as cursor:
        cursor.execute(";\n".join(statements))
    return True


def _tables(alias: str) -> list[str]:
    """The tables ``flush`` truncates on ``alias`` but the kept ones, quoted, sorted (Django
    gives them in the order of a set of strings, which changes from one process to the next)."""
    connection = connections[alias]
    return sorted(
        connection.ops.quote_name(table)
        for table in connection.introspection.django_table_names(
            only_existing=True, include_views=False
        )
        if table not in KEPT_TABLES
    )


def _remember_flushed(alias: str) -> None:
    connection = connections[alias]
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        cursor.execute(_STATE_SQL)
        *kept, _superuser = cursor.fetchone()
        cursor.execute(_SIZES_SQL, [_tables(alias)])
        sizes = {relation: size for _table, relation, size in cursor.fetchall()}
    _flushed[alias] = _Flushed(tuple(kept), sizes)
