"""Exactly-once effects for database work, across real host processes: a handler that writes a
row and completes in the same transaction (``tests.txn.effect``) is killed with SIGKILL after
its commit, or inside its block; frozen with SIGSTOP until another host has taken its delivery
over; or frozen while its open transaction holds the completed row past the lease. Each time
the row exists once, and only when the delivery is Completed.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model

from tests.factories import SubscriptionFactory, TopicFactory
from tests.support import txn_handlers
from tests.support.processes import SYSTEM_USER, Proc, Processes, backends_of, read_events
from tests.support.txn_handlers import effects
from tests.support.waiting import wait_until
from workqueue import publish
from workqueue.driver import get_driver
from workqueue.models import Delivery, Message, Subscription

pytestmark = [pytest.mark.processes, pytest.mark.usefixtures("queue_db")]

LEASE_SECONDS = 5
HANDLERS = {"WORKQUEUE_HANDLER_MODULES": "tests.support.handlers,tests.support.txn_handlers"}


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[Processes]:
    get_user_model().objects.create_user(SYSTEM_USER)
    txn_handlers.create_effect_table()
    procs = Processes(tmp_path)
    procs.events = tmp_path / "txn-events.jsonl"
    procs.env[txn_handlers.EVENT_LOG_ENV] = str(procs.events)
    try:
        yield procs
    finally:
        # Killed first (SIGKILL reaches a frozen host too): none may hold a lock on the table.
        procs.close()
        get_driver().close()
        txn_handlers.drop_effect_table()


def effect_subscription(**fields: Any) -> Subscription:
    fields.setdefault("lease_seconds", LEASE_SECONDS)
    fields.setdefault("backoff_base_seconds", 0)
    fields.setdefault("backoff_max_seconds", 0)
    return SubscriptionFactory(handler_key="tests.txn.effect", **fields)


def start_host(hosts: Processes, sub: Subscription) -> Proc:
    return hosts.host(sub.name, **HANDLERS)


def events_of(hosts: Processes, message_id: str) -> list[dict[str, Any]]:
    return [e for e in read_events(hosts.events) if e.get("message") == message_id]


def wait_for_event(hosts: Processes, message_id: str, phase: str, **match: Any) -> dict:
    def found() -> dict | None:
        return next(
            (
                e
                for e in events_of(hosts, message_id)
                if e["event"] == phase and all(e[k] == v for k, v in match.items())
            ),
            None,
        )

    return wait_until(found, timeout=30)


def kill(proc: Proc) -> None:
    proc.popen.kill()
    proc.wait(timeout=10)
    # A statement it sent just before dying may still run on its server backend; once the
    # backends are gone, what the database holds is final.
    wait_until(lambda: not backends_of(proc.pid), timeout=10)


def row(message_id: str) -> tuple[str, int]:
    delivery = Delivery.objects.get(message_id=message_id)
    return delivery.status, delivery.attempt_count


def test_killed_after_its_commit_the_handlers_row_exists_once_and_it_never_runs_again(hosts):
    sub = effect_subscription()
    first = start_host(hosts, sub)
    message = publish(sub.topic.name, {"holdAfterCommitMs": 60_000}).message_id
    wait_for_event(hosts, message, "committed")

    kill(first)  # before the handler returned: the runtime never settled anything itself

    assert row(message) == ("Completed", 1)
    assert effects(message) == [(message, 1)]
    second = start_host(hosts, sub)
    later = publish(sub.topic.name, {}).message_id
    wait_until(lambda: row(later)[0] == "Completed")
    time.sleep(LEASE_SECONDS + 1)  # past the killed holder's lease: nothing expires it
    assert row(message) == ("Completed", 1)
    assert effects(message) == [(message, 1)]
    assert [e["pid"] for e in events_of(hosts, message) if e["event"] == "inside"] == [first.pid]
    assert second.popen.poll() is None


def test_killed_inside_its_block_nothing_remains_and_the_retry_writes_exactly_once(hosts):
    sub = effect_subscription()
    next_topic = TopicFactory()
    SubscriptionFactory(topic=next_topic)
    first = start_host(hosts, sub)
    payload = {"holdInsideMs": {"1": 60_000}, "chainTopic": next_topic.name}
    message = publish(sub.topic.name, payload).message_id
    wait_for_event(hosts, message, "inside")

    kill(first)

    assert effects(message) == []  # the dead connection's transaction rolled back
    assert row(message) == ("InFlight", 1)  # until its lease expires
    start_host(hosts, sub)
    wait_until(lambda: row(message)[0] == "Completed", timeout=LEASE_SECONDS + 20)
    assert row(message) == ("Completed", 2)
    assert effects(message) == [(message, 2)]
    # The next step was published once, by the attempt that completed.
    [chained] = Message.objects.filter(topic=next_topic)
    assert chained.payload == {"after": message}


def test_a_frozen_holder_whose_delivery_was_taken_over_is_refused_and_rolls_back(hosts):
    sub = effect_subscription()
    stale = start_host(hosts, sub)
    message = publish(sub.topic.name, {"holdInsideMs": {"1": 3000}}).message_id
    wait_for_event(hosts, message, "inside", pid=stale.pid)

    stale.popen.send_signal(signal.SIGSTOP)  # a long pause: no heartbeats, no progress
    try:
        fresh = start_host(hosts, sub)
        wait_for_event(hosts, message, "committed", pid=fresh.pid)
    finally:
        stale.popen.send_signal(signal.SIGCONT)

    refused = wait_for_event(hosts, message, "refused", pid=stale.pid)
    assert refused["error"] == "LeaseLost"
    assert row(message) == ("Completed", 2)
    assert effects(message) == [(message, 2)]  # the new holder's row only
    phases = [(e["pid"] == stale.pid, e["event"]) for e in events_of(hosts, message)]
    assert (True, "committed") not in phases


def test_a_holder_frozen_after_completing_keeps_the_delivery_past_its_lease_until_it_commits(
    hosts,
):
    sub = effect_subscription()
    holder = start_host(hosts, sub)
    message = publish(sub.topic.name, {"holdAfterCompleteMs": 1000}).message_id
    wait_for_event(hosts, message, "completed", pid=holder.pid)

    holder.popen.send_signal(signal.SIGSTOP)  # its open transaction holds the completed row
    try:
        other = start_host(hosts, sub)
        time.sleep(LEASE_SECONDS + 1)  # the lease has passed in the database
        later = publish(sub.topic.name, {}).message_id
        wait_until(lambda: row(later)[0] == "Completed")  # the other host claims and runs work
        # ... but neither its claims nor lease expiry can take the locked row.
        assert row(message) == ("InFlight", 1)
        assert [e["pid"] for e in events_of(hosts, message)] == [holder.pid, holder.pid]
    finally:
        holder.popen.send_signal(signal.SIGCONT)

    wait_for_event(hosts, message, "committed", pid=holder.pid)
    wait_until(lambda: row(message)[0] == "Completed")
    assert row(message) == ("Completed", 1)
    assert effects(message) == [(message, 1)]
    assert other.pid not in {e["pid"] for e in events_of(hosts, message)}
