"""The text and JSON rules of ``workqueue.input_limits`` on their own: what they find, and what
only looks like it (an escaped backslash before ``u0000``, a surrogate pair, brackets inside
strings)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from workqueue.input_limits import (
    MAX_JSON_DEPTH,
    NON_FINITE_PROBLEM,
    NUL_PROBLEM,
    SURROGATE_PROBLEM,
    TOO_DEEP_PROBLEM,
    holds_more_json_values,
    json_text_problem,
    key_length,
    text_problem,
    within_units,
)


def as_stored(value: Any) -> str:
    # As workqueue.driver.base.canonical_json writes values.
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def nested(depth: int, inner: Any = None) -> Any:
    value = inner
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("plain", None),
        ("\U0001f600 emoji", None),
        ("\\u0000 as letters", None),
        ("nul \x00", NUL_PROBLEM),
        ("high \ud83d alone", SURROGATE_PROBLEM),
        ("low \udcff alone", SURROGATE_PROBLEM),
    ],
)
def test_text_problem(value, problem):
    assert text_problem(value) == problem


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ({"a": ["x", 1, None, True, 1.5e300]}, None),
        ("\\u0000", None),  # a backslash, then letters: escaped as \\u0000
        ("\\\x00", NUL_PROBLEM),  # a backslash, then a NUL: \\\u0000
        ({"key\x00": 1}, NUL_PROBLEM),
        (["\ud800"], SURROGATE_PROBLEM),
        ({"\udfff": 1}, SURROGATE_PROBLEM),
        (["\U0001f600"], None),
        (["NaN", "Infinity", "[[[[", "}}}}"], None),  # inside strings they are only text
        ([float("nan")], NON_FINITE_PROBLEM),
        ({"x": float("-inf")}, NON_FINITE_PROBLEM),
        (nested(MAX_JSON_DEPTH), None),
        (nested(MAX_JSON_DEPTH, "[" * 100), None),
        (nested(MAX_JSON_DEPTH + 1), TOO_DEEP_PROBLEM),
        ([nested(MAX_JSON_DEPTH - 1), [], {}, nested(3)], None),
        ([[], nested(MAX_JSON_DEPTH)], TOO_DEEP_PROBLEM),
        (nested(500), TOO_DEEP_PROBLEM),
    ],
)
def test_json_text_problem(value, problem):
    assert json_text_problem(as_stored(value)) == problem


def test_a_wide_value_at_the_limit_is_checked_in_one_pass_per_level():
    wide = [nested(MAX_JSON_DEPTH - 1)] * 2000 + list(range(100_000))

    assert json_text_problem(as_stored(wide)) is None
    assert json_text_problem(as_stored([*wide, nested(MAX_JSON_DEPTH)])) == TOO_DEEP_PROBLEM


# -- lengths as SQL Server's nvarchar columns hold them ----------------------------------------

GRIN = "\U0001f600"  # beyond U+FFFF: two UTF-16 code units


def test_keys_are_measured_in_utf16_units():
    assert key_length("order-7") == 7
    assert key_length("é" * 10) == 10
    assert key_length(GRIN * 10) == 20


@pytest.mark.parametrize(
    ("text", "units", "from_end", "kept"),
    [
        ("abcdef", 3, False, "abc"),
        ("abcdef", 3, True, "def"),
        (f"a{GRIN}b", 2, False, "a"),  # never half of the emoji
        (f"a{GRIN}b", 3, False, f"a{GRIN}"),
        (f"a{GRIN}b", 2, True, "b"),
        (f"a{GRIN}b", 3, True, f"{GRIN}b"),
        (f"a{GRIN}b", 9, False, f"a{GRIN}b"),
    ],
)
def test_a_cut_keeps_whole_characters_within_the_units(text, units, from_end, kept):
    assert within_units(text, units, from_end=from_end) == kept


def test_reasons_and_errors_fit_their_columns_in_utf16_units():
    """SQL Server's LEFT(@reason, 100) and LEFT(@error, 16000) count UTF-16 units: text cut
    to 100 and 16,000 characters in Python was cut again there, through an emoji's middle."""
    from workqueue.runtime.executor import MAX_ERROR_LENGTH, MAX_REASON_LENGTH, describe_error
    from workqueue.runtime.executor import _short as reason_of

    reason = reason_of(GRIN * 80)
    error = describe_error(ValueError(GRIN * 20_000))

    assert key_length(reason) <= MAX_REASON_LENGTH and reason.endswith("…")
    assert key_length(error) <= MAX_ERROR_LENGTH
    assert error.startswith("ValueError: ") and error.endswith(GRIN) and "left out" in error


def test_a_lone_surrogate_is_measured_not_raised_on():
    """It is refused as unstorable where it is checked, naming the field; measuring it first
    raised UnicodeEncodeError (a 500 from the REST API)."""
    assert key_length("ab\ud800") == 3


def test_a_handlers_own_dead_letter_reason_is_cut_in_utf16_units():
    """Only a FatalWorkError's message was cut that way; ``Outcome.dead_letter(reason)`` went to
    SQL Server's LEFT(@reason, 100) whole, which kept half of a last emoji (helper-105)."""
    from workqueue.runtime.executor import MAX_REASON_LENGTH, _cut_reason

    assert _cut_reason("r" * 99 + GRIN) == "r" * 99 + "…"
    assert _cut_reason("r" * 98 + GRIN) == "r" * 98 + GRIN
    assert key_length(_cut_reason(GRIN * 80)) <= MAX_REASON_LENGTH


@pytest.mark.parametrize(
    "hint",
    [
        "Use DROP FUNCTION wq_backlog(uuid,integer) first.",
        "Verwenden Sie zuerst DROP FUNCTION wq_backlog(uuid,integer).",
        "まず DROP FUNCTION wq_backlog(uuid,integer) を使用してください。",
    ],
    ids=["en", "de", "ja"],
)
def test_the_function_to_drop_is_found_in_postgresqls_hint_in_any_language(hint):
    """Only the English wording was read: under another lc_messages an install over a
    function it cannot replace failed as before (helper-105)."""
    from workqueue.driver.postgresql import _DROP_FIRST

    assert _DROP_FIRST.search(hint)[1] == "wq_backlog(uuid,integer)"


def _values_and_keys(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + sum(1 + _values_and_keys(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(_values_and_keys(v) for v in value)
    return 1


@pytest.mark.parametrize(
    "text, counted",
    [
        ("1", 1),
        ('{"a":1,"b":2}', 5),  # the object, two keys, two values
        ("[[],{}]", 5),  # three values: an empty container's bracket and comma both count
        ('["a,b:c[{"]', 2),  # marks inside a string are not values
        ('["x\\\\",",",1]', 4),  # an escaped backslash ends before the quote
        ('["\\"[,:",1]', 3),  # an escaped quote does not end the string
    ],
)
def test_json_values_are_counted_without_decoding_never_fewer_than_there_are(text, counted):
    raw = text.encode()
    assert counted >= _values_and_keys(json.loads(text))
    assert holds_more_json_values(raw, counted - 1)
    assert not holds_more_json_values(raw, counted)
