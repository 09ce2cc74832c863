"""Parity between the SQL filter matcher and the Python one.

Expects a pytest fixture ``pg_conn``: a psycopg 3 connection in autocommit mode to a PostgreSQL
database in which ``workqueue/sql/postgresql/filters.sql`` has been installed, i.e. where
``wq_filter_matches(jsonb, jsonb)`` is callable unqualified. The tests only run SELECTs, so the
connection may be shared between tests and is left as found.

What is checked: ``wq_filter_matches`` returns exactly what ``AttributeFilter.matches`` returns,
both for the canonical stored form and for the filter as an author wrote it (unsorted clauses,
duplicate values, one-member groups, explicit ``"value": null``), because the SQL function
promises to evaluate any filter that ``parse_filter`` accepts. Two complementary inputs:

* an exhaustive grid of single-clause cases on the edges where SQL most easily diverges from
  Python (case, prefixes, LIKE metacharacters, empty string, absent vs JSON null, Unicode
  normal forms);
* Hypothesis-generated multi-clause filters, each evaluated against a batch of attribute maps
  aimed at it.
"""

from __future__ import annotations

import itertools
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.types.json import Jsonb

from workqueue.filters import parse_filter

FIELD_POOL = ["a", "b", "kind", "Kind", "event-type", "x_1"]
# Cased letters, shared prefixes, LIKE metacharacters and non-ASCII text, so that a SQL matcher
# that folds case, pattern-matches or normalises Unicode disagrees with Python somewhere.
VALUE_POOL = [
    "x",
    "X",
    "xy",
    "Ab",
    "aB",
    "abc",
    "é",
    "e\u0301",
    "日本",
    "a b",
    "%",
    "o%",
    "a_b",
    "\\",
]
# jsonb cannot hold U+0000 and UTF-8 cannot encode lone surrogates; the validator rejects both.
values = st.one_of(
    st.sampled_from(VALUE_POOL),
    st.sampled_from(VALUE_POOL),  # listed twice: weight the pool over arbitrary text
    st.text(
        alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
        min_size=1,
        max_size=6,
    ),
)

Attributes = dict[str, Any] | None


def sql_matches(
    conn: psycopg.Connection[Any], filter_json: object, attribute_maps: list[Attributes]
) -> list[bool]:
    """``wq_filter_matches(filter, a)`` for each ``a``, in order, in one round trip."""
    rows = conn.execute(
        "SELECT wq_filter_matches(%s::jsonb, t.attrs)"
        " FROM unnest(%s::jsonb[]) WITH ORDINALITY AS t(attrs, n) ORDER BY t.n",
        (
            None if filter_json is None else Jsonb(filter_json),
            [None if a is None else Jsonb(a) for a in attribute_maps],
        ),
    ).fetchall()
    return [row[0] for row in rows]


def assert_parity(
    conn: psycopg.Connection[Any], raw: dict[str, Any], attribute_maps: list[Attributes]
) -> None:
    parsed = parse_filter(raw)
    assert parsed is not None
    expected = [parsed.matches(a) for a in attribute_maps]
    for label, filter_json in (("canonical", parsed.to_json()), ("as written", raw)):
        got = sql_matches(conn, filter_json, attribute_maps)
        mismatches = [
            (attrs, want, have)
            for attrs, want, have in zip(attribute_maps, expected, got, strict=True)
            if want is not have
        ]
        assert not mismatches, (
            f"{label} filter {filter_json}: (attributes, python, sql) {mismatches}"
        )


# --- exhaustive single-clause edges ---------------------------------------------------------

GRID_VALUES = ["x", "Ab", "o%", "a_b", "é", "日本", "\\"]


def _variants(value: str) -> list[Attributes]:
    """Attribute maps around ``value`` for field ``f``: absent, null, and near misses."""
    strings = [
        value,
        value.swapcase(),
        value.upper(),
        value.lower(),
        value + "z",
        value[:-1],
        "z" + value,
        value.replace("%", "x").replace("_", "x"),  # what LIKE would wrongly accept
        "e\u0301" if value == "é" else value + " ",  # other normal form / trailing space
        "",
    ]
    return [None, {}, {"f": None}, {"other": value}, *({"f": s} for s in dict.fromkeys(strings))]


def _grid_clauses(value: str) -> list[dict[str, Any]]:
    return [
        *({"field": "f", "operator": op, "value": value} for op in ("eq", "neq", "startswith")),
        {"field": "f", "operator": "isnull"},
        {"field": "f", "operator": "isnotnull"},
        {
            "logic": "or",
            "filters": [
                {"field": "f", "operator": "eq", "value": value},
                {"field": "f", "operator": "eq", "value": value + "q"},
            ],
        },
    ]


@pytest.mark.parametrize("value", GRID_VALUES)
def test_sql_matcher_agrees_on_single_clause_edges(
    pg_conn: psycopg.Connection[Any], value: str
) -> None:
    for clause in _grid_clauses(value):
        assert_parity(pg_conn, {"logic": "and", "filters": [clause]}, _variants(value))


# --- generated multi-clause cases -----------------------------------------------------------


def _leaf(field: str, operator: str, value: Any = ...) -> dict[str, Any]:
    node: dict[str, Any] = {"field": field, "operator": operator}
    if value is not ...:
        node["value"] = value
    return node


@st.composite
def _raw_clause(draw: st.DrawFn, field: str) -> dict[str, Any]:
    """A valid clause for ``field`` in any of the forms an author might write."""
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


def _clause_field(clause: dict[str, Any]) -> str:
    return clause["field"] if "field" in clause else clause["filters"][0]["field"]


