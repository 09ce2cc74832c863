"""How tests reach the test database outside Django's cursor: raw psycopg connection
parameters, a URL for subprocesses (hosts, workers, scripts), and whether a SQL Server is
configured for the tests that run there too."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import quote

from django.conf import settings
from django.db import connection

MSSQL_URL_ENV = "WORKQUEUE_TEST_MSSQL_URL"
MSSQL_ALIAS = "mssql"


def psycopg_params() -> dict[str, Any]:
    """Keyword arguments for ``psycopg.connect`` to this worker's test database."""
    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    return params


def database_url() -> str:
    """The test database as a ``DATABASE_URL`` for a subprocess."""
    s = connection.settings_dict
    auth = quote(s["USER"] or "", safe="")
    if s.get("PASSWORD"):
        auth += ":" + quote(s["PASSWORD"], safe="")
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT']}/{quote(s['NAME'])}"


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
