"""Parity between the SQL filter functions and the Python ones, for valid and invalid filters.

``wq_filter_matches(filter, attributes)`` must return exactly what
``workqueue.filters.stored_filter_matches`` returns, and ``wq_filter_problem(filter)`` must be
NULL exactly when ``stored_filter_problem`` is None and otherwise name the same path (the part
of the filter at fault). Valid filters are checked both in the canonical stored form and as an
author wrote them (unsorted clauses, duplicate values, one-member groups, explicit
``"value": null``); invalid ones match nothing on every side. Inputs:

* an exhaustive grid of single-clause cases on the edges where SQL most easily diverges from
  Python (case, prefixes, LIKE metacharacters, empty string, absent vs JSON null, Unicode
  normal forms);
* the corpus of filters the grammar rejects (``tests/support/filter_cases.py``) and filters
  that once made the SQL raise or guess (a root ``"logic": "or"`` read as "and", an unknown
  operator);
* Hypothesis-generated multi-clause filters, valid ones and ones with one or two mistakes, each
  evaluated against a batch of attribute maps.

Every test runs on PostgreSQL (a psycopg connection to the test database, with the filter bound
as jsonb) and, when ``WORKQUEUE_TEST_MSSQL_URL`` configures one, on SQL Server (the filter bound
as the JSON text Django stores); without it the SQL Server runs are reported as skipped.
"""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any

import psycopg
import pytest
from django.db import connections
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.types.json import Jsonb

from tests.support.database import MSSQL_ALIAS, mssql_skip_reason
from tests.support.filter_cases import STORED_REJECTIONS, any_of, leaf, root
from workqueue.filters import parse_filter, stored_filter_matches, stored_filter_problem

# pg_conn needs pytest-django to set the test database up, which it does only for sessions that
# hold a test asking for the database: this module may run alone.
pytestmark = pytest.mark.django_db

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


# --- the SQL side, per vendor ---------------------------------------------------------------


class PostgresFilters:
    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def matches(self, stored: object, attribute_maps: list[Attributes]) -> list[bool]:
        """``wq_filter_matches(stored, a)`` for each ``a``, in order, in one round trip."""
        rows = self.conn.execute(
            "SELECT wq_filter_matches(%s::jsonb, t.attrs)"
            " FROM unnest(%s::jsonb[]) WITH ORDINALITY AS t(attrs, n) ORDER BY t.n",
            (_jsonb(stored), [_jsonb(a) for a in attribute_maps]),
        ).fetchall()
        return [row[0] for row in rows]

    def problem(self, stored: object) -> str | None:
        row = self.conn.execute("SELECT wq_filter_problem(%s::jsonb)", (_jsonb(stored),))
        return row.fetchone()[0]  # type: ignore[index]


class SqlServerFilters:
    """The filter column there is JSON text, written as Django's JSONField writes it."""

    def __init__(self, alias: str) -> None:
        self.connection = connections[alias]

    def matches(self, stored: object, attribute_maps: list[Attributes]) -> list[bool]:
        with self.connection.cursor() as cursor:
            cursor.execute(
                "SELECT dbo.wq_filter_matches(%s, a.[value]) FROM OPENJSON(%s) AS a"
                " ORDER BY CAST(a.[key] AS int)",
                [_text(stored), json.dumps(attribute_maps)],
            )
            return [bool(row[0]) for row in cursor.fetchall()]

    def problem(self, stored: object) -> str | None:
        with self.connection.cursor() as cursor:
            cursor.execute("SELECT dbo.wq_filter_problem(%s)", [_text(stored)])
            return cursor.fetchone()[0]


def _jsonb(value: object) -> Jsonb | None:
    return None if value is None else Jsonb(value)


def _text(value: object) -> str | None:
    return None if value is None else json.dumps(value)


SQLSERVER_SKIP = mssql_skip_reason()
VENDORS = [
    pytest.param("postgresql", id="postgresql"),
    pytest.param(
        "sqlserver",
        id="sqlserver",
        marks=[
            pytest.mark.skipif(SQLSERVER_SKIP is not None, reason=SQLSERVER_SKIP or ""),
            pytest.mark.django_db(databases=["default", MSSQL_ALIAS]),
        ],
    ),
]


@pytest.fixture(params=VENDORS)
def sql(request: pytest.FixtureRequest) -> PostgresFilters | SqlServerFilters:
    if request.param == "postgresql":
        return PostgresFilters(request.getfixturevalue("pg_conn"))
    return SqlServerFilters(MSSQL_ALIAS)


SqlFilters = PostgresFilters | SqlServerFilters


