"""canonical_json: one reused encoder, the same text as Django's encoder built for each call."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import re
import subprocess
import sys
import uuid

import pytest
from django.core.serializers.json import DjangoJSONEncoder
from hypothesis import given
from hypothesis import strategies as st

from workqueue.driver.base import canonical_json


def reference(value: object) -> str:
    """What canonical_json wrote before it kept one encoder: json.dumps's way, a new encoder
    (and a new dict of cycle markers) for every value."""
    return DjangoJSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
        value
    )


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()  # NaN and the infinities included: written as such, refused later
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=30,
)


@given(json_values)
def test_the_text_is_the_text_the_encoder_built_per_call_writes(value: object) -> None:
    text, before = canonical_json(value), reference(value)
    if not re.search(r"[0-9]e[-+]", before):
        assert text == before
    else:
        # Floats written with an exponent are written out in full: the same values, and no
        # exponent left outside the strings.
        assert json.loads(text, parse_constant=str) == json.loads(before, parse_constant=str)
        assert not re.search(r"[0-9]e[-+]", re.sub(r'"(?:[^"\\]|\\.)*"', "", text))


def test_floats_python_writes_with_an_exponent_are_written_out_and_read_back_as_floats() -> None:
    assert canonical_json(1e16) == "10000000000000000.0"
    assert canonical_json([-1e23, 5e-7]) == "[-100000000000000000000000.0,0.0000005]"
    assert canonical_json({"a": "1e+5 in text", "b": 1.5e-5}) == '{"a":"1e+5 in text","b":0.000015}'
    assert json.loads(canonical_json(1e23)) == 1e23 and json.loads(canonical_json(1e23)) != 10**23


def test_what_django_serialises_is_written_as_django_writes_it() -> None:
    value = {
        "amount": decimal.Decimal("12.50"),
        "id": uuid.UUID("01890a5d-ac96-774b-bcce-b302099a8057"),
        "at": dt.datetime(2026, 12, 4, 9, 30, tzinfo=dt.UTC),
        "day": dt.date(2026, 12, 4),
        "wait": dt.timedelta(seconds=90),
        "name": 'Zoë \u2028 \\ "quoted"',
        "flag": True,
        "ratio": 0.1,
    }
    assert canonical_json(value) == reference(value)
    assert canonical_json("plain text") == reference("plain text") == '"plain text"'


def test_a_value_that_contains_itself_is_a_value_error_as_before() -> None:
    looped: dict[str, object] = {"a": 1}
    looped["self"] = [looped]
    with pytest.raises(ValueError, match="Circular reference"):
        canonical_json(looped)


def test_a_value_that_contains_itself_is_caught_however_high_the_recursion_limit() -> None:
    """Caught as it is met again, not by recursing until Python's limit: a process that raised
    the limit (or runs the call on a thread with a small stack) would crash there, in C."""
    script = (
        "import sys; sys.setrecursionlimit(1_000_000)\n"
        "from workqueue.driver.base import canonical_json\n"
        "looped = {'a': 1}; looped['self'] = [looped]\n"
        "try:\n"
        "    canonical_json(looped)\n"
        "except ValueError as error:\n"
        "    print(error)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert (run.returncode, run.stdout.strip()) == (0, "Circular reference detected"), run.stderr


def test_a_value_nested_past_the_recursion_limit_is_a_recursion_error() -> None:
    deep: list[object] = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(RecursionError):
        canonical_json(deep)


def test_a_value_json_cannot_write_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        canonical_json({"socket": object()})
