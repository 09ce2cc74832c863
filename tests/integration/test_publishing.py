from __future__ import annotations

import datetime as dt
import time
import uuid

import pytest
from django.conf import settings
from django.db import connection, transaction
from django.test import override_settings

from tests.factories import SubscriptionFactory, TopicFactory
from tests.support.routers import QUEUE_ALIAS
from workqueue import publish, publish_many
from workqueue.exceptions import EnlistError
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

    claimed = {d.message_id: d.decoded_payload() for d in Receiver(sub.id).receive(10).deliveries}

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


def _halves(delivery_id: uuid.UUID) -> tuple[int, int]:
    """(the id's first eight bytes, its last eight) as unsigned numbers."""
    return delivery_id.int >> 64, delivery_id.int & (2**64 - 1)


def test_a_batchs_delivery_ids_count_up_from_a_fresh_random_start():
    # wq_publish_many draws strong randomness once per batch, not once per delivery (migration
    # 0033): consecutive ids in insertion order, from a random start no other batch shares.
    topic = TopicFactory()
    subs = [SubscriptionFactory(topic=topic) for _ in range(3)]
    batches = []
    for _ in range(2):
        results = publish_many(topic.name, [{"payload": {"n": n}} for n in range(4)])
        assert all(r.accepted for r in results)
        batches.append([r.message_id for r in results])
        time.sleep(0.003)

    starts = []
    for message_ids in batches:
        rows = Delivery.objects.filter(subscription__in=subs, message_id__in=message_ids)
        ids_of: dict[str, list[uuid.UUID]] = {m: [] for m in message_ids}
        for delivery_id, message_id in rows.values_list("id", "message_id"):
            ids_of[str(message_id)].append(delivery_id)
        ids = [i for m in message_ids for i in sorted(ids_of[m])]
        assert len(ids) == 12 and {i.version for i in ids} == {7}
        assert {i.variant for i in ids} == {uuid.RFC_4122}
        clocks, randoms = zip(*map(_halves, ids), strict=True)
        assert len(set(clocks)) == 1, "one statement, one time"
        # Counted up by one per row, in item order: each message's ids above the previous one's.
        assert list(randoms) == list(range(randoms[0], randoms[0] + 12))
        # The random start leaves the counting 2^61 rows before it could reach the variant.
        assert randoms[0] >> 61 == 0b100
        starts.append((clocks[0], randoms[0]))
    (first_clock, first_start), (second_clock, second_start) = starts
    assert first_clock < second_clock, "later batches sort after earlier ones"
    assert abs(second_start - first_start) > 12, "each batch starts from its own random number"


def test_random_starts_keep_the_variant_and_headroom_and_never_repeat():
    with connection.cursor() as cursor:
        # Top bits 100 (the variant's 10, then the headroom bit), as an arithmetic shift of a
        # bigint reads them: -4.
        cursor.execute(
            "SELECT bool_and(r >> 61 = -4), count(DISTINCT r) "
            "FROM (SELECT wq_id_random() AS r FROM generate_series(1, 10000)) s"
        )
        assert cursor.fetchone() == (True, 10000)
        # The highest start there can be, counted past more rows than any batch has.
        cursor.execute("SELECT wq_id_at(0, x'9FFFFFFFFFFFFFFF'::bit(64)::bigint, 2147483647)")
        (last,) = cursor.fetchone()
    assert uuid.UUID(str(last)).variant == uuid.RFC_4122


@pytest.mark.parametrize("many", [False, True], ids=["publish", "publish_many"])
def test_a_delay_in_a_long_transaction_runs_from_the_publish_call(many):
    """PostgreSQL's now() is when the transaction began: a publish enlisted 3 s into a
    transaction with delay_seconds=2 was due before it committed, and claimable at once."""
    topic = TopicFactory()
    sub = SubscriptionFactory(topic=topic)
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SELECT now()")  # the transaction starts here
        time.sleep(2.5)  # and has run a while when the publish is made
        if many:
            publish_many(
                topic, [{"payload": {"n": n}, "delay_seconds": 2} for n in range(2)], enlist=True
            )
        else:
            publish(topic.name, {"n": 1}, delay_seconds=2, enlist=True)

    assert Receiver(sub.id).receive(5).deliveries == [], "due before its delay from the call"


