"""``publish_many`` writes a batch without deduplication keys set-based (issue 12): one INSERT of
its messages and one of their deliveries. Each item must still get the result ``publish`` would
give it, alone and in array order: these tests publish the same items through ``publish_many``
to one topic and one by one through ``publish`` to a twin topic, and compare."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import pytest
from django.db.models import F

from tests.factories import SubscriptionFactory, TopicFactory
from tests.support.filter_cases import leaf, root
from workqueue import publish, publish_many
from workqueue.models import Delivery, Message

pytestmark = pytest.mark.usefixtures("queue_db")


def twin_topic(**topic_fields: Any) -> tuple[str, list[str]]:
    """A topic with an unfiltered, a filtered and an ordered subscription."""
    topic = TopicFactory(**topic_fields)
    subs = [
        SubscriptionFactory(topic=topic),
        SubscriptionFactory(topic=topic, filter=root(leaf("colour", "eq", "red"))),
        SubscriptionFactory(topic=topic, partition_mode="Ordered"),
    ]
    return topic.name, [s.name for s in subs]


def outcome(results, subs: list[str]) -> list[tuple[Any, ...]]:
    """Per item: status, error code, and per subscription whether it got a delivery."""
    rows = []
    for r in results:
        got = (
            set(
                Delivery.objects.filter(message_id=r.message_id).values_list(
                    "subscription__name", flat=True
                )
            )
            if r.accepted
            else set()
        )
        rows.append((r.status, r.error.code if r.error else None, tuple(s in got for s in subs)))
    return rows


def test_each_item_gets_the_result_publish_would_give_it_in_array_order():
    batch_topic, batch_subs = twin_topic(max_payload_bytes=200, retention_days=1)
    single_topic, single_subs = twin_topic(max_payload_bytes=200, retention_days=1)
    reused, taken = uuid.uuid4(), uuid.uuid4()
    items: list[dict[str, Any]] = [
        {"payload": {"n": 0}, "attributes": {"colour": "red"}, "partition_key": "k1"},
        {"payload": {"n": 1}, "attributes": {"colour": "blue"}, "partition_key": "k1"},
        {"payload": {"n": 2}, "message_id": reused},
        # The same id again: the same content is a Duplicate, other content a conflict.
        {"payload": {"n": 2}, "message_id": reused},
        {"payload": {"n": 3}, "message_id": reused},
        # Checked by the procedure only: beyond retention, larger than the topic allows.
        {"payload": {"n": 4}, "delay_seconds": 3 * 86400},
        {"payload": {"big": "x" * 400}},
        {"payload": {"n": 6}, "priority": 7, "delay_seconds": 60},
        # An id already stored (by another topic: a conflict whatever the content).
        {"payload": {"n": 7}, "message_id": taken},
        # Rejected locally, before the database.
        {"payload": {"n": 8}, "attributes": {"bad name": "x"}},
        {"payload": {"n": 9}, "partition_key": "k0"},
    ]
    assert publish(TopicFactory().name, {"n": 7}, message_id=taken).accepted

    batched = publish_many(batch_topic, items)
    # The twin gets fresh ids where the batch reused one, so the id rules apply alike.
    twin_ids = {reused: uuid.uuid4()}
    one_by_one = [
        publish(
            single_topic,
            **{**item, "message_id": twin_ids.get(item.get("message_id"), item.get("message_id"))},
        )
        for item in items
    ]

    assert outcome(batched, batch_subs) == outcome(one_by_one, single_subs)
    assert [r.status for r in batched] == [
        "Accepted",
        "Accepted",
        "Accepted",
        "Duplicate",
        "Rejected",
        "Rejected",
        "Rejected",
        "Accepted",
        "Rejected",
        "Rejected",
        "Accepted",
    ]
    accepted = [r.message_id for r in batched if r.accepted]
    ordinals = [Message.objects.get(id=m).publish_ordinal for m in accepted]
    assert ordinals == sorted(ordinals) and len(set(ordinals)) == len(ordinals)
    # Each delivery carries its message's ordinal, due time and priority as publish sets them.
    scheduled = Delivery.objects.get(
        message_id=batched[7].message_id, subscription__name=batch_subs[0]
    )
    assert scheduled.priority == 7 and scheduled.order_key == ordinals[3]
    assert Delivery.objects.filter(message__topic__name=batch_topic).count() == (
        Delivery.objects.filter(message__topic__name=single_topic).count()
    )


def test_a_batch_to_a_missing_or_disabled_topic_is_rejected_item_by_item():
    disabled = TopicFactory(status="Disabled")
    for name, code in ((disabled.name, "TopicDisabled"), ("test.no-such", "TopicNotFound")):
        results = publish_many(name, [{"payload": 1}, {"payload": 2}])
        assert [(r.status, r.error.code) for r in results] == [("Rejected", code)] * 2
    assert not Message.objects.filter(topic=disabled).exists()


def test_a_batch_with_a_deduplication_key_keeps_the_key_rules():
    name, _ = twin_topic()
    first = publish_many(name, [{"payload": 1, "deduplication_key": "d"}, {"payload": 2}])
    again = publish_many(name, [{"payload": 3}, {"payload": 1, "deduplication_key": "d"}])
    assert [r.status for r in first + again] == ["Accepted", "Accepted", "Accepted", "Duplicate"]
    assert again[1].message_id == first[0].message_id


def test_a_batch_stored_whole_is_accepted_item_by_item_with_each_items_due_time():
    """Every item stored (the procedure's shortest answer): Accepted for each, in array order,
    with each item's own due time and priority. Published again, the same batch is answered
    item by item: Duplicate for each, the same ids."""
    name, subs = twin_topic(retention_days=1)
    chosen = [uuid.uuid4() for _ in range(4)]
    items: list[dict[str, Any]] = [
        {"payload": {"n": 0}, "message_id": chosen[0]},
        {"payload": {"n": 1}, "message_id": chosen[1], "not_before": "2001-01-01T00:00:00+00:00"},
        {"payload": {"n": 2}, "message_id": chosen[2], "delay_seconds": 3600, "priority": -5},
        {"payload": {"n": 3}, "message_id": chosen[3], "attributes": {"colour": "red"}},
    ]
    stored = publish_many(name, items)
    assert [(r.status, r.message_id) for r in stored] == [("Accepted", str(i)) for i in chosen]
    due = {
        str(d.message_id): (d.visible_at, d.priority, d.published_at)
        for d in Delivery.objects.filter(subscription__name=subs[0]).annotate(
            published_at=F("message__published_at")
        )
    }
    for index in (0, 1, 3):
        visible_at, priority, published_at = due[str(chosen[index])]
        assert (visible_at, priority) == (published_at, 0)
    visible_at, priority, published_at = due[str(chosen[2])]
    # The delay runs from the call, the publish time from its transaction's start: moments.
    assert priority == -5
    assert dt.timedelta(hours=1) <= visible_at - published_at < dt.timedelta(hours=1, seconds=1)
    # The filtered subscription got the red one only.
    assert list(
        Delivery.objects.filter(subscription__name=subs[1]).values_list("message_id", flat=True)
    ) == [chosen[3]]

    again = publish_many(name, items)
    assert [(r.status, r.message_id) for r in again] == [("Duplicate", str(i)) for i in chosen]


def test_a_batch_fans_out_to_active_and_paused_subscriptions_never_to_a_disabled_one():
    """Every status test published one message at a time (wq_publish): the batch's own fan-out
    could write a Disabled subscription deliveries unseen (helper-104)."""
    topic = TopicFactory()
    active = SubscriptionFactory(topic=topic)
    paused = SubscriptionFactory(topic=topic, status="Paused")
    disabled = SubscriptionFactory(topic=topic, status="Disabled")

    results = publish_many(topic.name, [{"payload": 1}, {"payload": 2}])

    assert [r.status for r in results] == ["Accepted", "Accepted"]
    for result in results:
        receivers = Delivery.objects.filter(message_id=result.message_id)
        assert set(receivers.values_list("subscription_id", flat=True)) == {active.id, paused.id}
    assert not Delivery.objects.filter(subscription=disabled).exists()