def assert_parity(sql: SqlFilters, stored: object, attribute_maps: list[Attributes]) -> None:
    """SQL and Python agree on ``stored``: the same verdict on each attribute map, the same
    validity, and for an invalid filter the same path to the part at fault."""
    expected = [stored_filter_matches(stored, a) for a in attribute_maps]
    got = sql.matches(stored, attribute_maps)
    mismatches = [
        (attrs, want, have)
        for attrs, want, have in zip(attribute_maps, expected, got, strict=True)
        if want is not have
    ]
    assert not mismatches, f"filter {stored!r}: (attributes, python, sql) {mismatches}"
    python_problem = stored_filter_problem(stored)
    sql_problem = sql.problem(stored)
    if python_problem is None:
        assert sql_problem is None, f"filter {stored!r}: SQL says {sql_problem!r}"
    else:
        assert sql_problem is not None, f"filter {stored!r}: SQL accepts, Python says invalid"
        assert sql_problem.split(": ", 1)[0] == python_problem.split(": ", 1)[0], (
            f"filter {stored!r}: SQL {sql_problem!r}, Python {python_problem!r}"
        )


def assert_valid_parity(sql: SqlFilters, raw: dict[str, Any], maps: list[Attributes]) -> None:
    parsed = parse_filter(raw)
    assert parsed is not None
    for stored in (parsed.to_json(), raw):  # canonical, and as written
        assert_parity(sql, stored, maps)


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
def test_sql_matcher_agrees_on_single_clause_edges(sql: SqlFilters, value: str) -> None:
    for clause in _grid_clauses(value):
        assert_valid_parity(sql, {"logic": "and", "filters": [clause]}, _variants(value))


# --- invalid filters: the same verdict everywhere, and they match nothing ---------------------

ATTRIBUTE_MAPS: list[Attributes] = [None, {}, {"a": "x"}, {"a": "x", "b": "y"}, {"a": None}]

# Filters the SQL once raised on (failing every publish to the topic on PostgreSQL) or read
# differently from Python (a root "or" was evaluated as "and"; SQL Server matched everything).
ONCE_MISREAD = [
    pytest.param(
        {"logic": "or", "filters": [leaf("a", "eq", "x"), leaf("b", "eq", "y")]}, id="root-or"
    ),
    pytest.param(root(leaf("a", "contains", "x")), id="unknown-operator"),
    pytest.param(root(leaf("zz", "contains", "x")), id="unknown-operator-absent-attribute"),
    pytest.param(root({"field": "a", "value": "x"}), id="no-operator"),
    pytest.param(root(leaf("a", "eq")), id="eq-without-value"),
    pytest.param(root(leaf("a", "neq")), id="neq-without-value"),
    pytest.param(root(leaf("a", "startswith")), id="startswith-without-value"),
    pytest.param([leaf("a", "isnull")], id="root-array"),
    pytest.param("a eq x", id="root-string"),
    pytest.param({"logic": "and", "filters": None}, id="filters-null"),
    pytest.param({"logic": "and", "filters": leaf("a", "isnull")}, id="filters-object"),
    pytest.param(root({"logic": "or", "filters": []}), id="empty-group"),
    pytest.param({"logic": "and"}, id="no-filters"),
    pytest.param({"filters": []}, id="no-logic"),
]


@pytest.mark.parametrize("stored", ONCE_MISREAD)
def test_a_filter_the_sql_once_misread_matches_nothing_everywhere(
    sql: SqlFilters, stored: object
) -> None:
    assert stored_filter_problem(stored) is not None
    assert sql.matches(stored, ATTRIBUTE_MAPS) == [False] * len(ATTRIBUTE_MAPS)
    assert_parity(sql, stored, ATTRIBUTE_MAPS)


STORED = [pytest.param(raw, path, id=case_id) for case_id, raw, path in STORED_REJECTIONS]


@pytest.mark.parametrize(("stored", "path"), STORED)
def test_sql_rejects_what_python_rejects_naming_the_same_part(
    sql: SqlFilters, stored: object, path: str
) -> None:
    problem = sql.problem(stored)
    assert problem is not None and problem.startswith(f"{path}: "), problem
    assert sql.matches(stored, ATTRIBUTE_MAPS) == [False] * len(ATTRIBUTE_MAPS)


MATCH_ALL_FILTERS = [None, {}, {"logic": "and", "filters": []}]


@pytest.mark.parametrize(
    ("stored", "attributes"),
    itertools.product(MATCH_ALL_FILTERS, [None, {}, {"a": "x"}]),
)
def test_absent_or_empty_filter_matches_everything(
    sql: SqlFilters, stored: object, attributes: Attributes
) -> None:
    assert sql.problem(stored) is None
    assert sql.matches(stored, [attributes]) == [True]


def test_postgresql_treats_a_json_null_filter_as_no_filter(
    pg_conn: psycopg.Connection[Any],
) -> None:
    # Django stores None as SQL NULL; a JSON null (written by raw SQL) decodes to None too.
    row = pg_conn.execute("SELECT wq_filter_problem('null'), wq_filter_matches('null', '{}')")
    assert row.fetchone() == (None, True)


