"""Attack tests (issue 10, item 8) through the Python API and the CLI: text the database cannot
store (a NUL character, a lone surrogate), JSON nested deeper than 64 levels and NaN are refused
before any database work with an error naming the field: ``InvalidInputError`` (a
``ValueError``) from ``publish``/``publish_many`` and the operator functions, a
``CommandError`` (stderr, exit 1) from ``manage.py workqueue``. Nothing of a refused call is
stored. Against the real queue."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.factories import SubscriptionFactory, TopicFactory
from workqueue import publish, publish_many
from workqueue.exceptions import InvalidInputError
from workqueue.models import Delivery, Message
from workqueue.operators import operations
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")

NUL = "\x00"
LONE_SURROGATE = "\ud800"


def nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.fixture
def topic():
    topic = TopicFactory()
    SubscriptionFactory(topic=topic)
    return topic


# -- publish / publish_many -------------------------------------------------------------------


MALFORMED = [
    ("payload", {"payload": f"a{NUL}b"}, "NUL"),
    ("payload", {"payload": {"outer": {f"key{NUL}": 1}}}, "NUL"),
    ("payload", {"payload": [LONE_SURROGATE]}, "lone surrogate"),
    ("partition_key", {"payload": 1, "partition_key": f"customer{NUL}"}, "NUL"),
    ("partition_key", {"payload": 1, "partition_key": "\udcff"}, "lone surrogate"),
    ("deduplication_key", {"payload": 1, "deduplication_key": f"{NUL}"}, "NUL"),
    ("correlation_id", {"payload": 1, "correlation_id": LONE_SURROGATE}, "lone surrogate"),
    ("attributes", {"payload": 1, "attributes": {"region": f"eu{NUL}"}}, "NUL"),
    ("payload_ref", {"payload_ref": {"uri": f"s3://b/{LONE_SURROGATE}"}}, "lone surrogate"),
    ("payload", {"payload": nested(65)}, "nested more than 64 levels deep"),
    ("payload", {"payload": nested(950)}, "nested more than 64 levels deep"),
    ("payload", {"payload": {"ratio": math.nan}}, "NaN or Infinity"),
]
IDS = [f"{field}-{n}" for n, (field, _, _) in enumerate(MALFORMED)]


@pytest.mark.parametrize(("field", "message", "problem"), MALFORMED, ids=IDS)
def test_publish_refuses_what_the_database_cannot_store_before_any_database_work(
    topic, statements, field, message, problem
):
    with pytest.raises(InvalidInputError) as refused:
        publish(topic.name, **message)

    assert str(refused.value).startswith(f"{field} of message 0 ")
    assert problem in str(refused.value)
    assert refused.value.field == field and refused.value.index == 0
    assert statements == []
    assert Message.objects.count() == 0


@pytest.mark.parametrize(("field", "message", "problem"), MALFORMED, ids=IDS)
def test_publish_many_names_the_message_and_publishes_none_of_the_batch(
    topic, statements, field, message, problem
):
    with pytest.raises(InvalidInputError, match=rf"^{field} of message 2 "):
        publish_many(topic.name, [{"payload": 1}, {"payload": 2}, message])

    assert statements == []
    assert Message.objects.count() == 0


@pytest.mark.parametrize("name", [f"orders{NUL}", f"orders{LONE_SURROGATE}"])
def test_a_topic_name_the_database_cannot_store_is_refused(name, statements):
    with pytest.raises(InvalidInputError, match=r"^topic holds a"):
        publish(name, {"n": 1})

    assert statements == []


def test_what_looks_like_malformed_text_but_is_not_is_published_and_delivered_exactly(topic):
    payload = {"deep": nested(63), "emoji": "\U0001f600", "text": "\\u0000 \\ud800"}

    result = publish(topic.name, payload, partition_key="\\u0000", attributes={"a": "\\x00"})

    assert result.status == "Accepted"
    [delivery] = Receiver(topic.subscriptions.get().id).receive(1).deliveries
    assert delivery.payload == payload
    assert delivery.partition_key == "\\u0000"
    assert delivery.attributes == {"a": "\\x00"}


# -- operator functions -----------------------------------------------------------------------


def dead_letter() -> tuple[Any, str]:
    sub = SubscriptionFactory()
    publish(sub.topic.name, {"n": 1})
    receiver = Receiver(sub.id)
    [claimed] = receiver.receive(1).deliveries
    assert receiver.dead_letter(claimed, "Poison", "boom").settled
    return sub, claimed.delivery_id


@pytest.mark.parametrize("bad", [NUL, LONE_SURROGATE], ids=["nul", "lone-surrogate"])
def test_operator_functions_refuse_names_notes_and_reasons_the_database_cannot_store(bad):
    sub, delivery_id = dead_letter()
    calls = [
        lambda: operations.subscription_stats(f"a{bad}"),
        lambda: operations.list_dead_letters(f"a{bad}"),
        lambda: operations.list_partitions(f"a{bad}"),
        lambda: operations.backlog(f"a{bad}"),
        lambda: operations.validate_bindings(f"a{bad}"),
        lambda: operations.replay(f"a{bad}", delivery_id),
        lambda: operations.replay(sub.name, delivery_id, note=f"ok{bad}"),
        lambda: operations.discard(sub.name, delivery_id, reason=f"poison{bad}"),
    ]
    for call in calls:
        with pytest.raises(InvalidInputError, match="holds a"):
            call()

    assert Delivery.objects.get(id=delivery_id).status == "DeadLettered"
