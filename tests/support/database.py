"""How tests reach the test database outside Django's cursor: raw psycopg connection
parameters, a URL for subprocesses (hosts, workers, scripts), the queue's connection settings
changed for a while, and whether a SQL Server is configured for the tests that run there too."""

from __future__ import annotations

import os
from collections.abc import Iterator
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
