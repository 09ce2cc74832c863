"""Publish validation at its boundaries: one table per rule, each row a value just inside or just
outside the limit and the outcome it must get (``Accepted`` or the error code), and the retry
path that turns a database that stays busy into ``TransportUnavailable``.

A table is checked as a whole (every row's outcome in one comparison), so a failure shows every
row that moved. Rejected rows must write nothing: the messages stored are exactly the accepted
rows'.
"""

from __future__ import annotations

import datetime as dt
import re
import threading
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction

from tests.factories import SubscriptionFactory, TopicFactory, TransportFactory
from tests.support.database import psycopg_params
from tests.support.queue import answers_lost_once
from workqueue import publish, publish_many, publishing
from workqueue.driver import get_driver
from workqueue.driver.base import canonical_json
from workqueue.exceptions import TransientDriverError
from workqueue.models import Delivery, Message, Subscription
from workqueue.publishing import OutgoingMessage
from workqueue.transport import TRANSIENT_RETRIES, Receiver
from workqueue.types import PublishResult

pytestmark = pytest.mark.usefixtures("queue_db")

ACCEPTED = "Accepted"


def outcome(result: PublishResult) -> str:
    """``Accepted`` (or ``Duplicate``), else the rejection's error code."""
    return result.error.code if result.error is not None else result.status


def check_table(topic_name: str, rows: dict[str, tuple[dict[str, Any], str]]) -> None:
    """Publish each row's arguments alone; every outcome must be its row's, and only the
    accepted rows may have stored a message."""
    results = {label: publish(topic_name, **kwargs) for label, (kwargs, _) in rows.items()}

    assert {label: outcome(r) for label, r in results.items()} == {
        label: expected for label, (_, expected) in rows.items()
    }
    accepted = {r.message_id for r in results.values() if r.status == ACCEPTED}
    assert {str(m) for m in Message.objects.values_list("id", flat=True)} == accepted


@pytest.fixture
def topic():
    found = TopicFactory()
    SubscriptionFactory(topic=found)
    return found


def test_topic_disabled_when_the_topic_or_its_transport_is_not_active():
    active = TopicFactory()
    disabled_topic = TopicFactory(status="Disabled")
    disabled_transport = TopicFactory(
        transport=TransportFactory(name="switched-off", status="Disabled")
    )
    for found in (active, disabled_topic, disabled_transport):
        SubscriptionFactory(topic=found)
    bad_key = {"payload": {"n": 1}, "partition_key": ""}  # a message problem of its own

    outcomes = {
        "active topic": outcome(publish(active.name, {"n": 1})),
        "disabled topic": outcome(publish(disabled_topic.name, {"n": 1})),
        "disabled transport": outcome(publish(disabled_transport.name, {"n": 1})),
        # The topic's problem outranks the message's own, on both the local and the SQL path.
        "disabled topic, bad key": outcome(publish(disabled_topic.name, **bad_key)),
        "disabled transport, bad key": outcome(publish(disabled_transport.name, **bad_key)),
        "disabled topic, batch": [
            outcome(r) for r in publish_many(disabled_topic.name, [{"payload": 1}, {"payload": 2}])
        ],
        "disabled topic, batch with a bad item": [
            outcome(r) for r in publish_many(disabled_topic.name, [{"payload": 1}, bad_key])
        ],
    }

    assert outcomes == {
        "active topic": ACCEPTED,
        "disabled topic": "TopicDisabled",
        "disabled transport": "TopicDisabled",
        "disabled topic, bad key": "TopicDisabled",
        "disabled transport, bad key": "TopicDisabled",
        "disabled topic, batch": ["TopicDisabled", "TopicDisabled"],
        "disabled topic, batch with a bad item": ["TopicDisabled", "TopicDisabled"],
    }
    assert list(Message.objects.values_list("topic__name", flat=True)) == [active.name]


