"""Subscription attribute filters: validation, normalisation and matching.

A subscription may carry a filter that decides which published messages fan out to it. The
filter looks only at the message's *attributes* (a JSON object of up to 10 string → string
pairs); payloads are never inspected.

Accepted grammar (stored as JSON)::

    {"logic": "and", "filters": [CLAUSE, ...]}

    CLAUSE := {"field": NAME, "operator": OP, "value": STRING}      -- a condition
            | {"logic": "or", "filters": [EQ_CONDITION, ...]}       -- "NAME is one of ..."

* ``OP`` is one of ``eq``, ``neq``, ``startswith``, ``isnull``, ``isnotnull``.
* ``eq``/``neq``/``startswith`` need a non-empty string ``value``; ``isnull``/``isnotnull``
  take none (an explicit ``"value": null`` is tolerated, any other value is rejected).
* The root must use ``"logic": "and"``. A nested group may appear only directly under the
  root, must use ``"logic": "or"``, may hold only ``eq`` conditions, and all of them must name
  the same field.
* ``NAME`` matches ``[A-Za-z0-9_-]{1,64}``; dotted paths are not supported.
* Each field is constrained at most once (one condition or one group), at most 5 fields in
  total, and at most 50 values across the whole filter (counted as written).

Matching semantics (mirrored exactly by ``wq_filter_matches`` in
``workqueue/sql/postgresql/filters.sql``):

* values compare as strings, case-sensitively, code point by code point;
* ``eq`` = present and equal; ``neq`` = present and different; ``startswith`` = present and
  prefixed; ``isnull`` = absent; ``isnotnull`` = present; an ``or`` group = present and equal
  to one of the listed values;
* an absent attribute (missing key, or a JSON ``null`` value) fails every operator except
  ``isnull``;
* a null/blank filter, ``{}`` or an empty ``filters`` list matches every message — in that
  case :func:`parse_filter` returns ``None`` rather than an :class:`AttributeFilter`.

A *stored* filter (the value of ``Subscription.filter`` as read back from the database) is held
to the same grammar: one that is not JSON null or an object the grammar accepts — written by raw
SQL behind the guards, say — matches no message at all (:func:`stored_filter_matches`), so only
its own subscription misses work and the publish goes on. ``wq_filter_problem`` and
``wq_filter_matches`` in both vendors' ``filters.sql`` decide exactly the same, and
:func:`stored_filter_problem` says why a stored filter is invalid.

This module is pure Python: it imports nothing from Django so it can run in the publish hot
path, in the API layer and in tests alike. Validation failures raise :class:`FilterError`
(a ``ValueError``); model code is expected to convert it into a ``ValidationError``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = [
    "MAX_FIELDS",
    "MAX_VALUES",
    "AnyOf",
    "AttributeFilter",
    "Condition",
    "FilterError",
    "Operator",
    "filter_matches",
    "parse_filter",
    "stored_filter_matches",
    "stored_filter_problem",
]

MAX_FIELDS = 5
MAX_VALUES = 50

# The same rule as attribute keys accepted at publish time, so any field a filter names can
# actually occur on a message. ASCII-only by construction; fullmatch avoids `$` accepting a
# trailing newline.
_FIELD_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")

_ROOT_KEYS = frozenset({"logic", "filters"})
_CONDITION_KEYS = frozenset({"field", "operator", "value"})


class FilterError(ValueError):
    """A filter does not follow the accepted grammar.

    ``path`` locates the offending part (e.g. ``filter.filters[1].operator``); the message
    always starts with it and says what is allowed instead.
    """

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{path}: {problem}")


class Operator(StrEnum):
    EQ = "eq"
    NEQ = "neq"
    STARTSWITH = "startswith"
    ISNULL = "isnull"
    ISNOTNULL = "isnotnull"

    @property
    def takes_value(self) -> bool:
        return self not in (Operator.ISNULL, Operator.ISNOTNULL)


_ALLOWED_OPERATORS = ", ".join(repr(op.value) for op in Operator)


@dataclass(frozen=True, slots=True)
class Condition:
    """One test of one attribute. ``value`` is ``None`` exactly when the operator takes none."""

    field: str
    operator: Operator
    value: str | None = None

    def matches(self, attributes: Mapping[str, str]) -> bool:
        actual = attributes.get(self.field)
        op = self.operator
        if op is Operator.ISNULL:
            return actual is None
        if actual is None:
            # A missing attribute fails every other operator, including neq.
            return False
        if op is Operator.ISNOTNULL:
            return True
        if op is Operator.EQ:
            return actual == self.value
        if op is Operator.NEQ:
            return actual != self.value
        assert self.value is not None  # guaranteed by construction for value-taking operators
        return actual.startswith(self.value)

    def to_json(self) -> dict[str, str]:
        out = {"field": self.field, "operator": self.operator.value}
        if self.value is not None:
            out["value"] = self.value
        return out


@dataclass(frozen=True, slots=True)
class AnyOf:
    """``field`` is present and equal to one of ``values`` (an ``or`` group of ``eq``).

    In normalised form ``values`` is sorted, duplicate-free and has at least two entries (a
    single value is represented as an ``eq`` :class:`Condition` instead).
    """

    field: str
    values: tuple[str, ...]

    def matches(self, attributes: Mapping[str, str]) -> bool:
        actual = attributes.get(self.field)
        return actual is not None and actual in self.values

    def to_json(self) -> dict[str, Any]:
        return {
            "logic": "or",
            "filters": [
                {"field": self.field, "operator": Operator.EQ.value, "value": v}
                for v in self.values
            ],
        }


Clause = Condition | AnyOf


@dataclass(frozen=True, slots=True)
class AttributeFilter:
    """A validated, normalised filter: the conjunction of ``clauses``.

    Guarantees (when built by :func:`parse_filter`): at least one clause, clauses sorted by
    field name, one clause per field, at most :data:`MAX_FIELDS` clauses. Two filters that
    differ only in clause order, value order, duplicate values or a one-value group compare
    equal and serialise identically.
    """

    clauses: tuple[Clause, ...]

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(c.field for c in self.clauses)

    def matches(self, attributes: Mapping[str, str] | None) -> bool:
        """True when every clause accepts ``attributes`` (``None`` means no attributes)."""
        attrs: Mapping[str, str] = attributes if attributes is not None else {}
        return all(clause.matches(attrs) for clause in self.clauses)

    def to_json(self) -> dict[str, Any]:
        """The canonical stored form; ``parse_filter(f.to_json()) == f`` always holds."""
        return {"logic": "and", "filters": [clause.to_json() for clause in self.clauses]}


def filter_matches(
    attribute_filter: AttributeFilter | None, attributes: Mapping[str, str] | None
) -> bool:
    """Match with the "no filter matches everything" rule applied for ``None``."""
    return attribute_filter is None or attribute_filter.matches(attributes)


def stored_filter_problem(stored: object) -> str | None:
    """Say why a stored filter is invalid, or return ``None`` when it is valid.

    ``stored`` is the decoded JSON a ``Subscription.filter`` column holds: ``None`` (no filter)
    or an object the grammar accepts is valid. Unlike :func:`parse_filter`, text is not parsed
    as JSON: a JSON string stored in the column is a string, not a filter.
    """
    try:
        _parse_stored(stored)
    except FilterError as exc:
        return str(exc)
    return None


def stored_filter_matches(stored: object, attributes: Mapping[str, str] | None) -> bool:
    """Match a stored filter the way the fan-out does: an invalid one matches nothing."""
    try:
        parsed = _parse_stored(stored)
    except FilterError:
        return False
    return filter_matches(parsed, attributes)


def _parse_stored(stored: object) -> AttributeFilter | None:
    if stored is not None and not isinstance(stored, Mapping):
        raise FilterError("filter", f"must be a JSON object, got {_kind(stored)}")
    return parse_filter(stored)


def parse_filter(raw: object) -> AttributeFilter | None:
    """Validate ``raw`` and return its normalised form, or ``None`` if it matches everything.

    ``raw`` may be ``None``, a mapping, JSON text (``str``) or an already-parsed
    :class:`AttributeFilter` (returned unchanged). Blank text, JSON ``null``, ``{}`` and an
    empty ``filters`` list all mean "no filter" and yield ``None``.

    Raises :class:`FilterError` naming the offending part and what is allowed there.
    """
    if raw is None or isinstance(raw, AttributeFilter):
        return raw
    if isinstance(raw, str):
        if not raw.strip():
            return None
        try:
            # Duplicate keys are rejected: json.loads would silently keep the last one, which
            # hides mistakes like {"field": "a", "field": "b"}.
            raw = json.loads(raw, object_pairs_hook=_reject_duplicate_keys)
        except _DuplicateKeyError as exc:
            raise FilterError("filter", f"duplicate key {exc.key!r} in JSON object") from None
        except ValueError as exc:
            raise FilterError("filter", f"not valid JSON ({exc})") from None
        if raw is None:
            return None
    if not isinstance(raw, Mapping):
        raise FilterError(
            "filter",
            f"must be a JSON object {{'logic': 'and', 'filters': [...]}}, got {_kind(raw)}",
        )
    return _parse_root(raw)


# --- validation internals -------------------------------------------------------------------


class _DuplicateKeyError(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKeyError(key)
        out[key] = value
    return out


def _kind(value: object) -> str:
    """A JSON-flavoured name for a value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list | tuple):
        return "a list"
    return type(value).__name__


