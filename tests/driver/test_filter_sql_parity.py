"""Parity between the SQL filter matcher and the Python one.

Expects a pytest fixture ``pg_conn`` (to be provided by tests/conftest.py): a psycopg 3
connection in autocommit mode to a PostgreSQL database in which
``workqueue/sql/postgresql/filters.sql`` has been installed, i.e. where
``wq_filter_matches(jsonb, jsonb)`` exists on the search path. The tests only run SELECTs, so the
connection may be shared (session- or module-scoped) and is left as found.

What is checked: for generated valid filters and attribute maps, ``wq_filter_matches`` returns
exactly what ``AttributeFilter.matches`` returns — for the canonical stored form and for the
filter as the author wrote it (unsorted clauses, duplicate values, one-member groups, explicit
``"value": null``), since the function promises to evaluate any accepted filter.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.types.json import Jsonb

from workqueue.filters import parse_filter

MATCH_SQL = (
    "SELECT wq_filter_matches(%(canonical)s::jsonb, %(attributes)s::jsonb),"
    " wq_filter_matches(%(raw)s::jsonb, %(attributes)s::jsonb)"
)

FIELD_POOL = ["a", "b", "kind", "Kind", "event-type", "x_1"]
# Shared prefixes, case variants, LIKE metacharacters and non-ASCII text so that every operator
# sees both outcomes and any accidental pattern matching or case folding in SQL shows up.
VALUE_POOL = [
    "x",
    "X",
    "xy",
    "xyz",
    "ab",
    "abc",
    "é",
    "e\u0301",
    "日本",
    "日",
    "a b",
    "%",
    "_",
    "\\",
]
# jsonb cannot hold U+0000 and UTF-8 cannot encode lone surrogates; the validator rejects both.
values = st.one_of(
    st.sampled_from(VALUE_POOL),
    st.text(
        alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
        min_size=1,
        max_size=6,
    ),
)


def _leaf(field: str, operator: str, value: Any = ...) -> dict[str, Any]:
    node: dict[str, Any] = {"field": field, "operator": operator}
    if value is not ...:
        node["value"] = value
    return node


@st.composite
def _raw_clause(draw: st.DrawFn, field: str) -> dict[str, Any]:
    kind = draw(st.sampled_from(["eq", "neq", "startswith", "isnull", "isnotnull", "or"]))
    if kind == "or":
        members = draw(st.lists(values, min_size=1, max_size=6))
        return {"logic": "or", "filters": [_leaf(field, "eq", v) for v in members]}
    if kind in ("isnull", "isnotnull"):
        return _leaf(field, kind, None) if draw(st.booleans()) else _leaf(field, kind)
    return _leaf(field, kind, draw(values))


@st.composite
def raw_filters(draw: st.DrawFn) -> dict[str, Any]:
    fields = draw(st.lists(st.sampled_from(FIELD_POOL), unique=True, min_size=1, max_size=5))
    clauses = draw(st.permutations([draw(_raw_clause(f)) for f in fields]))
    return {"logic": "and", "filters": clauses}


def _near_misses(value: str) -> list[str]:
    """Strings that differ from ``value`` in the ways a faulty matcher would overlook."""
    return [value.swapcase(), value.upper(), value.lower(), value + "z", value[:-1], ""]


@st.composite
def _attribute_for(draw: st.DrawFn, clause: dict[str, Any]) -> tuple[bool, str | None]:
    """(present, value) for the attribute ``clause`` tests: usually one that satisfies it,
    otherwise a near miss (absent, JSON null, other case, one character more or less, ...)."""
    members = clause.get("filters", [clause])
    value = next((m["value"] for m in members if isinstance(m.get("value"), str)), None)
    operator = clause.get("operator", "eq")
    if draw(st.integers(0, 9)) < 7:
        # Aim to satisfy the clause, so that the other clauses decide the outcome.
        if operator == "isnull":
            return False, None
        if operator == "isnotnull":
            return True, draw(values)
        assert value is not None
        if operator == "eq":
            return True, draw(st.sampled_from([m["value"] for m in members]))
        if operator == "startswith":
            return True, value + draw(st.one_of(st.just(""), values))
        return True, draw(st.sampled_from([*_near_misses(value), *VALUE_POOL]))  # neq
    choice = draw(st.integers(0, 3))
    if choice == 0:
        return False, None  # absent
    if choice == 1:
        return True, None  # JSON null: documented as absent on both sides
    if value is None:
        return True, draw(values)
    return True, draw(st.sampled_from([value, *_near_misses(value)]))


@st.composite
def cases(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A filter plus attributes aimed at it.

    Independent random attributes almost never hit a filter's values, so nearly every example
    would be decided by "absent" or "different". Instead each clause's attribute is either
    chosen to satisfy it or is a near miss, so each example usually turns on one or two
    clauses, on exactly the edges (case, prefix, empty, absent vs null) where SQL and Python
    could disagree.
    """
    raw = draw(raw_filters())
    if draw(st.integers(0, 19)) == 0:
        return raw, None
    attributes: dict[str, Any] = {}
    for clause in raw["filters"]:
        field = clause.get("field") or clause["filters"][0]["field"]
        present, value = draw(_attribute_for(clause))
        if present:
            attributes[field] = value
    # Attributes the filter does not mention must not matter.
    if draw(st.booleans()):
        attributes["other"] = draw(values)
    return raw, attributes


