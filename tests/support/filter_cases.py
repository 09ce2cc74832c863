"""Filters shared by the filter tests: builders for the grammar's nodes and a corpus of filters
the grammar rejects, each with the path its error names (Python's parse_filter and the SQL
wq_filter_problem must both name it) and fragments of Python's message."""

from __future__ import annotations

import json
from typing import Any

from workqueue.filters import MAX_FIELDS, MAX_VALUES


def leaf(field: str, operator: str, value: Any = ..., **extra: Any) -> dict[str, Any]:
    node: dict[str, Any] = {"field": field, "operator": operator, **extra}
    if value is not ...:
        node["value"] = value
    return node


def any_of(field: str, *values: str) -> dict[str, Any]:
    return {"logic": "or", "filters": [leaf(field, "eq", v) for v in values]}


def root(*clauses: dict[str, Any]) -> dict[str, Any]:
    return {"logic": "and", "filters": list(clauses)}


# (id, raw, path the error must name, fragments the message must contain)
REJECTIONS: list[tuple[str, object, str, tuple[str, ...]]] = [
    # Shape of the whole thing.
    ("list-root", [leaf("a", "eq", "x")], "filter", ("JSON object", "a list")),
    ("number-root", 5, "filter", ("JSON object", "a number")),
    ("bad-json", "{logic: and}", "filter", ("not valid JSON",)),
    ("json-array", "[]", "filter", ("JSON object", "a list")),
    (
        "duplicate-json-key",
        '{"logic": "and", "logic": "or", "filters": []}',
        "filter",
        ("duplicate key 'logic'",),
    ),
    (
        "root-unknown-key",
        {"logic": "and", "filters": [], "ignoreCase": True},
        "filter",
        ("unknown key 'ignoreCase'", "allowed keys: filters, logic"),
    ),
    ("root-is-a-condition", leaf("a", "eq", "x"), "filter", ("unknown key",)),
    (
        "root-missing-logic",
        {"filters": [leaf("a", "eq", "x")]},
        "filter",
        ("missing 'logic'", "'and'"),
    ),
    (
        "root-logic-or",
        {"logic": "or", "filters": [leaf("a", "eq", "x")]},
        "filter.logic",
        ("root logic must be 'and'", "got 'or'"),
    ),
    (
        "root-logic-uppercase",
        {"logic": "AND", "filters": []},
        "filter.logic",
        ("must be 'and'", "'AND'"),
    ),
    ("root-missing-filters", {"logic": "and"}, "filter", ("missing 'filters'",)),
    (
        "filters-not-list",
        {"logic": "and", "filters": "a eq x"},
        "filter.filters",
        ("must be a list", "a string"),
    ),
    (
        "item-not-object",
        root("a eq x"),
        "filter.filters[0]",  # type: ignore[arg-type]
        ("must be an object", "a string"),
    ),
    # Conditions.
    (
        "unknown-condition-key",
        root(leaf("a", "eq", "x", ignoreCase=True)),
        "filter.filters[0]",
        ("unknown key 'ignoreCase'", "field, operator, value"),
    ),
    (
        "missing-field",
        root({"operator": "eq", "value": "x"}),
        "filter.filters[0]",
        ("missing 'field'",),
    ),
    (
        "field-not-string",
        root(leaf(7, "eq", "x")),
        "filter.filters[0].field",  # type: ignore[arg-type]
        ("must be a string", "a number"),
    ),
    (
        "field-dotted",
        root(leaf("payload.kind", "eq", "x")),
        "filter.filters[0].field",
        ("invalid attribute name 'payload.kind'", "1-64", "dotted"),
    ),
    (
        "field-empty",
        root(leaf("", "eq", "x")),
        "filter.filters[0].field",
        ("invalid attribute name ''",),
    ),
    (
        "field-too-long",
        root(leaf("x" * 65, "eq", "x")),
        "filter.filters[0].field",
        ("invalid attribute name", "1-64"),
    ),
    (
        "field-space",
        root(leaf("a b", "eq", "x")),
        "filter.filters[0].field",
        ("invalid attribute name 'a b'",),
    ),
    (
        "field-non-ascii",
        root(leaf("é", "eq", "x")),
        "filter.filters[0].field",
        ("invalid attribute name",),
    ),
    (
        "field-trailing-newline",
        root(leaf("a\n", "eq", "x")),
        "filter.filters[0].field",
        ("invalid attribute name",),
    ),
    (
        "missing-operator",
        root({"field": "a", "value": "x"}),
        "filter.filters[0]",
        ("missing 'operator'", "'eq'", "'isnotnull'"),
    ),
    (
        "unknown-operator",
        root(leaf("a", "contains", "x")),
        "filter.filters[0].operator",
        ("unsupported operator 'contains'", "'startswith'"),
    ),
    (
        "operator-wrong-case",
        root(leaf("a", "EQ", "x")),
        "filter.filters[0].operator",
        ("unsupported operator 'EQ'",),
    ),
    (
        "operator-not-string",
        root(leaf("a", 1, "x")),
        "filter.filters[0].operator",  # type: ignore[arg-type]
        ("unsupported operator 1",),
    ),
    (
        "eq-without-value",
        root(leaf("a", "eq")),
        "filter.filters[0]",
        ("'eq' needs a non-empty string 'value'",),
    ),
    (
        "neq-null-value",
        root(leaf("a", "neq", None)),
        "filter.filters[0]",
        ("'neq' needs a non-empty string 'value'",),
    ),
    (
        "startswith-empty-value",
        root(leaf("a", "startswith", "")),
        "filter.filters[0].value",
        ("'startswith' needs a non-empty string",),
    ),
    (
        "eq-number-value",
        root(leaf("a", "eq", 5)),
        "filter.filters[0].value",
        ("must be a non-empty string", "a number", 'write "5"'),
    ),
    (
        "eq-bool-value",
        root(leaf("a", "eq", True)),
        "filter.filters[0].value",
        ("must be a non-empty string", "a boolean"),
    ),
    (
        "eq-list-value",
        root(leaf("a", "eq", ["x", "y"])),
        "filter.filters[0].value",
        ("must be a non-empty string", "a list"),
    ),
    (
        "isnull-with-value",
        root(leaf("a", "isnull", "x")),
        "filter.filters[0].value",
        ("'isnull' takes no value",),
    ),
    (
        "isnotnull-with-empty-value",
        root(leaf("a", "isnotnull", "")),
        "filter.filters[0].value",
        ("'isnotnull' takes no value",),
    ),
    ("value-with-nul", root(leaf("a", "eq", "x\x00y")), "filter.filters[0].value", ("NUL",)),
    (
        "value-with-lone-surrogate",
        root(leaf("a", "eq", "x\ud800")),
        "filter.filters[0].value",
        ("unpaired surrogates",),
    ),
    # Nested groups.
    (
        "group-logic-and",
        root({"logic": "and", "filters": [leaf("a", "eq", "x")]}),
        "filter.filters[0].logic",
        ("nested group must use logic 'or'", "got 'and'"),
    ),
    (
        "group-missing-logic",
        root({"filters": [leaf("a", "eq", "x")]}),
        "filter.filters[0].logic",
        ("nested group must use logic 'or'", "got None"),
    ),
    (
        "group-unknown-key",
        root({**any_of("a", "x", "y"), "field": "a"}),
        "filter.filters[0]",
        ("unknown key 'field'",),
    ),
    (
        "group-filters-not-list",
        root({"logic": "or", "filters": None}),
        "filter.filters[0].filters",
        ("list of 'eq' conditions", "null"),
    ),
    (
        "group-empty",
        root({"logic": "or", "filters": []}),
        "filter.filters[0].filters",
        ("at least one 'eq' condition",),
    ),
    (
        "group-too-deep",
        root({"logic": "or", "filters": [any_of("a", "x", "y")]}),
        "filter.filters[0].filters[0]",
        ("nested only one level deep",),
    ),
    (
        "group-member-not-object",
        root({"logic": "or", "filters": ["x"]}),
        "filter.filters[0].filters[0]",
        ("'eq' condition object", "a string"),
    ),
    (
        "group-neq",
        root({"logic": "or", "filters": [leaf("a", "eq", "x"), leaf("a", "neq", "y")]}),
        "filter.filters[0].filters[1].operator",
        ("operator 'neq' is not allowed inside an 'or' group", "only 'eq'"),
    ),
    (
        "group-isnull",
        root({"logic": "or", "filters": [leaf("a", "isnull")]}),
        "filter.filters[0].filters[0].operator",
        ("'isnull' is not allowed inside an 'or' group",),
    ),
    (
        "group-two-fields",
        root({"logic": "or", "filters": [leaf("a", "eq", "x"), leaf("b", "eq", "y")]}),
        "filter.filters[0].filters[1].field",
        ("single field", "about 'a'", "names 'b'"),
    ),
    (
        "group-member-bad-field",
        root(any_of("a.b", "x")),
        "filter.filters[0].filters[0].field",
        ("invalid attribute name 'a.b'",),
    ),
    # Cross-clause limits.
    (
        "same-field-twice",
        root(leaf("a", "eq", "x"), leaf("a", "neq", "y")),
        "filter.filters[1]",
        ("field 'a' is already constrained by filter.filters[0]", "only once", "'or'"),
    ),
    (
        "field-in-leaf-and-group",
        root(leaf("a", "isnotnull"), any_of("a", "x", "y")),
        "filter.filters[1]",
        ("field 'a' is already constrained by filter.filters[0]",),
    ),
    (
        "too-many-fields",
        root(*(leaf(f"f{i}", "isnotnull") for i in range(MAX_FIELDS + 1))),
        "filter.filters[5]",
        ("field number 6", "at most 5 distinct fields"),
    ),
    (
        "too-many-values-in-group",
        root(any_of("a", *(f"v{i}" for i in range(MAX_VALUES + 1)))),
        "filter.filters[0].filters[50].value",
        ("too many values", "at most 50"),
    ),
    (
        "too-many-values-overall",
        root(
            any_of("a", *(f"v{i}" for i in range(MAX_VALUES - 1))),
            leaf("b", "neq", "x"),
            leaf("c", "eq", "y"),
        ),
        "filter.filters[2].value",
        ("too many values", "at most 50"),
    ),
    # Duplicates count as written: the limit is about what the author typed.
    (
        "too-many-values-with-duplicates",
        root(any_of("a", *(["x"] * (MAX_VALUES + 1)))),
        "filter.filters[0].filters[50].value",
        ("too many values",),
    ),
]


def _storable(raw: object) -> bool:
    """A JSON column can hold it: not text (which a JSON column holds as a JSON string, never a
    filter), no U+0000 (jsonb refuses it) and no lone surrogate (UTF-8 cannot encode it)."""
    if isinstance(raw, str):
        return False
    text = json.dumps(raw, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\\u0000" not in text  # json.dumps writes U+0000 as this escape


#: (id, stored value, path) of every rejection a Subscription.filter column can hold.
STORED_REJECTIONS: list[tuple[str, object, str]] = [
    (case_id, raw, path) for case_id, raw, path, _ in REJECTIONS if _storable(raw)
]