# --- generated multi-clause cases -----------------------------------------------------------


@st.composite
def _raw_clause(draw: st.DrawFn, field: str) -> dict[str, Any]:
    """A valid clause for ``field`` in any of the forms an author might write."""
    kind = draw(st.sampled_from(["eq", "neq", "startswith", "isnull", "isnotnull", "or"]))
    if kind == "or":
        members = draw(st.lists(values, min_size=1, max_size=6))
        return {"logic": "or", "filters": [leaf(field, "eq", v) for v in members]}
    if kind in ("isnull", "isnotnull"):
        return leaf(field, kind, None) if draw(st.booleans()) else leaf(field, kind)
    return leaf(field, kind, draw(values))


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


HYPOTHESIS = settings(
    max_examples=200,
    deadline=None,  # the first call pays for PL/pgSQL compilation
    database=None,  # keep Hypothesis' example database out of the checkout
    # The connection is only read through and carries no per-example state.
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@HYPOTHESIS
@given(case=cases())
def test_sql_matcher_agrees_with_python(
    sql: SqlFilters, case: tuple[dict[str, Any], list[Attributes]]
) -> None:
    raw, attribute_maps = case
    assert_valid_parity(sql, raw, attribute_maps)


# JSON values in the wrong place, and strings that are almost what the grammar wants.
JUNK = st.sampled_from(
    [None, True, 0, 1.5, "", "x", "or", "and", "EQ", "contains", "a.b", "a b", "é", "x" * 65,
     [], ["x"], {}, {"x": "y"}]
)  # fmt: skip


def _members(clause: dict[str, Any]) -> list[dict[str, Any]]:
    members = clause.get("filters")
    return [m for m in members if isinstance(m, dict)] if isinstance(members, list) else []


def _field_of(clause: dict[str, Any]) -> str:
    field = clause.get("field", next((m.get("field") for m in _members(clause)), None))
    return field if isinstance(field, str) else "a"


@st.composite
def _one_mistake(draw: st.DrawFn, raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with one thing wrong: a key or value replaced, removed or added somewhere, a
    clause repeated, too many fields or values, or a group that breaks the group rules."""
    raw = copy.deepcopy(raw)
    clauses: list[Any] = raw["filters"]
    index = draw(st.integers(0, len(clauses) - 1))
    clause = clauses[index]
    # The node to spoil: the root, a clause, or a group member.
    node = draw(st.sampled_from([raw, clause, *_members(clause)]))
    kind = draw(st.integers(0, 7))
    if kind in (0, 1) and not node:
        kind = 2
    if kind == 0:  # a known key gets a wrong value
        node[draw(st.sampled_from(sorted(node)))] = draw(JUNK)
    elif kind == 1:  # a known key goes missing
        del node[draw(st.sampled_from(sorted(node)))]
    elif kind == 2:  # an unknown or misplaced key appears
        key = draw(st.sampled_from(["field", "operator", "value", "logic", "filters", "other"]))
        node[key] = draw(JUNK)
    elif kind == 3:  # a clause is not an object
        clauses[index] = draw(JUNK)
    elif kind == 4:  # the same field twice
        clauses.append(copy.deepcopy(clause))
    elif kind == 5:  # one field too many
        clauses.extend(leaf(f"f{n}", "isnotnull") for n in range(6 - len(clauses)))
    elif kind == 6:  # a group member on another field, with another operator, or nested
        field = _field_of(clause)
        member = draw(
            st.sampled_from([leaf("zz", "eq", "x"), leaf(field, "neq", "x"), {"logic": "or"}])
        )
        members = _members(clause) or [copy.deepcopy(clause)]
        clauses[index] = {"logic": "or", "filters": [*members, member]}
    else:  # too many values
        clauses[index] = any_of(_field_of(clause), *(f"v{n}" for n in range(51)))
    return raw


@st.composite
def flawed_cases(draw: st.DrawFn) -> tuple[Any, list[Attributes]]:
    raw: Any = draw(raw_filters())
    for _ in range(draw(st.integers(1, 2))):
        if not (isinstance(raw, dict) and isinstance(raw.get("filters"), list) and raw["filters"]):
            break
        if not all(isinstance(c, dict) for c in raw["filters"]):
            break
        raw = draw(_one_mistake(raw))
    attributes = st.one_of(
        st.none(),
        st.dictionaries(st.sampled_from([*FIELD_POOL, "f0", "zz"]), st.one_of(st.none(), values)),
    )
    return raw, draw(st.lists(attributes, min_size=1, max_size=8))


@HYPOTHESIS
@given(case=flawed_cases())
def test_sql_and_python_agree_on_filters_with_mistakes(
    sql: SqlFilters, case: tuple[Any, list[Attributes]]
) -> None:
    stored, attribute_maps = case
    assert_parity(sql, stored, attribute_maps)
