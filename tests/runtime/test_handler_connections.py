"""A handler's ORM connection between deliveries: kept (CONN_MAX_AGE), and health-checked
(CONN_HEALTH_CHECKS) before a delivery's first query only when it was last known healthy more
than HEALTH_CHECK_REUSE_SECONDS ago, not once per delivery. A connection that died while idle
past the window is replaced before the handler uses it; one that dies within the window costs
the next handler an attempt (retried, as without health checks). Against PostgreSQL, hosts in
this process (the suite's settings keep connections for 60 s and turn health checks on).
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from typing import Any

import psycopg
import pytest
from django.contrib.auth import get_user_model
from django.db import DatabaseError, connection
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
    """Runs one ORM query on the default connection and records which server process ran it,
    and on which worker thread."""

    lock = threading.Lock()
    backends: list[int] = []
    threads: list[str] = []

    def handle(self, message: Any, context: Any) -> Outcome:
        if message.payload.get("badSql"):
            # An error Django counts against the connection (errors_occurred), caught here.
            with contextlib.suppress(DatabaseError), connection.cursor() as cursor:
                cursor.execute("SELEC 1")
        get_user_model().objects.exists()
        with type(self).lock:
            type(self).backends.append(connection.connection.info.backend_pid)
            type(self).threads.append(threading.current_thread().name)
        return Outcome.complete()


registry.register("t.orm", OrmHandler)


@pytest.fixture
def pings(monkeypatch) -> list[tuple[str, str]]:
    """(thread name, alias) of every health check Django made (``is_usable``), in order; the
    handlers' records reset. The host's own threads use the ORM too: see ``on_workers``."""
    checked: list[tuple[str, str]] = []
    is_usable = DatabaseWrapper.is_usable

    def counting(self: DatabaseWrapper) -> bool:
        checked.append((threading.current_thread().name, self.alias))
        return is_usable(self)

    monkeypatch.setattr(DatabaseWrapper, "is_usable", counting)
    OrmHandler.backends, OrmHandler.threads = [], []
    return checked


def on_workers(pings: list[tuple[str, str]], subscription: Any) -> list[str]:
    """The aliases of the health checks made on ``subscription``'s handler threads."""
    worker = re.compile(rf"wq-{re.escape(subscription.name)}-\d+")
    return [alias for thread, alias in pings if worker.fullmatch(thread)]


def _terminate(backend_pid: int) -> None:
    """End a server process and wait (up to 10 s) until it is gone: the handler must meet a
    dead connection, not one still closing."""
    with psycopg.connect(autocommit=True, **psycopg_params()) as admin:
        terminated = admin.execute("SELECT pg_terminate_backend(%s, 10000)", [backend_pid])
        assert terminated.fetchone() == (True,)


def _completed(message_id: str) -> tuple[str, int]:
    row = Delivery.objects.get(message_id=message_id)
    return row.status, row.attempt_count


def _running(make_host: Any, monkeypatch: Any, window: float, **fields: Any) -> Any:
    """A started host of one ``t.orm`` subscription at concurrency 1, with ``window`` as
    HEALTH_CHECK_REUSE_SECONDS; the subscription."""
    monkeypatch.setattr(executor, "HEALTH_CHECK_REUSE_SECONDS", window)
    s = sub(handler_key="t.orm", **fields)
    make_host(one(s, concurrency=1)).start()
    return s


def test_deliveries_back_to_back_do_not_ping_their_orm_connection_each(
    make_host, pings, monkeypatch
):
    s = _running(make_host, monkeypatch, 60.0)

    results = publish_many(s.topic.name, [{"payload": {"n": n}} for n in range(40)])

    wait_until(
        lambda: Delivery.objects.filter(subscription=s, status="Completed").count() == 40,
        timeout=30,
    )
    assert len(OrmHandler.backends) == len(results) == 40
    # A worker thread keeps its connection (the pool may start a second thread for a moment).
    per_thread = {(t, b) for t, b in zip(OrmHandler.threads, OrmHandler.backends, strict=True)}
    assert len(per_thread) == len(set(OrmHandler.threads)), "a connection was not kept"
    # Each thread's first delivery opened its connection (a new one needs no check), the others
    # came within the window. Django alone pings before each delivery's first query: 38 or 39.
    assert on_workers(pings, s) == []


def test_a_connection_idle_past_the_window_is_checked_and_replaced_before_the_handler_uses_it(
    make_host, pings, monkeypatch
):
    s = _running(make_host, monkeypatch, 0.3)
    first = publish(s.topic.name, {"n": 1}).message_id
    wait_until(lambda: _completed(first) == ("Completed", 1))
    _terminate(OrmHandler.backends[0])
    time.sleep(0.5)  # past the window: the next delivery must not trust the connection

    second = publish(s.topic.name, {"n": 2}).message_id

    wait_until(lambda: _completed(second)[0] == "Completed")
    assert _completed(second) == ("Completed", 1), "the handler met the dead connection"
    assert "default" in on_workers(pings, s)
    assert OrmHandler.backends[1] != OrmHandler.backends[0]


def test_a_connection_that_dies_within_the_window_costs_the_next_handler_one_attempt(
    make_host, pings, monkeypatch
):
    s = _running(make_host, monkeypatch, 60.0, backoff_base_seconds=0, backoff_max_seconds=0)
    first = publish(s.topic.name, {"n": 1}).message_id
    wait_until(lambda: _completed(first) == ("Completed", 1))
    _terminate(OrmHandler.backends[0])
    time.sleep(0.1)  # the worker thread is back in its pool: the next delivery runs on it

    second = publish(s.topic.name, {"n": 2}).message_id

    # Trusted within the window, the dead connection fails the first attempt; Django's check
    # after the error closes it, and the retry runs on a new one.
    wait_until(lambda: _completed(second)[0] == "Completed", timeout=30)
    assert OrmHandler.threads[1] == OrmHandler.threads[0]
    assert _completed(second) == ("Completed", 2)
    assert OrmHandler.backends[1] != OrmHandler.backends[0]


def test_a_connection_checked_after_a_handlers_error_ages_like_any_other(
    make_host, pings, monkeypatch
):
    s = _running(make_host, monkeypatch, 0.3)
    first = publish(s.topic.name, {"badSql": True}).message_id
    wait_until(lambda: _completed(first) == ("Completed", 1))
    _terminate(OrmHandler.backends[0])  # after Django's check at the end of that delivery
    time.sleep(0.5)

    second = publish(s.topic.name, {"n": 2}).message_id

    wait_until(lambda: _completed(second)[0] == "Completed")
    assert _completed(second) == ("Completed", 1), "the handler met the dead connection"