def test_a_deduplication_window_in_a_long_transaction_runs_from_the_publish_call():
    """PostgreSQL's now() is when the transaction began. A publish enlisted late in a long
    transaction had its deduplication window cut short by that much: gone at commit if the
    transaction had run longer than the TTL, so a second message for the key was accepted
    within its TTL. SQL Server's procedures count from the call."""
    topic = TopicFactory()
    SubscriptionFactory(topic=topic)
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SELECT now()")
            (began,) = cursor.fetchone()
        time.sleep(2)  # the transaction has run a while when the publish is made
        with connection.cursor() as cursor:
            cursor.execute("SELECT clock_timestamp()")
            (called,) = cursor.fetchone()
        result = publish(
            topic.name, {"n": 1}, deduplication_key="order-1", deduplication_ttl=60, enlist=True
        )

    assert result.accepted and called - began >= dt.timedelta(seconds=2)
    ledger = Deduplication.objects.get(topic=topic, deduplication_key="order-1")
    assert ledger.expires_at >= called + dt.timedelta(seconds=60)


def test_an_enlisted_publish_joins_a_transaction_begun_by_turning_autocommit_off():
    """Not only an atomic block: a transaction begun with set_autocommit(False) is joined, and
    its rollback takes the publish with it (review helper-93)."""
    topic = SubscriptionFactory().topic
    transaction.set_autocommit(False)
    try:
        assert publish(topic.name, {"n": 1}, enlist=True).accepted
        transaction.rollback()
    finally:
        transaction.set_autocommit(True)

    assert not Message.objects.filter(topic=topic).exists()


def test_an_enlisted_publish_with_no_transaction_open_anywhere_commits_at_once():
    """Nothing to join and nothing to outlive (an on_commit callback, a handler or a command
    without a block): it commits at once, as an unenlisted publish does, as it always has."""
    topic = SubscriptionFactory().topic

    assert publish(topic.name, {"n": 1}, enlist=True).accepted

    assert Message.objects.filter(topic=topic).count() == 1


@pytest.mark.django_db(transaction=True, databases=["default", QUEUE_ALIAS])
def test_an_enlisted_publish_in_a_block_on_another_alias_raises_and_survives_no_rollback():
    """Audit helper-91: with the queue on an alias of its own, a publish enlisted in the
    caller's block on ``default`` committed at once on the queue's alias and outlived the
    block's rollback."""
    with override_settings(
        DATABASE_ROUTERS=["tests.support.routers.WorkQueueAliasRouter"],
        WORKQUEUE={**settings.WORKQUEUE, "DATABASE_ALIAS": QUEUE_ALIAS},
    ):
        topic = SubscriptionFactory().topic
        with (
            pytest.raises(EnlistError, match=r"found a transaction on database 'default'"),
            transaction.atomic(using="default"),
        ):
            publish(topic.name, {"n": 1}, enlist=True)

        assert not Message.objects.filter(topic=topic).exists()


@pytest.mark.parametrize("batched", [False, True], ids=["publish", "publish_many"])
def test_a_messages_own_deduplication_ttl_ends_its_window_not_the_topics_default(batched):
    """Only single publishes were tried past their TTL: a batch whose procedure dropped each
    message's TTL for the topic's default kept answering Duplicate (helper-103)."""
    from workqueue.driver import get_driver

    topic = TopicFactory(default_deduplication_ttl_seconds=300)
    SubscriptionFactory(topic=topic)

    def sent(n: int, ttl: int | None = None) -> str:
        message = {"payload": {"n": n}, "deduplication_key": "order-1", "deduplication_ttl": ttl}
        if batched:  # with another message: a batch of one is published as one
            return publish_many(topic.name, [message, {"payload": {"other": n}}])[0].status
        return publish(topic.name, **message).status

    first = sent(1, ttl=60)
    within = sent(2)
    get_driver().shift_time(70, topic_id=str(topic.id))  # past its 60 s, within the default's
    after = sent(3)

    assert (first, within, after) == ("Accepted", "Duplicate", "Accepted")


def test_an_external_publish_in_python_to_a_topic_closed_to_it_is_rejected():
    """The REST API refuses first, so no test had tried the library path (helper-104): a
    caller passing external=True (a gateway of its own) is refused by the procedure itself,
    whatever the Python check before it does."""
    topic = TopicFactory(allow_external_publish=False)
    SubscriptionFactory(topic=topic)

    result = publish(topic.name, {"n": 1}, external=True)

    assert (result.status, result.error.code) == ("Rejected", "TopicNotExternallyPublishable")
    assert not Message.objects.filter(topic=topic).exists()


@pytest.mark.parametrize("external", [True, False])
@pytest.mark.parametrize("count", [1, 3], ids=["wq_publish", "wq_publish_many"])
def test_a_message_records_whether_an_api_key_published_it(external, count):
    """What the Tasks API's handler rule reads (migration 0049): each procedure stores the
    application's word, ``external``, for every message it writes."""
    topic = TopicFactory(allow_external_publish=True)
    SubscriptionFactory(topic=topic)

    results = publish_many(
        topic.name, [{"payload": {"n": n}} for n in range(count)], external=external
    )

    ids = [r.message_id for r in results]
    stored = set(Message.objects.filter(id__in=ids).values_list("published_externally", flat=True))
    assert stored == {external}
