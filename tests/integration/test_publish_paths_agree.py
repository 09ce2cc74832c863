"""Every way a message is stored keeps what it was given and refuses it at the same bounds:
``wq_publish`` (one message), ``wq_publish_many``'s set-based path (a batch of two or more with
no deduplication key) and its item-by-item path (a batch with deduplication keys). The tests
before compared them mostly by payload and below the bounds: a batch could drop a message's
priority, delay or payload reference, take a size, delay or priority one past its limit, or
read a re-published id whose attributes or reference changed as a Duplicate, and no test failed
(audit helper-110)."""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection, transaction
from django.utils import timezone

from tests.factories import SubscriptionFactory, TopicFactory
from tests.support.filter_cases import leaf, root
from workqueue import publish, publish_many
from workqueue.driver.base import canonical_json
from workqueue.models import Delivery, Message, Subscription
from workqueue.transport import Receiver
from workqueue.types import PublishResult

pytestmark = pytest.mark.usefixtures("queue_db")


def one_by_one(topic: str, items: list[dict[str, Any]]) -> list[PublishResult]:
    return [publish(topic, **item) for item in items]


def in_a_batch(topic: str, items: list[dict[str, Any]]) -> list[PublishResult]:
    return publish_many(topic, items)


def in_a_keyed_batch(topic: str, items: list[dict[str, Any]]) -> list[PublishResult]:
    # A deduplication key on each item: the batch is stored item by item.
    return publish_many(topic, [{**item, "deduplication_key": uuid.uuid4().hex} for item in items])


PATHS: dict[str, Callable[[str, list[dict[str, Any]]], list[PublishResult]]] = {
    "publish": one_by_one,
    "batch": in_a_batch,
    "keyed batch": in_a_keyed_batch,
}


def outcomes(results: list[PublishResult]) -> list[str]:
    return [r.error.code if r.error else str(r.status) for r in results]


def envelope_bytes(**fields: Any) -> int:
    """The documented measure of a message's size (see PayloadTooLarge)."""
    envelope = {
        "partition_key": None,
        "attributes": None,
        "payload": None,
        "payload_ref": None,
        "correlation_id": None,
        **fields,
    }
    return len(canonical_json(envelope).encode("utf-8"))


@pytest.mark.parametrize("path", PATHS)
def test_each_path_takes_a_message_of_the_size_limit_and_not_a_byte_more(path):
    topic = TopicFactory(max_payload_bytes=1000)
    SubscriptionFactory(topic=topic)
    room = 1000 - envelope_bytes(payload="")

    results = PATHS[path](
        topic.name,
        [{"payload": "x" * room}, {"payload": "y" * room}, {"payload": "z" * (room + 1)}],
    )

    assert outcomes(results) == ["Accepted", "Accepted", "PayloadTooLarge"]


@pytest.mark.parametrize("path", PATHS)
def test_each_path_takes_a_delay_of_the_whole_retention_and_not_a_second_more(path):
    topic = TopicFactory(retention_days=1)
    SubscriptionFactory(topic=topic)

    results = PATHS[path](
        topic.name,
        [{"payload": 1, "delay_seconds": 86_400}, {"payload": 2, "delay_seconds": 86_401}],
    )

    assert outcomes(results) == ["Accepted", "InvalidSchedule"]


@pytest.mark.parametrize("path", PATHS)
def test_each_path_takes_the_highest_and_lowest_priority(path):
    topic = TopicFactory()
    sub = SubscriptionFactory(topic=topic)

    results = PATHS[path](
        topic.name, [{"payload": 1, "priority": 100}, {"payload": 2, "priority": -100}]
    )

    assert outcomes(results) == ["Accepted", "Accepted"]
    stored = dict(Delivery.objects.filter(subscription=sub).values_list("message_id", "priority"))
    assert [stored[uuid.UUID(r.message_id)] for r in results] == [100, -100]


@pytest.mark.parametrize("path", PATHS)
def test_each_path_stores_every_field_it_was_given(path):
    topic = TopicFactory()
    sub = SubscriptionFactory(topic=topic, partition_mode="Exclusive")
    later = timezone.now() + dt.timedelta(hours=2)
    given = [
        {
            "payload_ref": {"uri": "s3://bucket/one"},
            "attributes": {"region": "eu"},
            "correlation_id": "c-1",
            "partition_key": "k-1",
            "priority": 9,
            "delay_seconds": 3600,
        },
        {"payload": {"n": 2}, "priority": -3, "not_before": later},
    ]
    before = timezone.now()

    results = PATHS[path](topic.name, given)

    assert outcomes(results) == ["Accepted", "Accepted"]
    first, second = (Message.objects.get(pk=r.message_id) for r in results)
    assert (first.payload_ref, first.attributes, first.correlation_id, first.partition_key) == (
        {"uri": "s3://bucket/one"},
        {"region": "eu"},
        "c-1",
        "k-1",
    )
    assert second.payload == {"n": 2}
    deliveries = {d.message_id: d for d in Delivery.objects.filter(subscription=sub)}
    delayed, scheduled = deliveries[first.pk], deliveries[second.pk]
    assert (delayed.priority, scheduled.priority) == (9, -3)
    assert delayed.visible_at >= before + dt.timedelta(seconds=3600)
    assert scheduled.visible_at == later


