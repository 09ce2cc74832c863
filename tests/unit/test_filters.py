"""Unit tests for workqueue.filters: the validator's rejection rules, the matcher's semantics and
properties of the canonical form. Pure Python; no database."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.filter_cases import REJECTIONS, STORED_REJECTIONS, any_of, leaf, root
from workqueue.filters import (
    MAX_FIELDS,
    MAX_VALUES,
    AnyOf,
    AttributeFilter,
    Condition,
    FilterError,
    Operator,
    filter_matches,
    parse_filter,
    stored_filter_matches,
    stored_filter_problem,
)

# Hypothesis' example database would write a .hypothesis/ directory into the checkout.
HYPOTHESIS = settings(database=None, max_examples=200)


def rejection(raw: object) -> FilterError:
    with pytest.raises(FilterError) as info:
        parse_filter(raw)
    return info.value


# --- "matches everything" inputs ------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [None, "", "   \n", "null", {}, "{}", root(), '{"logic": "and", "filters": []}'],
    ids=[
        "none",
        "empty-str",
        "blank-str",
        "json-null",
        "empty-dict",
        "empty-json",
        "no-filters",
        "no-filters-json",
    ],
)
def test_match_all_inputs_parse_to_none(raw: object) -> None:
    assert parse_filter(raw) is None
    assert filter_matches(parse_filter(raw), {"anything": "at all"})
    assert filter_matches(parse_filter(raw), None)


# --- accepted input and normalisation -------------------------------------------------------


def test_dict_and_json_text_give_the_same_result() -> None:
    raw = root(leaf("region", "eq", "eu"), any_of("kind", "b", "a"), leaf("trace", "isnull"))
    assert parse_filter(raw) == parse_filter(json.dumps(raw))


def test_normalisation_sorts_clauses_and_values_and_drops_duplicates() -> None:
    parsed = parse_filter(
        root(leaf("zeta", "startswith", "pre"), any_of("alpha", "c", "a", "c", "b"))
    )
    assert parsed is not None
    assert parsed.clauses == (
        AnyOf("alpha", ("a", "b", "c")),
        Condition("zeta", Operator.STARTSWITH, "pre"),
    )
    assert parsed.fields == ("alpha", "zeta")
    assert parsed.to_json() == {
        "logic": "and",
        "filters": [
            {
                "logic": "or",
                "filters": [
                    {"field": "alpha", "operator": "eq", "value": "a"},
                    {"field": "alpha", "operator": "eq", "value": "b"},
                    {"field": "alpha", "operator": "eq", "value": "c"},
                ],
            },
            {"field": "zeta", "operator": "startswith", "value": "pre"},
        ],
    }


def test_single_value_group_collapses_to_eq() -> None:
    parsed = parse_filter(root(any_of("kind", "click", "click")))
    assert parsed is not None
    assert parsed.clauses == (Condition("kind", Operator.EQ, "click"),)
    assert parsed == parse_filter(root(leaf("kind", "eq", "click")))


def test_value_less_operators_accept_explicit_null_and_store_no_value() -> None:
    parsed = parse_filter(root(leaf("a", "isnull", None), leaf("b", "isnotnull")))
    assert parsed is not None
    assert parsed.to_json()["filters"] == [
        {"field": "a", "operator": "isnull"},
        {"field": "b", "operator": "isnotnull"},
    ]


def test_limits_are_inclusive() -> None:
    # Exactly 5 fields and exactly 50 values is fine.
    group = any_of("f0", *(f"v{i}" for i in range(46)))
    raw = root(group, *(leaf(f"f{i}", "eq", "x") for i in range(1, MAX_FIELDS)))
    parsed = parse_filter(raw)
    assert parsed is not None
    assert len(parsed.fields) == MAX_FIELDS
    assert len(parsed.clauses[0].values) + MAX_FIELDS - 1 == MAX_VALUES  # type: ignore[union-attr]


def test_field_name_edges_accepted() -> None:
    for name in ("a", "A-Z_09", "x" * 64, "-", "_"):
        assert parse_filter(root(leaf(name, "isnotnull"))) is not None


def test_already_parsed_filter_passes_through() -> None:
    parsed = parse_filter(root(leaf("a", "eq", "x")))
    assert parse_filter(parsed) is parsed


def test_result_is_immutable() -> None:
    parsed = parse_filter(root(leaf("a", "eq", "x")))
    assert parsed is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        parsed.clauses = ()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        parsed.clauses[0].value = "y"  # type: ignore[misc,union-attr]
    assert isinstance(parsed.clauses, tuple)


# --- rejection rules ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "path", "fragments"),
    [
        pytest.param(raw, path, fragments, id=case_id)
        for case_id, raw, path, fragments in REJECTIONS
    ],
)
def test_rejections_name_the_problem(raw: object, path: str, fragments: tuple[str, ...]) -> None:
    error = rejection(raw)
    assert error.path == path
    message = str(error)
    assert message.startswith(f"{path}: ")
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_rejections_also_apply_to_json_text() -> None:
    error = rejection(json.dumps(root(leaf("a.b", "eq", "x"))))
    assert error.path == "filter.filters[0].field"


def test_filter_error_is_a_value_error() -> None:
    assert issubclass(FilterError, ValueError)
    assert isinstance(rejection(42), ValueError)


# --- stored filters: what the fan-out does with the column's value ---------------------------

STORED = [pytest.param(raw, path, id=case_id) for case_id, raw, path in STORED_REJECTIONS]


@pytest.mark.parametrize(("raw", "path"), STORED)
def test_a_stored_filter_the_grammar_rejects_matches_nothing(raw: object, path: str) -> None:
    problem = stored_filter_problem(raw)
    assert problem is not None and problem.startswith(f"{path}: ")
    attributes: list[dict[str, str] | None] = [None, {}, {"a": "x"}, {"a": "x", "b": "y"}]
    assert [stored_filter_matches(raw, a) for a in attributes] == [False] * len(attributes)


def test_a_root_or_is_invalid_rather_than_read_as_and() -> None:
    stored = {"logic": "or", "filters": [leaf("a", "eq", "x"), leaf("b", "eq", "y")]}
    assert stored_filter_problem(stored) == (
        "filter.logic: the root logic must be 'and', got 'or'; to accept one of several values "
        "of a field, nest {'logic': 'or', 'filters': [...]} inside the root"
    )
    assert not stored_filter_matches(stored, {"a": "x", "b": "y"})


@pytest.mark.parametrize(
    ("stored", "kind"),
    [
        ('{"logic": "and", "filters": []}', "a string"),  # text in a JSON column is a string
        ("", "a string"),
        (5, "a number"),
        (True, "a boolean"),
        ([], "a list"),
    ],
)
def test_a_stored_value_that_is_not_an_object_is_invalid(stored: object, kind: str) -> None:
    assert stored_filter_problem(stored) == f"filter: must be a JSON object, got {kind}"
    assert not stored_filter_matches(stored, {"a": "x"})


@pytest.mark.parametrize("stored", [None, {}, root()])
def test_a_stored_null_or_empty_filter_matches_everything(stored: object) -> None:
    assert stored_filter_problem(stored) is None
    assert stored_filter_matches(stored, None) and stored_filter_matches(stored, {"a": "x"})


def test_a_valid_stored_filter_matches_as_parsed() -> None:
    stored = root(leaf("kind", "eq", "click"), any_of("region", "eu", "us"))
    assert stored_filter_problem(stored) is None
    assert stored_filter_matches(stored, {"kind": "click", "region": "us"})
    assert not stored_filter_matches(stored, {"kind": "click", "region": "uk"})


# --- matching semantics ---------------------------------------------------------------------

MATCH_CASES: list[tuple[str, dict[str, Any], dict[str, Any] | None, bool]] = [
    ("eq-equal", leaf("k", "eq", "click"), {"k": "click"}, True),
    ("eq-different", leaf("k", "eq", "click"), {"k": "view"}, False),
    ("eq-case-sensitive", leaf("k", "eq", "click"), {"k": "Click"}, False),
    ("eq-no-trimming", leaf("k", "eq", "click"), {"k": "click "}, False),
    ("eq-missing", leaf("k", "eq", "click"), {"other": "click"}, False),
    ("eq-key-case-sensitive", leaf("k", "eq", "click"), {"K": "click"}, False),
    ("neq-different", leaf("k", "neq", "click"), {"k": "view"}, True),
    ("neq-equal", leaf("k", "neq", "click"), {"k": "click"}, False),
    ("neq-case-differs", leaf("k", "neq", "click"), {"k": "CLICK"}, True),
    ("neq-missing", leaf("k", "neq", "click"), {}, False),
    ("neq-no-attributes", leaf("k", "neq", "click"), None, False),
    ("startswith-prefix", leaf("k", "startswith", "ord"), {"k": "order.created"}, True),
    ("startswith-whole", leaf("k", "startswith", "ord"), {"k": "ord"}, True),
    ("startswith-longer-value", leaf("k", "startswith", "order"), {"k": "ord"}, False),
    ("startswith-case", leaf("k", "startswith", "Ord"), {"k": "order"}, False),
    ("startswith-not-pattern", leaf("k", "startswith", "o%"), {"k": "order"}, False),
    ("startswith-literal-percent", leaf("k", "startswith", "o%"), {"k": "o%rder"}, True),
    ("startswith-missing", leaf("k", "startswith", "o"), {}, False),
    ("isnull-missing", leaf("k", "isnull"), {"other": "x"}, True),
    ("isnull-no-attributes", leaf("k", "isnull"), None, True),
    ("isnull-present", leaf("k", "isnull"), {"k": "x"}, False),
    ("isnull-empty-string-is-present", leaf("k", "isnull"), {"k": ""}, False),
    ("isnotnull-present", leaf("k", "isnotnull"), {"k": "x"}, True),
    ("isnotnull-missing", leaf("k", "isnotnull"), {}, False),
    ("or-first", any_of("k", "a", "b"), {"k": "a"}, True),
    ("or-second", any_of("k", "a", "b"), {"k": "b"}, True),
    ("or-none", any_of("k", "a", "b"), {"k": "c"}, False),
    ("or-case", any_of("k", "a", "b"), {"k": "A"}, False),
    ("or-missing", any_of("k", "a", "b"), {}, False),
    ("unicode-eq", leaf("k", "eq", "größe"), {"k": "größe"}, True),
    ("unicode-no-normalisation", leaf("k", "eq", "é"), {"k": "e\u0301"}, False),
    # A JSON null attribute value counts as absent, as in the SQL matcher.
    ("null-value-isnull", leaf("k", "isnull"), {"k": None}, True),
    ("null-value-isnotnull", leaf("k", "isnotnull"), {"k": None}, False),
    ("null-value-neq", leaf("k", "neq", "x"), {"k": None}, False),
]


@pytest.mark.parametrize(
    ("clause", "attributes", "expected"),
    [pytest.param(c, a, e, id=case_id) for case_id, c, a, e in MATCH_CASES],
)
def test_single_clause_semantics(
    clause: dict[str, Any], attributes: dict[str, Any] | None, expected: bool
) -> None:
    parsed = parse_filter(root(clause))
    assert parsed is not None
    assert parsed.matches(attributes) is expected


def test_clauses_are_anded() -> None:
    parsed = parse_filter(
        root(leaf("type", "eq", "click"), any_of("region", "eu", "us"), leaf("debug", "isnull"))
    )
    assert parsed is not None
    assert parsed.matches({"type": "click", "region": "eu"})
    assert parsed.matches({"type": "click", "region": "us", "extra": "ignored"})
    assert not parsed.matches({"type": "click", "region": "apac"})
    assert not parsed.matches({"type": "click", "region": "eu", "debug": "1"})
    assert not parsed.matches({"region": "eu"})
    assert not parsed.matches(None)


def test_filter_matches_helper() -> None:
    assert filter_matches(None, None)
    assert filter_matches(None, {"a": "b"})
    parsed = parse_filter(root(leaf("a", "eq", "b")))
    assert filter_matches(parsed, {"a": "b"})
    assert not filter_matches(parsed, {"a": "c"})


# --- properties -----------------------------------------------------------------------------

FIELD_POOL = ["a", "b", "kind", "Kind", "event-type", "x_1"]
# Shared prefixes and case variants so that eq/neq/startswith see both outcomes often.
VALUE_POOL = ["x", "X", "xy", "xyz", "ab", "abc", "é", "日本", "a b", "0", "%", "_"]
values = st.one_of(
    st.sampled_from(VALUE_POOL),
    st.text(
        alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
        min_size=1,
        max_size=6,
    ),
)


@st.composite
def raw_clause(draw: st.DrawFn, field: str) -> dict[str, Any]:
    """A valid clause for ``field`` in any of the forms an author might write."""
    kind = draw(st.sampled_from(["eq", "neq", "startswith", "isnull", "isnotnull", "or"]))
    if kind == "or":
        # Duplicates and one-member groups exercise normalisation.
        members = draw(st.lists(values, min_size=1, max_size=6))
        return any_of(field, *members)
    if kind in ("isnull", "isnotnull"):
        return leaf(field, kind, None) if draw(st.booleans()) else leaf(field, kind)
    return leaf(field, kind, draw(values))


@st.composite
def raw_filters(draw: st.DrawFn) -> dict[str, Any]:
    fields = draw(st.lists(st.sampled_from(FIELD_POOL), unique=True, min_size=1, max_size=5))
    clauses = [draw(raw_clause(f)) for f in fields]
    return root(*draw(st.permutations(clauses)))


@st.composite
def attributes_near(draw: st.DrawFn, raw: dict[str, Any]) -> dict[str, Any] | None:
    """Attributes for ``raw``'s fields drawn mostly from its own values and near misses of them
    (other case, one character more or less, empty, JSON null), so that equal, prefix and
    case-only outcomes are common rather than vanishingly rare."""
    if draw(st.integers(0, 9)) == 0:
        return None
    mentioned = [
        node["value"]
        for clause in raw["filters"]
        for node in clause.get("filters", [clause])
        if isinstance(node.get("value"), str)
    ]
    near = [
        variant
        for v in mentioned
        for variant in (v, v, v.swapcase(), v + "z", v[:-1], v.upper(), v.lower())
    ]
    candidates = st.one_of(st.sampled_from(near), values) if near else values
    return draw(
        st.dictionaries(
            st.sampled_from([*FIELD_POOL, "other"]),
            st.one_of(candidates, candidates, candidates, st.none()),
            max_size=10,
        )
    )


def reference_matches(raw: dict[str, Any], attributes: dict[str, Any] | None) -> bool:
    """Deliberately naive evaluation of the raw (unnormalised) grammar, as an oracle."""
    attrs = {k: v for k, v in (attributes or {}).items() if v is not None}  # null = absent
    for clause in raw["filters"]:
        if "logic" in clause:
            if not any(attrs.get(m["field"]) == m["value"] for m in clause["filters"]):
                return False
            continue
        present = clause["field"] in attrs
        actual = attrs.get(clause["field"])
        ok = {
            "eq": present and actual == clause.get("value"),
            "neq": present and actual != clause.get("value"),
            "startswith": present and str(actual).startswith(str(clause.get("value"))),
            "isnull": not present,
            "isnotnull": present,
        }[clause["operator"]]
        if not ok:
            return False
    return True


@HYPOTHESIS
@given(raw_filters())
def test_canonical_form_round_trips(raw: dict[str, Any]) -> None:
    parsed = parse_filter(raw)
    assert isinstance(parsed, AttributeFilter)
    canonical = parsed.to_json()
    # The stored form re-parses to the same value, as a dict and as JSON text...
    assert parse_filter(canonical) == parsed
    assert parse_filter(json.dumps(canonical)) == parsed
    # ...and is a fixed point, so saving a subscription twice never rewrites its filter.
    assert parse_filter(canonical).to_json() == canonical  # type: ignore[union-attr]
    assert json.loads(json.dumps(canonical)) == canonical


@HYPOTHESIS
@given(raw_filters(), st.randoms(use_true_random=False))
def test_canonical_form_ignores_order(raw: dict[str, Any], rnd: random.Random) -> None:
    # Deep copy: shuffling the nested lists in place would also reorder `raw` itself.
    shuffled = copy.deepcopy(raw)
    rnd.shuffle(shuffled["filters"])
    for clause in shuffled["filters"]:
        if "logic" in clause:
            rnd.shuffle(clause["filters"])
    assert parse_filter(shuffled) == parse_filter(raw)


@HYPOTHESIS
@given(st.data())
def test_matcher_agrees_with_reference(data: st.DataObject) -> None:
    raw = data.draw(raw_filters(), label="raw")
    parsed = parse_filter(raw)
    assert parsed is not None
    for attributes in data.draw(st.lists(attributes_near(raw), min_size=1, max_size=5)):
        expected = reference_matches(raw, attributes)
        assert parsed.matches(attributes) is expected, attributes
        # Normalisation must not change meaning.
        again = parse_filter(parsed.to_json())
        assert again is not None
        assert again.matches(attributes) is expected, attributes
