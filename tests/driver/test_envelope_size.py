"""``wq_envelope_text_bytes`` counts exactly what building the envelope and writing it counts.

The publish procedures' size guard trusts a caller's envelope size only where it exceeds the
database's own count, and that count decides which messages are refused as PayloadTooLarge.
It used to be ``octet_length(jsonb_build_object('partition_key', ..., 'correlation_id',
...)::text)``; ``wq_envelope_text_bytes`` adds up the parts instead, so it must agree with the
old count for every message, or a message near the limit would be refused (or accepted) where
it was not before. Checked here on the edges where text written inside an object could differ
from text written alone (escapes, non-ASCII, nesting, numbers jsonb normalises, JSON null
against a missing value), and on Hypothesis-generated envelopes.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.types.json import Jsonb

pytestmark = pytest.mark.django_db

COUNTS = """
SELECT wq_envelope_text_bytes(%(key)s, %(attributes)s, %(payload)s, %(ref)s, %(correlation)s),
       octet_length(jsonb_build_object(
           'partition_key', %(key)s::text, 'attributes', %(attributes)s::jsonb,
           'payload', %(payload)s::jsonb, 'payload_ref', %(ref)s::jsonb,
           'correlation_id', %(correlation)s::text)::text)
"""


def counts(
    conn: psycopg.Connection[Any],
    *,
    key: str | None = None,
    attributes: dict[str, str] | None = None,
    payload: Any = None,
    ref: dict[str, Any] | None = None,
    correlation: str | None = None,
    json_null_payload: bool = False,
) -> tuple[int, int]:
    """(the parts' count, the built envelope's count) for one message's fields."""
    payload_param = Jsonb(None) if json_null_payload else _jsonb(payload)
    row = conn.execute(
        COUNTS,
        {
            "key": key,
            "attributes": _jsonb(attributes),
            "payload": payload_param,
            "ref": _jsonb(ref),
            "correlation": correlation,
        },
    ).fetchone()
    assert row is not None
    return row[0], row[1]


def _jsonb(value: Any) -> Jsonb | None:
    return None if value is None else Jsonb(value)


EDGE_CASES = {
    "nothing but nulls": {},
    "a plain payload": {"payload": {"n": 1}},
    "every field": {
        "key": "customer-42",
        "attributes": {"kind": "order", "region": "eu"},
        "payload": {"lines": [{"sku": "A", "qty": 2}], "total": "12.50"},
        "correlation": "req-7",
    },
    "a claim-check reference": {"ref": {"uri": "s3://bucket/key", "size_bytes": 10}},
    "escapes in every string": {
        "key": 'quote " back \\ tab \t nl \n bell \x07',
        "attributes": {"a": 'x"y', "b": "\\"},
        "payload": {'k"e\\y': "\x01\x1f\u2028"},
        "correlation": "\r\x08\x0c",
    },
    "non-ASCII text": {
        "key": "clé-日本",
        "attributes": {"name": "Zoë"},
        "payload": {"emoji": "🎉", "text": "e\u0301"},
        "correlation": "Ω",
    },
    "deep nesting": {"payload": {"a": [[[{"b": [1, [2, {"c": None}]]}]]]}},
    "numbers jsonb rewrites": {"payload": [1.50, 1e3, -0.0, 12345678901234567890, 0.1]},
    "a scalar payload": {"payload": "just text"},
    "an empty object and array": {"payload": {"o": {}, "a": []}},
    "a JSON null payload": {"json_null_payload": True},
    "empty strings": {"key": "", "correlation": "", "payload": ""},
}


@pytest.mark.parametrize("fields", EDGE_CASES.values(), ids=EDGE_CASES.keys())
def test_the_parts_count_what_the_built_envelope_counts(pg_conn, fields):
    parts, built = counts(pg_conn, **fields)
    assert parts == built


# jsonb cannot hold U+0000, and UTF-8 cannot encode lone surrogates: publishing rejects both.
text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    max_size=20,
)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | text,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(text, children, max_size=4),
    max_leaves=12,
)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    key=st.none() | text,
    attributes=st.none() | st.dictionaries(text, text, max_size=4),
    payload=json_values,
    ref=st.none() | st.dictionaries(text, json_values, max_size=3),
    correlation=st.none() | text,
)
def test_generated_envelopes_count_the_same(pg_conn, key, attributes, payload, ref, correlation):
    parts, built = counts(
        pg_conn, key=key, attributes=attributes, payload=payload, ref=ref, correlation=correlation
    )
    assert parts == built
