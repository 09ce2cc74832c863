"""Hosts in this process (threads) with the private test registry of tests/support/handlers.py:
what a test needs to configure one and read its state. The ``make_host`` fixture (in
tests/conftest.py) builds them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import connection

from tests.factories import SubscriptionFactory
from workqueue.models import Delivery, Subscription
from workqueue.runtime.host import Host, HostConfig

RUNTIME_THREADS = ("wq-", "workqueue-timers")


def runtime_threads() -> list[threading.Thread]:
    """The threads a host starts that are still alive."""
    return [t for t in threading.enumerate() if t.name.startswith(RUNTIME_THREADS)]


def status_of(message_id: str) -> str:
    """The status of the one delivery of ``message_id``."""
    return Delivery.objects.get(message_id=message_id).status


def sub(**fields: Any) -> Subscription:
    """A subscription whose handler (``t.script``) does what each payload says."""
    fields.setdefault("handler_key", "t.script")
    return SubscriptionFactory(**fields)


def one(subscription: Subscription, concurrency: int = 2) -> list[dict[str, Any]]:
    """A host configuration that runs ``subscription`` alone."""
    return [{"name": subscription.name, "concurrency": concurrency}]


def states(host: Host) -> dict[str, tuple[str, str]]:
    """Each subscription's (state, reason) as the host reports its health."""
    return {s["name"]: (s["state"], s["reason"]) for s in host.health()["subscriptions"]}


def listening_sessions() -> list[int]:
    """The backends of the test database whose last statement was a LISTEN: hosts'
    notification listeners, and for a moment after a listener closed, its session."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND query LIKE 'LISTEN %%'"
        )
        return [pid for (pid,) in cursor.fetchall()]


def listener_pid() -> int | None:
    """The backend of the (only) host's notification listener: its last statement was a LISTEN.

    Which channels it listens on is not visible from another session, so tests that need the
    topic's channel shorten the listener's re-read interval and then give it a moment.
    """
    found = listening_sessions()
    assert len(found) <= 1, found
    return found[0] if found else None


@contextmanager
def running_tasks_queue(queue: str = "default") -> Iterator[None]:
    """A host in this process running the Tasks API queue ``tasks.<queue>``, made with its
    system user; a failed task is retried at once, three attempts in all."""
    from django.contrib.auth import get_user_model

    from workqueue.driver import get_driver
    from workqueue.tasks.api import default_task_backend

    get_user_model().objects.create_user("workqueue-system")
    default_task_backend.ensure_queue(queue)
    name = f"tasks.{queue}"
    Subscription.objects.filter(name=name).update(
        max_attempts=3, backoff_base_seconds=0, backoff_max_seconds=0
    )
    running = Host(
        HostConfig(
            subscriptions=[{"name": name, "concurrency": 1}],
            idle_poll_min_ms=50,
            idle_poll_max_ms=200,
            shutdown_drain_ms=300,
            sweeper_interval_ms=0,
            reconcile_interval_ms=0,
        )
    )
    running.start()
    try:
        yield
    finally:
        running.shutdown()
        get_driver().close()
