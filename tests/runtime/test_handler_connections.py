"""A handler's ORM connection between deliveries: kept (CONN_MAX_AGE), and health-checked
(CONN_HEALTH_CHECKS) before a delivery's first query only when it was last known healthy more
than HEALTH_CHECK_REUSE_SECONDS ago, not once per delivery. A connection that died while idle
past the window is replaced before the handler uses it; one that dies within the window costs
the next handler an attempt, retried, and loses nothing. Against PostgreSQL, hosts in this
process (the suite's settings keep connections for 60 s and turn health checks on).
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import psycopg
import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.db.backends.postgresql.base import DatabaseWrapper

from tests.support.database import psycopg_params
from tests.support.handlers import registry
from tests.support.hosts import one, sub
from tests.support.waiting import wait_until
from workqueue import publish, publish_many
from workqueue.models import Delivery
from workqueue.runtime import executor
from workqueue.runtime.handlers import BaseWorkHandler
from workqueue.runtime.outcome import Outcome

pytestmark = pytest.mark.usefixtures("queue_db")


class OrmHandler(BaseWorkHandler):
    """Runs one ORM query on the default connection and records which server process ran it."""

    lock = threading.Lock()
    backends: list[int] = []

    def handle(self, message: Any, context: Any) -> Outcome:
        get_user_model().objects.exists()
        with type(self).lock:
            type(self).backends.append(connection.connection.info.backend_pid)
        return Outcome.complete()


registry.register("t.orm", OrmHandler)


@pytest.fixture
def pings(monkeypatch) -> list[str]:
    """The aliases Django health-checked (``is_usable``) on handlers' worker threads, in order
    (the host's own threads use the ORM too); handlers' records reset."""
    checked: list[str] = []
    is_usable = DatabaseWrapper.is_usable

    def counting(self: DatabaseWrapper) -> bool:
        if re.fullmatch(r"wq-.+-\d+", threading.current_thread().name):
            checked.append(self.alias)
        return is_usable(self)

    monkeypatch.setattr(DatabaseWrapper, "is_usable", counting)
    OrmHandler.backends = []
    return checked


def _terminate(backend_pid: int) -> None:
    with psycopg.connect(autocommit=True, **psycopg_params()) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [backend_pid])
        # Terminated processes linger for a moment; the handler must meet a dead connection.
        deadline = time.monotonic() + 10
        while admin.execute(
            "SELECT 1 FROM pg_stat_activity WHERE pid = %s", [backend_pid]
        ).fetchone():
            assert time.monotonic() < deadline, "the backend did not go away"
            time.sleep(0.02)


def _completed(message_id: str) -> tuple[str, int]:
    row = Delivery.objects.get(message_id=message_id)
    return row.status, row.attempt_count


def test_deliveries_back_to_back_do_not_ping_their_orm_connection_each(
    make_host, pings, monkeypatch
):
    monkeypatch.setattr(executor, "HEALTH_CHECK_REUSE_SECONDS", 60.0)
    s = sub(handler_key="t.orm")
    host = make_host(one(s, concurrency=1))
    host.start()

    results = publish_many(s.topic.name, [{"payload": {"n": n}} for n in range(40)])

    wait_until(
        lambda: Delivery.objects.filter(subscription=s, status="Completed").count() == 40,
        timeout=30,
    )
    assert len(OrmHandler.backends) == len(results) == 40
    assert len(set(OrmHandler.backends)) == 1, "the connection was not kept"
    # Opened by the first delivery (a new connection needs no check); the other 39 were within
    # the window. Django alone pings before each delivery's first query: 39 pings.
    assert pings == []


def test_a_connection_idle_past_the_window_is_checked_and_replaced_before_the_handler_uses_it(
    make_host, pings, monkeypatch
):
    monkeypatch.setattr(executor, "HEALTH_CHECK_REUSE_SECONDS", 0.3)
    s = sub(handler_key="t.orm")
    host = make_host(one(s, concurrency=1))
    host.start()
    first = publish(s.topic.name, {"n": 1}).message_id
    wait_until(lambda: _completed(first) == ("Completed", 1))
    _terminate(OrmHandler.backends[0])
    time.sleep(0.5)  # past the window: the next delivery must not trust the connection

    second = publish(s.topic.name, {"n": 2}).message_id

    wait_until(lambda: _completed(second)[0] == "Completed")
    assert _completed(second) == ("Completed", 1), "the handler met the dead connection"
    assert "default" in pings
    assert OrmHandler.backends[1] != OrmHandler.backends[0]


def test_a_connection_that_dies_within_the_window_costs_one_attempt_and_loses_nothing(
    make_host, pings, monkeypatch
):
    monkeypatch.setattr(executor, "HEALTH_CHECK_REUSE_SECONDS", 60.0)
    s = sub(handler_key="t.orm", backoff_base_seconds=0, backoff_max_seconds=0)
    host = make_host(one(s, concurrency=1))
    host.start()
    first = publish(s.topic.name, {"n": 1}).message_id
    wait_until(lambda: _completed(first) == ("Completed", 1))
    _terminate(OrmHandler.backends[0])

    second = publish(s.topic.name, {"n": 2}).message_id

    # Trusted within the window, the dead connection fails the first attempt; Django's check
    # after the error closes it, and the retry runs on a new one.
    wait_until(lambda: _completed(second)[0] == "Completed", timeout=30)
    assert _completed(second) == ("Completed", 2)
    assert OrmHandler.backends[1] != OrmHandler.backends[0]