def sql_match(conn: psycopg.Connection[Any], raw: object, attributes: object) -> tuple[Any, ...]:
    parsed = parse_filter(raw)
    canonical = parsed.to_json() if parsed is not None else None
    params = {
        "canonical": None if canonical is None else Jsonb(canonical),
        "raw": None if raw is None else Jsonb(raw),
        "attributes": None if attributes is None else Jsonb(attributes),
    }
    row = conn.execute(MATCH_SQL, params).fetchone()
    assert row is not None
    return tuple(row)


@settings(
    max_examples=200,
    deadline=None,  # the first call pays for PL/pgSQL compilation
    database=None,  # keep Hypothesis' example database out of the checkout
    # The connection is only read through and carries no per-example state.
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(case=cases())
def test_sql_matcher_agrees_with_python(
    pg_conn: psycopg.Connection[Any], case: tuple[dict[str, Any], dict[str, Any] | None]
) -> None:
    raw, attributes = case
    parsed = parse_filter(raw)
    assert parsed is not None
    expected = parsed.matches(attributes)
    canonical_result, raw_result = sql_match(pg_conn, raw, attributes)
    assert canonical_result is expected, (parsed.to_json(), attributes)
    assert raw_result is expected, (raw, attributes)


@pytest.mark.parametrize(
    "filter_json",
    [None, "null", "{}", '{"logic": "and", "filters": []}', '{"logic": "and"}'],
    ids=["sql-null", "json-null", "empty-object", "empty-filters", "missing-filters"],
)
@pytest.mark.parametrize(
    "attributes_json",
    [None, "null", "{}", '{"a": "x"}'],
    ids=["attrs-sql-null", "attrs-json-null", "attrs-empty", "attrs-some"],
)
def test_absent_filter_matches_everything(
    pg_conn: psycopg.Connection[Any], filter_json: str | None, attributes_json: str | None
) -> None:
    row = pg_conn.execute(
        "SELECT wq_filter_matches(%s::jsonb, %s::jsonb)", (filter_json, attributes_json)
    ).fetchone()
    assert row == (True,)


@pytest.mark.parametrize("attributes_json", [None, "null"], ids=["sql-null", "json-null"])
def test_null_attributes_mean_no_attributes(
    pg_conn: psycopg.Connection[Any], attributes_json: str | None
) -> None:
    isnull = '{"logic": "and", "filters": [{"field": "a", "operator": "isnull"}]}'
    neq = '{"logic": "and", "filters": [{"field": "a", "operator": "neq", "value": "x"}]}'
    row = pg_conn.execute(
        "SELECT wq_filter_matches(%s::jsonb, %s::jsonb), wq_filter_matches(%s::jsonb, %s::jsonb)",
        (isnull, attributes_json, neq, attributes_json),
    ).fetchone()
    assert row == (True, False)


@pytest.mark.parametrize(
    "clause_json",
    [
        '{"field": "a", "operator": "contains", "value": "x"}',
        '{"field": "a", "operator": "contains", "value": "x", "note": "attribute absent"}',
        '{"field": "a", "value": "x"}',
        '{"field": "a", "operator": "eq"}',
    ],
    ids=["unknown-operator", "unknown-operator-absent-attribute", "no-operator", "eq-no-value"],
)
def test_corrupt_filter_raises_instead_of_guessing(
    pg_conn: psycopg.Connection[Any], clause_json: str
) -> None:
    attributes = "{}" if "absent" in clause_json else '{"a": "x"}'
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="wq_filter_matches"):
        pg_conn.execute(
            "SELECT wq_filter_matches(%s::jsonb, %s::jsonb)",
            (f'{{"logic": "and", "filters": [{clause_json}]}}', attributes),
        )
