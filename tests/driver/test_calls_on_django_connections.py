"""Driver statements sent on a caller's Django connection (an enlisted completion or publish, and
every call in test mode) bring back their rows, however few, and nothing for a statement that
returns no result set, also through a cursor that instrumentation has wrapped in a proxy which
does not pass on psycopg's own attributes."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connections

from workqueue.driver import get_driver

pytestmark = pytest.mark.django_db


class _ProxyCursor:
    """A cursor as some tracing libraries wrap it: every DB-API attribute, none of psycopg's
    extras (``pgresult``)."""

    def __init__(self, cursor: Any) -> None:
        self._cursor = cursor

    def __getattr__(self, name: str) -> Any:
        if name == "pgresult":
            raise AttributeError(name)
        return getattr(self._cursor, name)


@pytest.fixture(params=["psycopg", "wrapped"])
def django_connection(request, monkeypatch):
    wrapper = connections["default"]
    wrapper.ensure_connection()
    if request.param == "wrapped":
        # On the class, so that undoing it leaves no attribute behind on the connection.
        create_cursor = type(wrapper).create_cursor
        monkeypatch.setattr(
            type(wrapper),
            "create_cursor",
            lambda self, name=None: _ProxyCursor(create_cursor(self, name)),
        )
    return wrapper


def test_rows_come_back_and_an_empty_result_is_no_rows(django_connection):
    driver = get_driver()

    assert driver.execute("SELECT 7, 'seven'", [], django_connection) == [(7, "seven")]
    assert driver.execute("SELECT 1 WHERE false", [], django_connection) == []


def test_a_statement_without_a_result_set_brings_back_nothing(django_connection):
    # Fetching from it would raise: the driver must tell it from an empty result.
    assert get_driver().execute("SET LOCAL lock_timeout = '5s'", [], django_connection) == []
