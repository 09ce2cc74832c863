"""How tests reach the test database outside Django's cursor: raw psycopg connection
parameters, and a URL for subprocesses (hosts, workers, scripts)."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlencode

from django.db import connection


def psycopg_params() -> dict[str, Any]:
    """Keyword arguments for ``psycopg.connect`` to this worker's test database."""
    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    return params


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
