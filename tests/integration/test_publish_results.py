"""What ``publish`` hands back (issue 17 §6): one status type on every path, a message id only
when a message exists, an opt-in exception for rejections, and payloads encoded the way Django
encodes JSON (Decimal, datetime, UUID) on every Python entry path."""

from __future__ import annotations

import datetime as dt
import decimal
import logging
import uuid

import pytest

from tests.factories import SubscriptionFactory, TopicFactory
from workqueue import PublishRejectedError, publish, publish_many, publish_or_raise
from workqueue.models import Message
from workqueue.types import PublishStatus

pytestmark = pytest.mark.usefixtures("queue_db")


def test_every_result_has_a_publish_status_and_only_stored_messages_have_ids():
    sub = SubscriptionFactory()
    topic = sub.topic.name
    given = uuid.uuid4()

    accepted = publish(topic, {"n": 1}, message_id=given)
    duplicate = publish(topic, {"n": 1}, message_id=given)
    # Rejected by the procedure (same id, other content) and locally (bad attribute name).
    conflict = publish(topic, {"n": 2}, message_id=given)
    invalid = publish(topic, {"n": 3}, attributes={"bad name": "x"}, message_id=uuid.uuid4())
    [batch_rejected] = publish_many("no-such-topic", [{"payload": 1}])

    results = [accepted, duplicate, conflict, invalid, batch_rejected]
    assert [type(r.status) for r in results] == [PublishStatus] * 5
    assert [r.status for r in results] == ["Accepted", "Duplicate"] + ["Rejected"] * 3
    assert accepted.message_id == duplicate.message_id == str(given)
    assert [r.message_id for r in (conflict, invalid, batch_rejected)] == [None, None, None]
    assert [r.accepted for r in results] == [True, False, False, False, False]
    assert conflict.error.code == "MessageIDConflict"
    assert batch_rejected.error.code == "TopicNotFound"


def test_publish_or_raise_raises_with_the_result_and_lets_duplicates_through():
    sub = SubscriptionFactory()
    given = uuid.uuid4()

    first = publish_or_raise(sub.topic.name, {"n": 1}, message_id=given)
    again = publish_or_raise(sub.topic.name, {"n": 1}, message_id=given)
    with pytest.raises(
        PublishRejectedError, match="TopicNotFound: No topic is named 'no-such-topic'"
    ) as exc:
        publish_or_raise("no-such-topic", {"n": 1})

    assert first.accepted and again.status == PublishStatus.DUPLICATE
    assert exc.value.result.status == PublishStatus.REJECTED
    assert exc.value.code == "TopicNotFound" and exc.value.retryable is False


def test_a_topic_no_one_created_is_answered_with_the_names_it_resembles_and_the_fix():
    """It said only "No topic is named 'orders.creatd'." (helper-113's first hour)."""
    TopicFactory(name="orders.created")

    single = publish("orders.creatd", {"n": 1})
    batch = publish_many("orders.creatd", [{"payload": 1}, {"payload": 2}])
    # A message refused before the database is asked (a priority out of range): the topic's
    # problem outranks it, and said only "No topic has this name." (seen from the CLI).
    invalid = publish("orders.creatd", {"n": 1}, priority=500)
    with_an_invalid = publish_many("orders.creatd", [{"payload": 1}, {"priority": 500}])

    for result in (single, *batch, invalid, *with_an_invalid):
        assert result.error.message == (
            "No topic is named 'orders.creatd'. Did you mean 'orders.created'? Create it in "
            "the admin, or declare it in WORKQUEUE['TOPOLOGY'] and run `manage.py workqueue "
            "sync-topology`."
        )


def test_an_external_publisher_is_told_no_other_topics_name():
    """The REST API publishes with external=True; a topic deleted after its lookup comes back
    as a TopicNotFound result in the response body, which must not list the topics its name
    resembles."""
    TopicFactory(name="orders.created")

    [result] = publish_many("orders.creatd", [{"payload": 1}], external=True)

    assert result.error.message == "No topic is named 'orders.creatd'."


def test_raise_if_rejected_works_on_each_result_of_a_batch():
    sub = SubscriptionFactory()
    ok, bad = publish_many(sub.topic.name, [{"payload": 1}, {"partition_key": ""}])

    assert ok.raise_if_rejected() is ok
    with pytest.raises(PublishRejectedError) as exc:
        bad.raise_if_rejected()
    assert exc.value.code == "InvalidPartitionKey"


def test_decimal_datetime_and_uuid_payloads_are_stored_as_django_encodes_them():
    topic = TopicFactory()
    SubscriptionFactory(topic=topic)
    ident = uuid.UUID("12345678-1234-5678-1234-567812345678")
    when = dt.datetime(2026, 12, 1, 9, 30, tzinfo=dt.UTC)
    payload = {"amount": decimal.Decimal("12.50"), "at": when, "id": ident, "day": when.date()}
    expected = {
        "amount": "12.50",
        "at": "2026-12-01T09:30:00Z",
        "id": str(ident),
        "day": "2026-12-01",
    }
    given = uuid.uuid4()

    single = publish(topic.name, payload, message_id=given)
    # The same content again is recognised as the same message (the encoding is stable).
    again = publish(topic.name, dict(payload), message_id=given)
    [batch] = publish_many(topic.name, [{"payload": payload, "attributes": {"via": "batch"}}])

    assert single.accepted and again.status == "Duplicate" and batch.accepted
    stored = Message.objects.filter(id__in=[single.message_id, batch.message_id])
    assert [m.payload for m in stored] == [expected, expected]


def test_a_topic_no_one_made_is_named_without_the_transaction_hint():
    result = publish("no.such-topic", {"n": 1})
    assert result.error.message.startswith("No topic is named 'no.such-topic'. Create it")
    assert "transaction" not in result.error.message


def test_a_rejected_publish_is_logged_once_a_call_with_the_first_reason(caplog):
    """Audit helper-98: a Rejected result was logged nowhere, so a caller that did not look at
    it (``publish(...)`` and a redirect) lost the message without a trace."""
    caplog.set_level(logging.WARNING, logger="workqueue.publishing")
    topic = TopicFactory()

    assert publish("orders.creatd", {"n": 1}).status == "Rejected"
    publish_many(
        topic.name,
        [{"payload": {"n": 2}}, {"payload": {"n": 3}, "attributes": {"region": 5}}] * 2,
    )
    assert publish(topic.name, {"n": 4}).accepted

    lines = [r.getMessage() for r in caplog.records if r.name == "workqueue.publishing"]
    assert len(lines) == 2, lines
    assert "1 of 1 message(s) published to topic 'orders.creatd' were rejected" in lines[0]
    assert "TopicNotFound" in lines[0]
    assert f"2 of 4 message(s) published to topic '{topic.name}'" in lines[1]
    assert "InvalidAttributes" in lines[1]