def _check_keys(node: Mapping[Any, Any], allowed: frozenset[str], path: str) -> None:
    for key in node:
        if key not in allowed:
            raise FilterError(
                path, f"unknown key {key!r} (allowed keys: {', '.join(sorted(allowed))})"
            )


class _Budget:
    """Tracks the cross-clause limits while clauses are parsed, so that an oversized filter is
    rejected as soon as it exceeds a limit rather than after being fully walked."""

    def __init__(self) -> None:
        self.field_paths: dict[str, str] = {}
        self.values = 0

    def claim_field(self, field: str, path: str) -> None:
        earlier = self.field_paths.get(field)
        if earlier is not None:
            raise FilterError(
                path,
                f"field {field!r} is already constrained by {earlier}; each field may be "
                "constrained only once (to accept several values use one "
                "{'logic': 'or', 'filters': [...eq conditions...]} group)",
            )
        if len(self.field_paths) >= MAX_FIELDS:
            raise FilterError(
                path,
                f"field {field!r} would be field number {len(self.field_paths) + 1}; a filter "
                f"may constrain at most {MAX_FIELDS} distinct fields",
            )
        self.field_paths[field] = path

    def count_value(self, path: str) -> None:
        self.values += 1
        if self.values > MAX_VALUES:
            raise FilterError(
                path, f"too many values; a filter may list at most {MAX_VALUES} values in total"
            )


