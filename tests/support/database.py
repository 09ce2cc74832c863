"""How tests reach the test database outside Django's cursor: raw psycopg connection
parameters, a URL for subprocesses (hosts, workers, scripts), the queue's connection settings
changed for a while, a delivery's row read on a connection of the test's own, a procedure file
edited for a negative control, and whether a SQL Server is configured for the tests that run
there too."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote, urlencode

from django.conf import settings
from django.db import connection, connections

MSSQL_URL_ENV = "WORKQUEUE_TEST_MSSQL_URL"
MSSQL_ALIAS = "mssql"


def psycopg_params() -> dict[str, Any]:
    """Keyword arguments for ``psycopg.connect`` to this worker's test database."""
    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    return params


def delivery_of_message(message_id: str) -> tuple[str, int]:
    """(status, attempt count) of the delivery of ``message_id``, read over the Unix socket on
    a connection of the test's own: it works while the queue's own connections cannot (a path
    made silent, a server turned read-only, a role out of connection slots)."""
    import psycopg

    with psycopg.connect(**psycopg_params(), autocommit=True) as conn:
        return conn.execute(
            "SELECT status, attempt_count FROM workqueue_delivery WHERE message_id = %s",
            [message_id],
        ).fetchone()


def edited_procedures(file: str, edits: Sequence[tuple[str, str]]) -> str:
    """PostgreSQL's procedure file ``file`` with each (old, new) text edit made (every old text
    must be there: a file that changed fails the test, not the control), its own objects named
    by this worker's schema as the driver installs them: SQL to run for a negative control."""
    from workqueue.driver.postgresql import declared_functions, qualify_own_objects
    from workqueue.sql import load_procedures, read_sql

    text = read_sql("postgresql", file)
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    with connection.cursor() as cursor:
        cursor.execute("SELECT quote_ident(current_schema())")
        (schema,) = cursor.fetchone()
    functions = declared_functions(text for _name, text in load_procedures("postgresql"))
    return qualify_own_objects(text, schema, functions)


_MISSING = object()


@contextmanager
def queue_connection_settings(*, options: dict[str, Any], **changed: Any) -> Iterator[None]:
    """The queue alias's settings (``HOST``, ``PORT``, ...) and ``OPTIONS`` changed while the
    block runs, for the connections opened meanwhile: the queue's own take the alias's settings
    each time they connect. Afterwards the settings are as they were, and the alias's Django
    connection is closed, so that none opened meanwhile outlives the block with them."""
    from workqueue.driver import get_driver

    alias = connections[get_driver().alias]
    changes = [
        (alias.settings_dict, changed),
        (alias.settings_dict.setdefault("OPTIONS", {}), options),
    ]
    saved = [(where, {key: where.get(key, _MISSING) for key in new}) for where, new in changes]
    for where, new in changes:
        where.update(new)
    try:
        yield
    finally:
        for where, old in saved:
            for key, value in old.items():
                if value is _MISSING:
                    where.pop(key, None)
                else:
                    where[key] = value
        alias.close()


def database_url(name: str | None = None) -> str:
    """The test database, or database ``name`` on its server, as a ``DATABASE_URL`` for a
    subprocess.

    Host and port go in the query string: the one form that libpq and django-environ both read
    for a unix-socket folder (the embedded PostgreSQL has no TCP port) as well as a host name.
    """
    params = psycopg_params()
    auth = quote(params.get("user") or "", safe="")
    if params.get("password"):
        auth += ":" + quote(params["password"], safe="")
    where = urlencode({key: params[key] for key in ("host", "port") if params.get(key)})
    return f"postgres://{auth}@/{quote(name or params['dbname'], safe='')}?{where}"


def mssql_skip_reason() -> str | None:
    """Why the SQL Server tests cannot run here, or None when a SQL Server is configured."""
    if not os.environ.get(MSSQL_URL_ENV):
        return f"{MSSQL_URL_ENV} is not set: no SQL Server to run these tests against"
    if MSSQL_ALIAS not in settings.DATABASES:
        return (
            f"{MSSQL_URL_ENV} is set, but project/settings.py defines no {MSSQL_ALIAS!r} "
            f"database alias from it; add DATABASES[{MSSQL_ALIAS!r}] = "
            f"env.db_url_config(env.str({MSSQL_URL_ENV!r})) to run these tests"
        )
    return None


def lock_waits() -> int:
    """Sessions of this test database waiting for a lock (pg_locks covers the whole cluster,
    where another test worker's database may be waiting for its own reasons)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE NOT l.granted AND a.datname = current_database()"
        )
        return cursor.fetchone()[0]
