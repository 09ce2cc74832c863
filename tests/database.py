"""How tests reach the test database outside Django's cursor: raw psycopg connection
parameters, and a URL for subprocesses (hosts, workers, scripts)."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from django.db import connection


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
