"""The sweeper against PostgreSQL: one pass expires passed leases (retry, or dead letter on the
last attempt) and purges exactly what retention allows — Completed and Discarded deliveries past
their topic's retention, messages no delivery refers to any more, closed deduplication windows —
and never a dead letter or live work. Two sweepers at once: the second pass is skipped.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest

from tests.factories import SubscriptionFactory, TopicFactory
from workqueue import publish, signals, transport
from workqueue.driver import get_driver
from workqueue.models import Deduplication, Delivery, Message
from workqueue.runtime.sweeper import Sweeper
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")

DAY = 86_400


def status(delivery_id: str) -> tuple[str, int, str | None] | None:
    row = Delivery.objects.filter(pk=delivery_id).first()
    return (row.status, row.attempt_count, row.dead_letter_reason) if row else None


@pytest.fixture
def dead_letters() -> Any:
    received: list[dict[str, Any]] = []

    def on_dead_letter(sender: Any, **kwargs: Any) -> None:
        received.append(kwargs)

    signals.dead_lettered.connect(on_dead_letter, dispatch_uid="test-sweeper")
    yield received
    signals.dead_lettered.disconnect(dispatch_uid="test-sweeper")


def test_one_pass_purges_exactly_what_retention_allows_and_expires_passed_leases(
    dead_letters, caplog
):
    topic = TopicFactory(retention_days=1)
    retry = SubscriptionFactory(topic=topic, max_attempts=3, lease_seconds=30)
    last = SubscriptionFactory(topic=topic, max_attempts=1, lease_seconds=30)
    on_retry, on_last = Receiver(retry.id, "holder"), Receiver(last.id, "holder")

    # Every message fans out to both subscriptions; each row is then settled into one status.
    done = publish(topic.name, {"n": "done"}).message_id
    dropped = publish(topic.name, {"n": "dropped"}).message_id
    poison = publish(topic.name, {"n": "poison"}).message_id
    waiting = publish(topic.name, {"n": "waiting"}, deduplication_key="order-1").message_id
    by_message = {}
    for receiver in (on_retry, on_last):
        for delivery in receiver.receive(10).deliveries:
            by_message[(receiver.subscription_id, delivery.message_id)] = delivery
    for receiver in (on_retry, on_last):
        sub = receiver.subscription_id
        assert receiver.complete(by_message[(sub, done)]).settled
        assert receiver.dead_letter(by_message[(sub, poison)], "Poison").settled
        receiver.release(by_message[(sub, dropped)])
        transport.discard_or_cancel(sub, by_message[(sub, dropped)].delivery_id, "ops", "no")
    # `waiting` stays claimed (InFlight) on both: its leases will have passed.

    get_driver().shift_time(DAY + 60, topic_id=str(topic.id))  # past retention and the leases
    fresh = publish(topic.name, {"n": "fresh"}, deduplication_key="order-2").message_id
    elsewhere = SubscriptionFactory(lease_seconds=30)
    publish(elsewhere.topic.name, {})
    (live,) = Receiver(elsewhere.id, "holder").receive(1).deliveries  # its lease has not passed

    result = Sweeper().run_once()

    assert not result.skipped
    sub_retry, sub_last = on_retry.subscription_id, on_last.subscription_id
    # Completed and Discarded past retention: gone. Dead letters: never purged.
    for sub in (sub_retry, sub_last):
        assert status(by_message[(sub, done)].delivery_id) is None
        assert status(by_message[(sub, dropped)].delivery_id) is None
        assert status(by_message[(sub, poison)].delivery_id) == ("DeadLettered", 1, "Poison")
    # Passed leases: retried with attempts left, dead-lettered on the last attempt.
    assert status(by_message[(sub_retry, waiting)].delivery_id) == ("Pending", 1, None)
    assert status(by_message[(sub_last, waiting)].delivery_id) == (
        "DeadLettered",
        1,
        "LeaseExpired",
    )
    assert [(d["delivery_id"], d["reason"]) for d in dead_letters] == [
        (by_message[(sub_last, waiting)].delivery_id, "LeaseExpired")
    ]
    (logged,) = [r for r in caplog.records if r.name == "workqueue.deliveries"]
    assert logged.levelname == "ERROR" and "LeaseExpired" in logged.getMessage()
    assert logged.delivery_id == by_message[(sub_last, waiting)].delivery_id
    # Live work is untouched.
    assert status(live.delivery_id) == ("InFlight", 1, None)
    assert Delivery.objects.filter(message_id=fresh, status="Pending").count() == 2
    # Messages: only those no delivery refers to any more are purged.
    assert set(Message.objects.filter(topic=topic).values_list("id", flat=True)) == {
        uuid.UUID(poison),
        uuid.UUID(waiting),
        uuid.UUID(fresh),
    }
    # No delivery outlives its message (nothing but this rule keeps them together: deliveries
    # hold their message id without a database constraint).
    assert not Delivery.objects.exclude(message_id__in=Message.objects.values("id")).exists()
    # Deduplication: the closed window goes, the open one stays.
    assert list(Deduplication.objects.filter(topic=topic).values_list("deduplication_key")) == [
        ("order-2",)
    ]
    assert (result.expired, result.expired_dead_letters) == (2, 1)
    assert result.purged["terminal_deliveries"] >= 4
    assert result.purged["orphan_messages"] >= 2
    assert result.purged["expired_deduplications"] >= 1


def test_rows_within_retention_are_kept(dead_letters):
    topic = TopicFactory(retention_days=2)
    sub = SubscriptionFactory(topic=topic)
    receiver = Receiver(sub.id, "holder")
    message = publish(topic.name, {}).message_id
    (delivery,) = receiver.receive(1).deliveries
    assert receiver.complete(delivery).settled
    get_driver().shift_time(DAY + 60, topic_id=str(topic.id))  # one day old: retention is two

    Sweeper().run_once()

    assert status(delivery.delivery_id) == ("Completed", 1, None)
    assert Message.objects.filter(pk=message).exists()


def test_a_second_sweeper_skips_its_pass_while_another_holds_the_lock():
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transport.sweep_lock() as acquired:
                assert acquired
                holding.set()
                release.wait(10)
        finally:
            get_driver().close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(10)
        assert Sweeper().run_once().skipped
    finally:
        release.set()
        holder.join(10)
    assert not Sweeper().run_once().skipped  # and the next pass runs