def _near_misses(value: str) -> list[str]:
    """Strings that differ from ``value`` in the ways a faulty matcher would overlook."""
    return [value, value.swapcase(), value.upper(), value.lower(), value + "z", value[:-1], ""]


@st.composite
def _attribute_for(draw: st.DrawFn, clause: dict[str, Any]) -> tuple[bool, str | None]:
    """(present, value) for the attribute ``clause`` tests: usually one that satisfies it,
    otherwise a near miss (absent, JSON null, other case, one character more or less, ...)."""
    members = clause.get("filters", [clause])
    value = next((m["value"] for m in members if isinstance(m.get("value"), str)), None)
    operator = clause.get("operator", "eq")
    if draw(st.integers(0, 9)) < 6:
        # Aim to satisfy the clause, so that some other clause decides the outcome.
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
    choice = draw(st.integers(0, 5))
    if choice == 0:
        return False, None  # absent
    if choice == 1:
        return True, None  # JSON null: documented as absent on both sides
    if value is None:
        return True, draw(values)
    return True, draw(st.sampled_from(_near_misses(value)))


@st.composite
def attributes_for(draw: st.DrawFn, raw: dict[str, Any]) -> Attributes:
    """Attributes aimed at ``raw``.

    Independent random attributes almost never hit a filter's values, so nearly every example
    would be decided by "absent" or "different". Instead each clause's attribute either
    satisfies it or is a near miss, so the outcome usually turns on one or two clauses, on the
    edges where SQL and Python could disagree.
    """
    if draw(st.integers(0, 19)) == 0:
        return None
    attributes: dict[str, Any] = {}
    for clause in raw["filters"]:
        present, value = draw(_attribute_for(clause))
        if present:
            attributes[_clause_field(clause)] = value
    if draw(st.booleans()):
        attributes["other"] = draw(values)  # attributes the filter does not mention never matter
    return attributes


@st.composite
def cases(draw: st.DrawFn) -> tuple[dict[str, Any], list[Attributes]]:
    raw = draw(raw_filters())
    # A batch per filter: many attribute maps cost one round trip.
    return raw, draw(st.lists(attributes_for(raw), min_size=1, max_size=16))


@settings(
    max_examples=200,
    deadline=None,  # the first call pays for PL/pgSQL compilation
    database=None,  # keep Hypothesis' example database out of the checkout
    # The connection is only read through and carries no per-example state.
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(case=cases())
def test_sql_matcher_agrees_with_python(
    pg_conn: psycopg.Connection[Any], case: tuple[dict[str, Any], list[Attributes]]
) -> None:
    raw, attribute_maps = case
    assert_parity(pg_conn, raw, attribute_maps)


# --- documented edge behaviour of the SQL function ------------------------------------------

MATCH_ALL_FILTERS = [None, "null", "{}", '{"logic": "and", "filters": []}', '{"logic": "and"}']
ATTRIBUTE_JSON = [None, "null", "{}", '{"a": "x"}']


@pytest.mark.parametrize(
    ("filter_json", "attributes_json"), itertools.product(MATCH_ALL_FILTERS, ATTRIBUTE_JSON)
)
def test_absent_or_empty_filter_matches_everything(
    pg_conn: psycopg.Connection[Any], filter_json: str | None, attributes_json: str | None
) -> None:
    row = pg_conn.execute(
        "SELECT wq_filter_matches(%s::jsonb, %s::jsonb)", (filter_json, attributes_json)
    ).fetchone()
    assert row == (True,)


@pytest.mark.parametrize(
    ("clause_json", "attributes_json"),
    [
        pytest.param(
            '{"field": "a", "operator": "contains", "value": "x"}',
            '{"a": "x"}',
            id="unknown-operator",
        ),
        # An absent attribute must not mask the bad operator.
        pytest.param(
            '{"field": "a", "operator": "contains", "value": "x"}',
            "{}",
            id="unknown-operator-absent-attribute",
        ),
        pytest.param('{"field": "a", "value": "x"}', '{"a": "x"}', id="no-operator"),
        pytest.param('{"field": "a", "value": "x"}', "{}", id="no-operator-absent-attribute"),
        pytest.param('{"field": "a", "operator": "eq"}', '{"a": "x"}', id="eq-without-value"),
        pytest.param('{"field": "a", "operator": "neq"}', '{"a": "x"}', id="neq-without-value"),
        pytest.param(
            '{"field": "a", "operator": "startswith"}', '{"a": "x"}', id="startswith-without-value"
        ),
    ],
)
def test_corrupt_clause_raises_instead_of_guessing(
    pg_conn: psycopg.Connection[Any], clause_json: str, attributes_json: str
) -> None:
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="wq_filter_matches"):
        pg_conn.execute(
            "SELECT wq_filter_matches(%s::jsonb, %s::jsonb)",
            (f'{{"logic": "and", "filters": [{clause_json}]}}', attributes_json),
        )


@pytest.mark.parametrize(
    "filter_json",
    [
        '[{"field": "a", "operator": "isnull"}]',
        '"a eq x"',
        '{"logic": "and", "filters": null}',
        '{"logic": "and", "filters": {"field": "a", "operator": "isnull"}}',
        '{"logic": "and", "filters": [{"logic": "or", "filters": []}]}',
    ],
    ids=["root-array", "root-string", "filters-null", "filters-object", "empty-group"],
)
def test_corrupt_filter_shape_raises_instead_of_guessing(
    pg_conn: psycopg.Connection[Any], filter_json: str
) -> None:
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="wq_filter_matches"):
        pg_conn.execute("SELECT wq_filter_matches(%s::jsonb, '{}'::jsonb)", (filter_json,))