def _parse_root(node: Mapping[Any, Any]) -> AttributeFilter | None:
    path = "filter"
    if not node:
        return None
    _check_keys(node, _ROOT_KEYS, path)
    if "logic" not in node:
        raise FilterError(
            path, "missing 'logic'; the root must be {'logic': 'and', 'filters': [...]}"
        )
    logic = node["logic"]
    if logic != "and":
        raise FilterError(
            f"{path}.logic",
            f"the root logic must be 'and', got {logic!r}; to accept one of several values of a "
            "field, nest {'logic': 'or', 'filters': [...]} inside the root",
        )
    if "filters" not in node:
        raise FilterError(path, "missing 'filters' (a list of conditions)")
    items = node["filters"]
    if not isinstance(items, list | tuple):
        raise FilterError(f"{path}.filters", f"must be a list, got {_kind(items)}")

    budget = _Budget()
    clauses: list[Clause] = []
    for index, item in enumerate(items):
        item_path = f"{path}.filters[{index}]"
        if not isinstance(item, Mapping):
            raise FilterError(
                item_path, f"must be an object (a condition or a group), got {_kind(item)}"
            )
        if "logic" in item or "filters" in item:
            clauses.append(_parse_group(item, item_path, budget))
        else:
            condition = _parse_condition(item, item_path)
            budget.claim_field(condition.field, item_path)
            if condition.value is not None:
                budget.count_value(f"{item_path}.value")
            clauses.append(condition)

    if not clauses:
        return None
    clauses.sort(key=lambda clause: clause.field)
    return AttributeFilter(tuple(clauses))