def test_invalid_payload_boundaries(topic):
    check_table(
        topic.name,
        {
            "a JSON payload": ({"payload": {"a": [1, "x", None]}}, ACCEPTED),
            "a reference alone": ({"payload_ref": {"uri": "s3://b/k"}}, ACCEPTED),
            "payload and reference": (
                {"payload": {"a": 1}, "payload_ref": {"uri": "s3://b/k"}},
                "InvalidPayload",
            ),
            "a set": ({"payload": {1, 2}}, "InvalidPayload"),
            "an object": ({"payload": {"when": object()}}, "InvalidPayload"),
            "bytes": ({"payload": b"raw"}, "InvalidPayload"),
            "a reference without a uri": (
                {"payload_ref": {"content_type": "a/b"}},
                "InvalidPayload",
            ),
            "a reference with an empty uri": ({"payload_ref": {"uri": ""}}, "InvalidPayload"),
            "a reference that is a string": ({"payload_ref": "s3://b/k"}, "InvalidPayload"),
            "correlation id of 200": ({"payload": 1, "correlation_id": "c" * 200}, ACCEPTED),
            "correlation id of 201": (
                {"payload": 2, "correlation_id": "c" * 201},
                "InvalidPayload",
            ),
            "correlation id not text": ({"payload": 3, "correlation_id": 7}, "InvalidPayload"),
            "correlation id of 101 emoji": (
                {"payload": 4, "correlation_id": "\U0001f600" * 101},
                "InvalidPayload",
            ),
            # JSON keys are text: {1: "one"} would come back as {"1": "one"}.
            "a number as a key": ({"payload": {1: "one"}}, "InvalidPayload"),
            "a nested boolean key": ({"payload": {"a": [{True: "yes"}]}}, "InvalidPayload"),
            "text and number keys": ({"payload": {1: "a", "b": 2}}, "InvalidPayload"),
            "a negative float key": ({"payload": {"a": {-1.5e30: 1}}}, "InvalidPayload"),
            "a None key": ({"payload": [[{None: 1}]]}, "InvalidPayload"),
            "text keys spelled like numbers": ({"payload": {"1": "a", "line1": 2}}, ACCEPTED),
        },
    )


def test_invalid_partition_key_boundaries(topic):
    check_table(
        topic.name,
        {
            "no key": ({"payload": 1}, ACCEPTED),
            "empty": ({"payload": 2, "partition_key": ""}, "InvalidPartitionKey"),
            "1 character": ({"payload": 3, "partition_key": "k"}, ACCEPTED),
            "200 characters": ({"payload": 4, "partition_key": "k" * 200}, ACCEPTED),
            "200 two-byte characters": ({"payload": 5, "partition_key": "é" * 200}, ACCEPTED),
            "201 characters": ({"payload": 6, "partition_key": "k" * 201}, "InvalidPartitionKey"),
            # Counted as SQL Server's nvarchar(200) holds them (UTF-16 units), on every vendor:
            # 101 emoji fit PostgreSQL's varchar(200); on SQL Server the publish failed.
            "100 emoji": ({"payload": 8, "partition_key": "\U0001f600" * 100}, ACCEPTED),
            "101 emoji": (
                {"payload": 9, "partition_key": "\U0001f600" * 101},
                "InvalidPartitionKey",
            ),
            "a number": ({"payload": 7, "partition_key": 7}, "InvalidPartitionKey"),
            # SQL Server compares text ignoring trailing spaces: 'acct-1 ' would be 'acct-1'
            # there (one Exclusive key, one Ordered line blocked by the other's dead letter, a
            # bulk discard by key taking both), and another key on PostgreSQL (review
            # helper-160). Refused on every vendor, so a key means one thing everywhere.
            "a trailing space": (
                {"payload": 10, "partition_key": "acct-1 "},
                "InvalidPartitionKey",
            ),
            "a leading space": ({"payload": 11, "partition_key": " acct-1"}, ACCEPTED),
            "a trailing tab": ({"payload": 12, "partition_key": "acct-1\t"}, ACCEPTED),
        },
    )
    [refused] = [r for r in publish_many(topic, [{"payload": 1, "partition_key": "a "}])]
    assert "ends with a space" in refused.error.message