FIELDS = {
    "payload": ("payload", {"n": 1}, {"n": 2}),
    "attributes": ("attributes", {"a": "x"}, {"a": "y"}),
    "payload_ref": ("payload_ref", {"uri": "s3://b/1"}, {"uri": "s3://b/2"}),
    "correlation_id": ("correlation_id", "c-1", "c-2"),
    "partition_key": ("partition_key", "k-1", "k-2"),
}


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("path", PATHS)
def test_a_republished_id_is_a_duplicate_only_with_every_field_the_same(path, field):
    topic = TopicFactory()
    SubscriptionFactory(topic=topic)
    name, first_value, other_value = FIELDS[field]
    message: dict[str, Any] = {"attributes": {"a": "x"}, "correlation_id": "c-1"}
    if name != "payload_ref":  # a message holds a payload or a reference to one
        message["payload"] = {"n": 1}
    message = {**message, name: first_value, "message_id": str(uuid.uuid4())}
    assert publish(topic.name, **message).accepted
    filler = {"payload": {"filler": True}}  # so a batch is stored as one

    same, changed = (
        PATHS[path](topic.name, [{**message, name: value}, filler])[0]
        for value in (first_value, other_value)
    )

    assert (outcomes([same]), outcomes([changed])) == (["Duplicate"], ["MessageIDConflict"])


def test_republishing_a_keys_owner_keeps_the_keys_window():
    """A re-publish of the id that owns a deduplication key, with that key, is a Duplicate
    and leaves the key to its owner: a later publish with the key is a Duplicate of it."""
    topic = TopicFactory()
    SubscriptionFactory(topic=topic)
    owner = str(uuid.uuid4())

    results = [
        publish(topic.name, {"n": 1}, deduplication_key="k", message_id=owner),
        publish(topic.name, {"n": 1}, deduplication_key="k", message_id=owner),
        publish(topic.name, {"n": 2}, deduplication_key="k"),
    ]

    assert outcomes(results) == ["Accepted", "Duplicate", "Duplicate"]
    assert results[2].message_id == owner
    assert Message.objects.filter(topic=topic).count() == 1


# -- an Ordered key's publish order, whatever the subscription's state and filter -------------


def _an_open_publish_then_another(
    topic: str, first: Callable[[], Any], resume: Callable[[], None] = lambda: None
) -> list[Any]:
    """``first`` publishes in a transaction left open 1.5 s; meanwhile the key's next message
    is published on its own, then the subscription claims: what it was given."""
    entered = threading.Event()

    def hold_open() -> None:
        try:
            with transaction.atomic():
                first()
                entered.set()
                time.sleep(1.5)
        finally:
            connection.close()

    holder = threading.Thread(target=hold_open)
    holder.start()
    try:
        assert entered.wait(10)
        publish(topic, {"n": "next"}, partition_key="k", attributes={"colour": "red"})
        resume()
        sub = Subscription.objects.get(topic__name=topic)
        return [d.decoded_payload() for d in Receiver(sub.id).receive(5).deliveries]
    finally:
        holder.join(10)


def test_a_keyed_publish_to_a_filtered_ordered_subscription_holds_its_keys_order():
    """The key's order lock was taken only for subscriptions without a filter: the next
    message, committed first, was claimed before the open publish's (audit helper-110)."""
    topic = TopicFactory()
    SubscriptionFactory(
        topic=topic, partition_mode="Ordered", filter=root(leaf("colour", "eq", "red"))
    )

    claimed = _an_open_publish_then_another(
        topic.name,
        lambda: publish(
            topic.name, {"n": 1}, partition_key="k", attributes={"colour": "red"}, enlist=True
        ),
    )

    assert claimed == [{"n": 1}]


def test_a_batch_to_a_paused_ordered_subscription_holds_its_keys_order():
    """A batch took the keys' order locks only for Active subscriptions: a Paused one resumed
    meanwhile had the key's next message claimed before the batch's (audit helper-110)."""
    topic = TopicFactory()
    sub = SubscriptionFactory(topic=topic, partition_mode="Ordered", status="Paused")

    claimed = _an_open_publish_then_another(
        topic.name,
        lambda: publish_many(
            topic.name,
            [
                {"payload": {"n": 1}, "partition_key": "k", "attributes": {"colour": "red"}},
                {"payload": {"n": 2}, "partition_key": "k", "attributes": {"colour": "red"}},
            ],
            enlist=True,
        ),
        resume=lambda: Subscription.objects.filter(pk=sub.pk).update(status="Active"),
    )

    assert claimed == [{"n": 1}]
