"""What publishing computes for a message before any database work, checked against the
definitions it must agree with: the envelope size is the UTF-8 length of the canonical JSON
envelope (the topic's max_payload_bytes measures exactly that, and the procedures recompute it),
and a generated message id is an ordinary random UUID."""

from __future__ import annotations

import datetime as dt
import decimal
import time
import uuid
from typing import Any

import pytest

from workqueue.driver.base import canonical_json
from workqueue.publishing import OutgoingMessage, _prepare, _SizeLimit


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
