"""Operators' reads while a queue table is locked (VACUUM FULL, REINDEX, a migrate's ALTER
TABLE hold an exclusive lock as long as they run): each read waits 2 s at most for it, once per
request, and the request answers, saying what it could not read, instead of holding a web
worker and a database session for as long as the lock is held, or failing as if the database
were away.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

import pytest
from django.db import connection

from tests.factories import SubscriptionFactory
from tests.support.api import call, reader
from workqueue import transport
from workqueue.driver import get_driver
from workqueue.operators import operations

pytestmark = pytest.mark.usefixtures("queue_db")


def while_locked(pg_conn: Any, read: Callable[[], Any], table: str = "workqueue_delivery") -> Any:
    """What ``read`` answers, on a thread of its own, while another session holds ``table``
    locked; fails if it has not answered within 15 s."""

    def on_its_own_connections() -> Any:
        try:
            return read()
        finally:
            get_driver().close()
            connection.close()

    pool = ThreadPoolExecutor(1)
    try:
        with pg_conn.transaction():
            pg_conn.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
            answer = pool.submit(on_its_own_connections)
            futures_wait([answer], timeout=15)
            answered_while_locked = answer.done()
    finally:
        pool.shutdown()  # once the lock is let go
    assert answered_while_locked, "still waiting for the lock after 15 s"
    return answer.result()


def test_health_while_a_queue_table_is_locked_answers_and_says_so(client, pg_conn):
    """Review helper-187: /health answered 503 "database unavailable" once the backlog probe's
    wait ran out (before the probes had a lock timeout, it waited as long as the lock). A key
    limited to its team's subscriptions then read ``ok`` with no warning while their claims
    waited for the lock: it hears that the tables are locked too (nothing else database-wide)."""
    subscription = SubscriptionFactory()
    unrestricted, limited = reader(), reader(subscriptions=[subscription.name])

    for key in (unrestricted, limited):
        response = while_locked(pg_conn, lambda key=key: call(client, "get", "/health", key=key))
        assert response.status_code == 200, (response.status_code, response.content)
        warnings = response.json()["databaseWarnings"]
        assert len(warnings) == 1 and "The queue tables are locked" in warnings[0], (key, warnings)
        assert response.json()["status"] != "ok"


def test_a_limited_key_hears_no_other_database_warning(client, monkeypatch):
    """What else /health warns of names indexes sized by every subscription's backlog: for
    unrestricted readers only."""
    subscription = SubscriptionFactory()
    sparse = [operations.BindingIssue("Warning", "database", "Queue indexes far larger (test)")]
    monkeypatch.setattr(operations, "_read_database_health_issues", lambda: sparse)

    unrestricted = call(client, "get", "/health", key=reader()).json()["databaseWarnings"]
    limited_key = reader(subscriptions=[subscription.name])
    limited = call(client, "get", "/health", key=limited_key).json()["databaseWarnings"]

    assert (unrestricted, limited) == (["Queue indexes far larger (test)"], [])


def test_unserved_subscriptions_while_a_queue_table_is_locked_are_listed_unread(pg_conn):
    """validate-bindings and /health ask each subscription's backlog: the first probe's lock
    timeout raised, and with it the whole check. Each is listed as unread, the lock waited
    for once."""
    subscriptions = sorted(SubscriptionFactory().name for _ in range(3))

    unserved = while_locked(pg_conn, operations.unserved_subscriptions)

    assert [(u.name, u.due) for u in unserved] == [(name, None) for name in subscriptions]
    assert all("lock timeout" in (u.problem or "") for u in unserved), unserved


def test_a_scrape_waits_for_a_locked_queue_table_once(pg_conn, monkeypatch):
    """Review helper-187: after the gauges' read gave up on the lock, the table sizes waited
    for it as long again."""
    SubscriptionFactory()
    sizes_read = []
    read_sizes = transport.queue_table_sizes
    monkeypatch.setattr(
        transport, "queue_table_sizes", lambda: sizes_read.append(1) or read_sizes()
    )
    from workqueue import metrics

    text = while_locked(pg_conn, lambda: metrics.render().decode())

    assert "workqueue_gauges_unavailable{" in text
    assert sizes_read == []
    # Read from the server's own views, not the queue tables: kept.
    assert "workqueue_db_vacuum_horizon_age_seconds " in text


def test_a_scrape_while_only_the_message_table_is_locked_keeps_the_gauges_it_read(pg_conn):
    """Review helper-189: the gauges read the delivery table only; the table sizes, read after
    them, waited for the message table's lock, and their failure then marked the whole scrape
    failed (``workqueue_gauges_read_failed 1``: "the gauges above are missing") though the
    subscriptions' gauges had been read. Only the sizes are left out."""
    from workqueue import metrics

    subscription = SubscriptionFactory()

    text = while_locked(pg_conn, lambda: metrics.render().decode(), table="workqueue_message")

    assert f'workqueue_pending_deliveries{{subscription="{subscription.name}"}} 0.0' in text
    assert "workqueue_gauges_read_failed 0.0" in text
    assert "workqueue_db_table_bytes{" not in text
    # Read from the server's own views, not the queue tables: kept (review helper-191).
    assert "workqueue_db_vacuum_horizon_age_seconds " in text
    assert "workqueue_db_notification_queue_usage " in text