def _parse_group(node: Mapping[Any, Any], path: str, budget: _Budget) -> Clause:
    _check_keys(node, _ROOT_KEYS, path)
    logic = node.get("logic")
    if logic != "or":
        raise FilterError(
            f"{path}.logic",
            f"a nested group must use logic 'or', got {logic!r} (conditions combined with "
            "'and' belong directly in the root 'filters' list)",
        )
    items = node.get("filters")
    if not isinstance(items, list | tuple):
        raise FilterError(
            f"{path}.filters", f"must be a list of 'eq' conditions, got {_kind(items)}"
        )
    if not items:
        raise FilterError(
            f"{path}.filters",
            "an 'or' group needs at least one 'eq' condition (empty would match nothing)",
        )

    field: str | None = None
    values: list[str] = []
    for index, item in enumerate(items):
        item_path = f"{path}.filters[{index}]"
        if not isinstance(item, Mapping):
            raise FilterError(item_path, f"must be an 'eq' condition object, got {_kind(item)}")
        if "logic" in item or "filters" in item:
            raise FilterError(
                item_path,
                "groups may be nested only one level deep; an 'or' group may contain only "
                "'eq' conditions",
            )
        condition = _parse_condition(item, item_path)
        if condition.operator is not Operator.EQ:
            raise FilterError(
                f"{item_path}.operator",
                f"operator {condition.operator.value!r} is not allowed inside an 'or' group; only "
                "'eq' is (a group means 'field is one of these values')",
            )
        if field is None:
            field = condition.field
            budget.claim_field(field, path)
        elif condition.field != field:
            raise FilterError(
                f"{item_path}.field",
                f"an 'or' group must constrain a single field; this group is about {field!r} but "
                f"this condition names {condition.field!r}",
            )
        budget.count_value(f"{item_path}.value")
        assert condition.value is not None  # eq always carries a value
        values.append(condition.value)

    assert field is not None  # the group is non-empty
    distinct = tuple(sorted(set(values)))
    if len(distinct) == 1:
        # "one of {x}" is just "eq x"; collapsing keeps the canonical form unique.
        return Condition(field, Operator.EQ, distinct[0])
    return AnyOf(field, distinct)


def _parse_condition(node: Mapping[Any, Any], path: str) -> Condition:
    _check_keys(node, _CONDITION_KEYS, path)

    if "field" not in node:
        raise FilterError(path, "missing 'field' (the attribute name to test)")
    field = node["field"]
    if not isinstance(field, str):
        raise FilterError(f"{path}.field", f"must be a string attribute name, got {_kind(field)}")
    if not _FIELD_RE.fullmatch(field):
        raise FilterError(
            f"{path}.field",
            f"invalid attribute name {field!r}: use 1-64 characters from A-Z, a-z, 0-9, '_' and "
            "'-' (dotted paths and other characters are not supported)",
        )

    if "operator" not in node:
        raise FilterError(path, f"missing 'operator' (one of {_ALLOWED_OPERATORS})")
    raw_op = node["operator"]
    try:
        operator = Operator(raw_op) if isinstance(raw_op, str) else None
    except ValueError:
        operator = None
    if operator is None:
        raise FilterError(
            f"{path}.operator", f"unsupported operator {raw_op!r} (allowed: {_ALLOWED_OPERATORS})"
        )

    value = node.get("value")
    if not operator.takes_value:
        # `"value": null` is what filter-builder UIs emit for value-less operators; accept it.
        if value is not None:
            raise FilterError(
                f"{path}.value", f"operator {operator.value!r} takes no value, got {value!r}"
            )
        return Condition(field, operator, None)

    if "value" not in node or value is None:
        raise FilterError(path, f"operator {operator.value!r} needs a non-empty string 'value'")
    if not isinstance(value, str):
        hint = ""
        if isinstance(value, int | float) and not isinstance(value, bool):
            # Attributes are strings, so a bare number could never match; say how to fix it.
            hint = f"; values compare as strings, so write {json.dumps(str(value))}"
        raise FilterError(f"{path}.value", f"must be a non-empty string, got {_kind(value)}{hint}")
    if not value:
        raise FilterError(f"{path}.value", f"operator {operator.value!r} needs a non-empty string")
    _check_storable(value, f"{path}.value")
    return Condition(field, operator, value)


def _check_storable(value: str, path: str) -> None:
    # The stored filter lives in a PostgreSQL jsonb column, which cannot hold U+0000 or
    # unpaired surrogates; rejecting them here keeps "valid" and "storable" the same thing.
    if "\x00" in value:
        raise FilterError(path, "must not contain the NUL character (U+0000)")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise FilterError(path, "must be valid Unicode text (no unpaired surrogates)") from None