def test_invalid_deduplication_boundaries(topic):
    def dedup(key: Any, ttl: Any = None) -> dict[str, Any]:
        return {"payload": {"key": repr(key), "ttl": repr(ttl)}, "deduplication_key": key,
                "deduplication_ttl": ttl}  # fmt: skip

    check_table(
        topic.name,
        {
            "key of 200": (dedup("a" * 200), ACCEPTED),
            "key of 201": (dedup("b" * 201), "InvalidDeduplication"),
            "key of 100 emoji": (dedup("\U0001f600" * 100), ACCEPTED),
            "key of 101 emoji": (dedup("\U0001f601" * 101), "InvalidDeduplication"),
            "key not text": (dedup(42), "InvalidDeduplication"),
            "TTL without a key": (dedup(None, 60), "InvalidDeduplication"),
            "TTL 59": (dedup("c", 59), "InvalidDeduplication"),
            "TTL 60": (dedup("d", 60), ACCEPTED),
            "TTL 2,592,000": (dedup("e", 2_592_000), ACCEPTED),
            "TTL 2,592,001": (dedup("f", 2_592_001), "InvalidDeduplication"),
            "TTL 0": (dedup("g", 0), "InvalidDeduplication"),
            "TTL as a float": (dedup("h", 60.0), "InvalidDeduplication"),
            "TTL as text": (dedup("i", "60"), "InvalidDeduplication"),
            "TTL true": (dedup("j", True), "InvalidDeduplication"),
            # Blank is not "no key": a caller who meant a key would deduplicate nothing.
            "empty key": (dedup(""), "InvalidDeduplication"),
            "blank key": (dedup("   "), "InvalidDeduplication"),
        },
    )


def test_a_payloads_keys_must_be_text_and_the_rejection_says_so(topic):
    result = publish(topic.name, {1: "a", "b": 2})

    assert result.error.code == "InvalidPayload"
    assert "keys must be text" in result.error.message and "1 (int)" in result.error.message


def test_a_payload_that_contains_itself_is_refused_not_walked_for_ever(topic):
    # Checked without the database (publish by name would need this thread's connection on
    # another): the validation alone walked such a value for ever.
    looped: list[Any] = [{"k": 1}]
    looped.append(looped)
    with_a_set: list[Any] = [{1, 2}]
    with_a_set.append(with_a_set)
    errors: list[str] = []

    def validate() -> None:
        for payload in (looped, with_a_set):
            try:
                publishing._payload(payload, None)
            except publishing._Invalid as exc:
                errors.append(exc.error.code)

    walker = threading.Thread(target=validate, daemon=True)
    walker.start()
    walker.join(10)

    assert not walker.is_alive(), "validating a payload that contains itself never ended"
    assert errors == ["InvalidPayload", "InvalidPayload"]


def test_numbers_come_back_to_the_handler_as_they_were_published(topic):
    # jsonb keeps a number's value, not its spelling: 1e+23 written as Python spells it came
    # back as the integer 10**23 (not even the float published), 1e16 as an int.
    payload = {
        "big": 1e16,
        "bigger": 1e23,
        "huge": -1.5e300,
        "tiny": 5e-324,
        "small": 1e-05,
        "plain": 0.1,
        "whole": 10**30,
        "text": "1e+23 stays text",
    }
    result = publish(topic.name, payload)
    assert result.accepted
    (subscription,) = topic.subscriptions.all()
    (delivery,) = Receiver(subscription.id).receive(1).deliveries

    assert delivery.decoded_payload() == payload
    assert {k: type(v) for k, v in delivery.decoded_payload().items()} == {
        k: type(v) for k, v in payload.items()
    }


def test_a_message_of_large_numbers_is_measured_as_stored(topic):
    # The database stores 1e300 as its 301 digits: the size limit counts them, on both sides,
    # so the refusal comes from publish (with its sizes), not from the procedure.
    small = TopicFactory(max_payload_bytes=1000)
    SubscriptionFactory(topic=small)

    result = publish(small, [1e300] * 8)  # the topic itself: publish knows its limit

    assert result.error.code == "PayloadTooLarge"
    assert re.fullmatch(r"The message is 2\d{3} bytes; .* is 1000\.", result.error.message)
    assert publish(small.name, [1e300] * 8).error.code == "PayloadTooLarge"
    assert publish(small, [1e300] * 2).accepted


def test_a_due_time_whose_offset_has_fractions_of_a_second_is_stored_at_that_instant(topic):
    # Python reads such offsets (local mean time, ISO text); PostgreSQL refused their text,
    # and in a batch the whole batch failed with a raw database error.
    offset = dt.timezone(dt.timedelta(hours=5, minutes=30, seconds=15, microseconds=500_000))
    when = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)).astimezone(offset)
    assert when.isoformat().endswith("+05:30:15.500000")
    results = publish_many(
        topic.name,
        [{"payload": 1}, {"payload": 2, "not_before": when.isoformat()}, {"payload": 3}],
    )

    assert [r.status for r in results] == ["Accepted"] * 3
    assert Delivery.objects.get(message_id=results[1].message_id).visible_at == when


