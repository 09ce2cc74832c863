from __future__ import annotations

import time

import pytest

from tests.factories import SubscriptionFactory, TopicFactory
from workqueue import publish, publish_many
from workqueue.models import Deduplication, Delivery, Message, Topic
from workqueue.transport import Receiver
from workqueue.types import MAX_PAYLOAD_BYTES

pytestmark = pytest.mark.usefixtures("queue_db")


def test_publish_fans_out_one_pending_delivery_per_active_subscription():
    topic = TopicFactory()
    a = SubscriptionFactory(topic=topic)
    b = SubscriptionFactory(topic=topic, status="Paused")
    SubscriptionFactory(topic=topic, status="Disabled")

    result = publish(topic.name, {"hello": "world"})

    assert result.status == "Accepted"
    deliveries = Delivery.objects.filter(message_id=result.message_id)
    assert {d.subscription_id for d in deliveries} == {a.id, b.id}
    assert {d.status for d in deliveries} == {"Pending"}


def test_publish_many_keeps_positions_and_rejects_bad_items_alone():
    topic = TopicFactory()
    SubscriptionFactory(topic=topic)

    results = publish_many(
        topic.name,
        [{"payload": 1}, {"payload": 2, "attributes": {"bad name": "x"}}, {"payload": 3}],
    )

    assert [r.status for r in results] == ["Accepted", "Rejected", "Accepted"]
    assert results[1].error.code == "InvalidAttributes"
    assert Message.objects.filter(topic=topic).count() == 2


def test_receive_claims_in_one_call_and_complete_settles():
    sub = SubscriptionFactory()
    publish(sub.topic.name, {"n": 1})
    receiver = Receiver(sub.id)

    claimed = receiver.receive(10).deliveries
    assert len(claimed) == 1 and claimed[0].attempt == 1
    assert receiver.complete(claimed[0]).settled
    assert not receiver.complete(claimed[0]).settled


def test_publishing_to_ten_subscriptions_is_one_statement(statements):
    topic = TopicFactory()
    for _ in range(10):
        SubscriptionFactory(topic=topic)

    result = publish(topic.name, {"n": 1})

    assert result.status == "Accepted"
    assert len(statements) == 1 and "wq_publish(" in statements[0]
    assert Delivery.objects.filter(message_id=result.message_id).count() == 10


def test_receiving_a_hundred_deliveries_is_one_statement(statements):
    sub = SubscriptionFactory()
    publish_many(sub.topic.name, [{"payload": n} for n in range(150)])
    statements.clear()

    claimed = Receiver(sub.id).receive(100).deliveries

    assert len(claimed) == 100
    assert len(statements) == 1 and "wq_claim(" in statements[0]


@pytest.mark.parametrize(
    "payload",
    [
        "hello",
        # Text that looks like JSON is still text: only the payload's own serialisation is
        # passed on unencoded (JsonText), never a str the caller gave.
        '{"a": 1}',
        'snow ☃ "quoted" \\ and a tab\t',
        42,
        None,
        [1, "two"],
        {"nested": {"b": 1, "a": [None]}, "ü": "é"},
    ],
)
def test_any_json_payload_round_trips_alone_and_in_a_batch(payload):
    sub = SubscriptionFactory()
    single = publish(sub.topic.name, payload)
    [batched, _] = publish_many(sub.topic.name, [{"payload": payload}, {"payload": payload}])

    claimed = {d.message_id: d.payload for d in Receiver(sub.id).receive(10).deliveries}

    assert claimed[single.message_id] == payload
    assert claimed[batched.message_id] == payload


# -- the size limit before the database (issue 10, item 4) ---------------------------------------


def test_a_message_larger_than_any_topic_allows_is_rejected_without_a_driver_call(statements):
    topic = TopicFactory()

    result = publish(topic.name, "x" * MAX_PAYLOAD_BYTES)

    assert result.status == "Rejected" and result.error.code == "PayloadTooLarge"
    assert "the largest max_payload_bytes any topic may have is 262144" in result.error.message
    assert statements == []


def test_given_the_topic_a_message_over_its_limit_costs_no_database_round_trip(
    statements, django_assert_num_queries
):
    topic = Topic.objects.select_related("transport").get(pk=TopicFactory(max_payload_bytes=200).pk)

    with django_assert_num_queries(0):
        [big, fits] = publish_many(topic, [{"payload": "x" * 200}, {"payload": "x" * 10}])

    assert big.status == "Rejected" and big.error.code == "PayloadTooLarge"
    assert "the topic's max_payload_bytes is 200" in big.error.message
    assert fits.status == "Accepted"
    assert len(statements) == 1 and "wq_publish(" in statements[0]


def test_the_procedure_still_applies_the_topics_limit_when_given_only_the_name():
    topic = TopicFactory(max_payload_bytes=100)

    result = publish(topic.name, "x" * 100)

    assert result.status == "Rejected" and result.error.code == "PayloadTooLarge"


def test_the_ids_a_publish_creates_are_time_ordered():
    # Message, delivery and deduplication ids are UUIDs of version 7, so rows created together
    # sit together at the right-hand edge of their indexes (issue 12: a random id per row cost
    # a random index page per insert).
    sub = SubscriptionFactory()
    first = publish(sub.topic.name, {"n": 0}, deduplication_key="once")
    time.sleep(0.003)
    batch = publish_many(sub.topic.name, [{"payload": {"n": 1}}, {"payload": {"n": 2}}])
    time.sleep(0.003)
    last = publish(sub.topic.name, {"n": 3})
    published = [first, *batch, last]
    assert all(r.accepted for r in published)

    rows = list(
        Delivery.objects.filter(subscription=sub)
        .order_by("order_key")
        .values_list("id", "message_id")
    )
    assert [str(message_id) for _, message_id in rows] == [r.message_id for r in published]
    message_ids = [message_id for _, message_id in rows]
    delivery_ids = [delivery_id for delivery_id, _ in rows]
    (ledger_id,) = Deduplication.objects.filter(topic=sub.topic).values_list("id", flat=True)
    assert {i.version for i in [*message_ids, *delivery_ids, ledger_id]} == {7}
    for ids in (message_ids, delivery_ids):
        # Within one call two ids may share a millisecond; across the sleeps they sort in order.
        assert ids[0] < min(ids[1:3]) and max(ids[1:3]) < ids[3]
