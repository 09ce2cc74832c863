"""What publishing computes for a message before any database work, checked against the
definitions it must agree with: the envelope size is the UTF-8 length of the canonical JSON
envelope (the topic's max_payload_bytes measures exactly that, and the procedures recompute it),
and a generated message id is an ordinary random UUID."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import time
import uuid
from typing import Any

import pytest

from workqueue import publish_many
from workqueue.driver.base import canonical_json
from workqueue.ids import new_message_ids
from workqueue.publishing import OutgoingMessage, _MessageFields, _prepare, _SizeLimit
from workqueue.transport import _message_json


def canonical_envelope_bytes(message: OutgoingMessage, payload_ref: Any = None) -> int:
    envelope = {
        "partition_key": message.partition_key,
        "attributes": dict(message.attributes) if message.attributes else None,
        "payload": message.payload if message.payload_ref is None else None,
        "payload_ref": payload_ref,
        "correlation_id": message.correlation_id,
    }
    return len(canonical_json(envelope).encode("utf-8"))


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"payload": {"n": 1}},
        {"payload": "a string payload"},
        {"payload": [1, 2.5, None, True, {"nested": {"b": 1, "a": 2}}]},
        {"payload": {"é": "ünïcødé \U0001f600", 'quote"and\\': "line\nbreak\ttab\x01"}},
        {"payload": {"when": dt.datetime(2030, 1, 2, 3, 4, 5, 678000, tzinfo=dt.UTC)}},
        {"payload": {"amount": decimal.Decimal("12.50"), "id": uuid.UUID(int=7)}},
        {"payload": {"n": 1}, "partition_key": 'customer-\u00e9"7"'},
        {"payload": {"n": 1}, "correlation_id": 'trace \u2028 \\ "id"'},
        {"payload": {"n": 1}, "attributes": {"b-key": "ß", "a_key": '"quoted"'}},
        {"payload": None, "attributes": {}},
        {"payload_ref": {"uri": "s3://bucket/\u00e9", "contentType": "text/plain"}},
        {
            "payload_ref": {"uri": "s3://b/k", "size_bytes": 10},
            "partition_key": "k",
            "correlation_id": "c",
            "attributes": {"kind": "x"},
        },
    ],
)
def test_the_envelope_size_is_the_utf8_length_of_the_canonical_envelope(fields):
    message = OutgoingMessage(**fields)
    prepared = _prepare(message, _SizeLimit.of(None))
    assert prepared["envelope_bytes"] == canonical_envelope_bytes(message, prepared["payload_ref"])


def test_generated_message_ids_are_distinct_time_ordered_uuids_in_canonical_text():
    before_ms = time.time_ns() // 1_000_000
    ids = [
        _prepare(OutgoingMessage(payload=n), _SizeLimit.of(None))["message_id"] for n in range(2000)
    ]
    after_ms = time.time_ns() // 1_000_000
    assert len(set(ids)) == len(ids)
    for text in ids:
        parsed = uuid.UUID(text)
        assert str(parsed) == text  # lower case, hyphenated: the form the database returns
        assert parsed.version == 7
        assert parsed.variant == uuid.RFC_4122
        # The first 48 bits are the time it was made, in Unix milliseconds.
        assert before_ms <= parsed.int >> 80 <= after_ms
    # Ids made in different milliseconds sort in the order they were made.
    stamps = [uuid.UUID(text).int >> 80 for text in ids]
    assert stamps == sorted(stamps)


def test_ids_made_for_a_batch_are_distinct_time_ordered_uuids_of_one_millisecond():
    before_ms = time.time_ns() // 1_000_000
    ids = new_message_ids(500)
    after_ms = time.time_ns() // 1_000_000
    assert len(set(ids)) == 500
    stamps = set()
    for text in ids:
        parsed = uuid.UUID(text)
        assert str(parsed) == text
        assert (parsed.version, parsed.variant) == (7, uuid.RFC_4122)
        stamps.add(parsed.int >> 80)
    [stamp] = stamps
    assert before_ms <= stamp <= after_ms
    # The random parts differ from batch to batch, not only within one.
    assert not set(ids) & set(new_message_ids(500))


def test_a_batch_item_carries_every_field_the_message_set():
    """A batch's item is written field by field: a field _prepare returns but the item leaves
    out would reach the database as NULL, silently (a deduplication key, a schedule...)."""
    message = OutgoingMessage(
        payload={"n": 1},
        partition_key="k",
        attributes={"kind": "x"},
        correlation_id="c",
        deduplication_key="d",
        deduplication_ttl=600,
        message_id=uuid.UUID(int=5),
        delay_seconds=30,
        priority=7,
    )
    prepared = _prepare(message, _SizeLimit.of(None))
    scheduled = _prepare(
        OutgoingMessage(payload_ref={"uri": "s3://b/k"}, not_before="2030-01-01T00:00:00+00:00"),
        _SizeLimit.of(None),
    )
    for fields in (prepared, scheduled):
        item = json.loads(_message_json(fields))
        set_fields = {name for name, value in fields.items() if value is not None}
        # The payload goes in once, as the text made when it was measured.
        expected = set_fields - {"payload_json"}
        assert set(item) == expected
        assert item == {
            name: json.loads(fields["payload_json"]) if name == "payload" else fields[name]
            for name in expected
        }


def test_the_default_priority_is_sent_as_none_which_every_procedure_reads_as_zero():
    assert _prepare(OutgoingMessage(payload=1), _SizeLimit.of(None))["priority"] is None
    assert _prepare(OutgoingMessage(payload=1, priority=-3), _SizeLimit.of(None))["priority"] == -3


def test_a_mapping_with_an_unknown_field_is_refused_as_an_outgoing_message_would_be():
    with pytest.raises(TypeError) as mapping:
        publish_many("test.any", [{"payload": 1}, {"payload": 2, "colour": "red"}])
    with pytest.raises(TypeError) as message:
        OutgoingMessage(payload=2, colour="red")  # type: ignore[call-arg]
    assert str(mapping.value) == str(message.value)
    assert "unexpected keyword argument 'colour'" in str(message.value)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"payload": {"n": 1}, "partition_key": "k", "attributes": {"a": "b"}, "priority": 3},
        {"payload_ref": {"uri": "s3://b/k"}, "correlation_id": "c", "delay_seconds": 5},
        {"deduplication_key": "d", "deduplication_ttl": 600, "message_id": uuid.UUID(int=9)},
        {"not_before": "2030-01-01T00:00:00+00:00"},
    ],
)
def test_a_message_given_as_a_mapping_is_prepared_as_the_same_outgoing_message(fields):
    limit = _SizeLimit.of(None)
    fresh = "01890a5d-ac96-774b-bcce-b302099a8057"
    assert _prepare(_MessageFields(**fields), limit, fresh) == _prepare(
        OutgoingMessage(**fields), limit, fresh
    )