def test_a_publisher_whose_user_name_is_longer_than_the_column_is_recorded_cut_short(topic):
    # A custom user model may allow e-mail addresses of 254 characters as user names.
    user = SimpleNamespace(get_username=lambda: "u" * 240 + "@example.com")

    result = publish(topic.name, {"n": 1}, user=user)

    assert result.accepted
    assert Message.objects.get(id=result.message_id).published_by == "u" * 150


def envelope_bytes(**fields: Any) -> int:
    """What the topic limit measures: the message's canonical JSON envelope, in UTF-8 bytes."""
    envelope = {"partition_key": None, "attributes": None, "payload": None, "payload_ref": None,
                "correlation_id": None, **fields}  # fmt: skip
    return len(canonical_json(envelope).encode("utf-8"))


@pytest.mark.parametrize("limit", [1000, 262_144], ids=["topic-limit", "largest-limit"])
def test_payload_too_large_boundaries(limit):
    topic = TopicFactory(max_payload_bytes=limit)
    SubscriptionFactory(topic=topic)
    base = envelope_bytes(payload="")  # the envelope around an empty string payload
    room = limit - base

    rows = {
        "exactly the limit": ({"payload": "x" * room}, ACCEPTED),
        "one byte over": ({"payload": "y" * (room + 1)}, "PayloadTooLarge"),
        # Bytes, not characters: half as many two-byte characters fill the same room.
        "two-byte characters at the limit": ({"payload": "é" * (room // 2)}, ACCEPTED),
        "two-byte characters one byte over": (
            {"payload": "é" * (room // 2) + "z" * (room % 2 + 1)},
            "PayloadTooLarge",
        ),
        # The key and attributes count too: the same payload that fitted alone does not.
        "the limit, plus a partition key": (
            {"payload": "w" * room, "partition_key": "customer-7"},
            "PayloadTooLarge",
        ),
        "the limit, plus an attribute": (
            {"payload": "u" * room, "attributes": {"a": "b"}},
            "PayloadTooLarge",
        ),
        "a reference over the limit": (
            {"payload_ref": {"uri": "s3://b/" + "r" * limit}},
            "PayloadTooLarge",
        ),
        # The size is checked last: a message with another problem reports that one.
        "over the limit with a bad key": (
            {"payload": "v" * (room + 1), "partition_key": ""},
            "InvalidPartitionKey",
        ),
    }
    assert envelope_bytes(payload="x" * room) == limit
    assert envelope_bytes(payload="é" * (room // 2)) <= limit
    check_table(topic.name, rows)


class CallSpy:
    """Counts the driver's publish calls and runs ``before(attempt)`` ahead of each one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, before: Any = None) -> None:
        self.attempts: list[str] = []
        self.before = before
        driver = get_driver()
        original = driver.publish

        def spied(name: str, params: Any = None, **kwargs: Any) -> Any:
            self.attempts.append(name)
            if self.before is not None:
                self.before(len(self.attempts))
            try:
                return original(name, params, **kwargs)
            except TransientDriverError as exc:
                self.attempts[-1] += f" failed: {type(exc).__name__}"
                raise

        monkeypatch.setattr(driver, "publish", spied)


@pytest.fixture
def locked_queue(pg_conn):
    """Another session holding a lock every publish needs (SHARE on the delivery table, which
    the fan-out's INSERT waits for), with this thread's driver connection set to give up after
    100 ms, a real lock timeout (SQLSTATE 55P03). Yields the release function."""
    driver = get_driver()
    driver.execute("SET lock_timeout = '100ms'", [])
    transaction = pg_conn.transaction()
    transaction.__enter__()
    pg_conn.execute("LOCK TABLE workqueue_delivery IN SHARE MODE")
    released = []

    def release() -> None:
        if not released:
            released.append(True)
            transaction.__exit__(None, None, None)

    yield release
    release()
    driver.close()  # forget the session's lock_timeout


def test_a_publish_that_stays_locked_out_is_transport_unavailable_after_the_retries(
    topic, locked_queue, monkeypatch
):
    spy = CallSpy(monkeypatch)

    single = publish(topic.name, {"n": 1}, partition_key="k")
    batch = publish_many(topic.name, [OutgoingMessage(payload=2), OutgoingMessage(payload=3)])
    locked_queue()

    assert outcome(single) == "TransportUnavailable" and single.error.retryable
    assert [outcome(r) for r in batch] == ["TransportUnavailable"] * 2
    attempts = 1 + TRANSIENT_RETRIES
    assert spy.attempts == (
        ["wq_publish failed: LockTimeoutError"] * attempts
        + ["wq_publish_many failed: LockTimeoutError"] * attempts
    )
    assert not Message.objects.exists() and not Delivery.objects.exists()


def test_a_publish_locked_out_once_is_accepted_on_its_retry(topic, locked_queue, monkeypatch):
    spy = CallSpy(monkeypatch, before=lambda attempt: attempt == 2 and locked_queue())

    result = publish(topic.name, {"n": 1})

    assert outcome(result) == ACCEPTED
    assert spy.attempts == ["wq_publish failed: LockTimeoutError", "wq_publish"]
    assert Delivery.objects.filter(message_id=result.message_id).count() == 1


def test_a_publish_whose_backend_was_terminated_is_retried_on_a_fresh_connection(
    topic, monkeypatch
):
    driver = get_driver()
    (pid,) = driver.execute("SELECT pg_backend_pid()", [])[0]
    with psycopg.connect(autocommit=True, **psycopg_params()) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])
    spy = CallSpy(monkeypatch)

    result = publish(topic.name, {"n": 1})

    assert outcome(result) == ACCEPTED
    assert spy.attempts == ["wq_publish failed: TransientDriverError", "wq_publish"]
    assert Message.objects.filter(id=result.message_id).exists()


def test_an_accepted_publish_says_whether_any_subscription_took_it(topic):
    taken = publish(topic.name, {"n": 1})
    Subscription.objects.filter(topic=topic).update(status="Disabled")
    nobody = publish(topic.name, {"n": 2})

    assert (taken.status, taken.delivered) == ("Accepted", True)
    assert taken.delivered_to == {str(s.pk) for s in Subscription.objects.filter(topic=topic)}
    assert (nobody.status, nobody.delivered, nobody.delivered_to) == ("Accepted", False, set())
    assert not Delivery.objects.filter(message_id=nobody.message_id).exists()


def test_a_publish_whose_answer_was_lost_is_accepted_when_sent_again(topic, monkeypatch):
    """The first sending committed and its answer was lost; the retry found the message
    stored and answered Duplicate, so a publisher checking ``accepted`` published it again."""
    single_calls = answers_lost_once(monkeypatch)
    single = publish(topic.name, {"n": 1}, deduplication_key="order-7")
    batch_calls = answers_lost_once(monkeypatch)
    batch = publish_many(
        topic.name,
        [
            {"payload": 2},
            {"payload": 3, "deduplication_key": "d"},
            {"payload": 4, "deduplication_key": "d"},  # a true Duplicate of the one before
        ],
    )

    assert single_calls[:2] == ["wq_publish", "wq_publish"]
    assert batch_calls == ["wq_publish_many", "wq_publish_many"]
    assert [outcome(r) for r in (single, *batch)] == [ACCEPTED] * 3 + ["Duplicate"]
    assert batch[2].message_id == batch[1].message_id
    assert {str(i) for i in Message.objects.values_list("id", flat=True)} == {
        r.message_id for r in (single, *batch)
    }


def test_a_chosen_id_found_stored_after_a_lost_answer_stays_a_duplicate(topic, monkeypatch):
    """An id the publisher chose may have been stored by an earlier publish of theirs: only
    ids made for the call can be told apart."""
    chosen = "01890a5d-ac96-774b-bcce-b302099a8057"
    answers_lost_once(monkeypatch)

    result = publish(topic.name, {"n": 1}, message_id=chosen)

    assert (outcome(result), result.message_id) == ("Duplicate", chosen)
    assert Message.objects.filter(id=chosen).count() == 1


def test_an_enlisted_publish_is_not_retried_but_raises_to_its_caller(
    topic, locked_queue, monkeypatch
):
    spy = CallSpy(monkeypatch)
    with pytest.raises(TransientDriverError), transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL lock_timeout = '100ms'")
        publish(topic.name, {"n": 1}, enlist=True)

    assert spy.attempts == ["wq_publish failed: LockTimeoutError"]
