"""The text and JSON the work queue accepts, checked before any database work.

PostgreSQL stores no NUL character, in text or in jsonb, and no text can hold a lone surrogate
(a code point from U+D800 to U+DFFF without its pair: Python strings may, UTF-8 cannot). JSON
nested hundreds of levels deep makes serialising it fail on Python's recursion limit, and
NaN or Infinity are not JSON at all. Sent to the database, each of these fails there, or in
the database library, as an error that says nothing to the caller. Every entry path (publishing,
the operator functions, and through them the REST API and the CLI) checks its input here first
and names the field, so such input is a 400, an ``InvalidInputError`` or a ``CommandError``.
The rules are the same whatever the database vendor, so a message is valid or not everywhere.

Pure Python: no Django.
"""

from __future__ import annotations

import json
import re

__all__ = [
    "MAX_JSON_DEPTH",
    "NON_FINITE_PROBLEM",
    "NUL_PROBLEM",
    "SURROGATE_PROBLEM",
    "TOO_DEEP_PROBLEM",
    "holds_more_json_values",
    "json_text_problem",
    "text_problem",
]

#: How deeply JSON values (payloads) may nest: objects and arrays within each other.
MAX_JSON_DEPTH = 64

NUL_PROBLEM = "holds a NUL character (\\u0000), which the database cannot store"
SURROGATE_PROBLEM = (
    "holds a lone surrogate (a code point from U+D800 to U+DFFF without its pair), which is "
    "not text the database can store"
)
NON_FINITE_PROBLEM = "holds NaN or Infinity, which JSON has no form for"
TOO_DEEP_PROBLEM = f"is nested more than {MAX_JSON_DEPTH} levels deep"

# In JSON text a NUL can only be the escape \u0000; it is one unless its backslash is itself
# escaped, i.e. preceded by an even number of backslashes. (The lookbehind keeps the search
# linear in runs of backslashes.)
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
# Outside its strings, JSON text holds only ASCII: keep the brackets (braces as square ones) and
# delete everything else.
_ONLY_BRACKETS = {code: None for code in range(128)} | {
    ord("["): "[",
    ord("]"): "]",
    ord("{"): "[",
    ord("}"): "]",
}


def text_problem(value: str) -> str | None:
    """Why ``value`` cannot be stored as text (to follow the field's name), or None."""
    if "\x00" in value:
        return NUL_PROBLEM
    if _has_lone_surrogate(value):
        return SURROGATE_PROBLEM
    return None


def json_text_problem(text: str) -> str | None:
    """Why the JSON ``text`` cannot be stored (to follow the field's name), or None.

    ``text`` is a value as ``json.dumps(..., ensure_ascii=False)`` writes it: NUL characters are
    escaped, surrogates are not. The checks read the text rather than walk the value: a few
    passes of C code over a string the caller has to serialise anyway (usually a fraction of
    what serialising costs), where a walk in Python costs about half a microsecond a node,
    seconds for one full publish batch.
    """
    # The substring test first: the exact search is slower and only needed when it matches.
    if "\\u0000" in text and _NUL_ESCAPE.search(text):
        return NUL_PROBLEM
    if _has_lone_surrogate(text):
        return SURROGATE_PROBLEM
    # Only when the whole text (strings too) might hold NaN, or more containers than may nest,
    # are the strings removed to look at the structure.
    non_finite = "NaN" in text or "Infinity" in text
    if not non_finite and text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return None
    structure = _STRING.sub("", text)
    if non_finite and ("NaN" in structure or "Infinity" in structure):
        return NON_FINITE_PROBLEM
    if _deeper_than(structure, MAX_JSON_DEPTH):
        return TOO_DEEP_PROBLEM
    return None


# A JSON string in UTF-8 bytes (no byte of a multi-byte character is a quote or a backslash),
# or what is left of an unterminated one: from its quote, the pattern always matches, so a
# search never starts again inside a string it failed to close (each escaped quote of one
# would be such a start, each scanning to the end of the body: quadratic, review helper-172).
_STRING_BYTES = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
# One for each value and key that follows another, and for each container: with one more for
# the first value, at least as many as the text holds values and keys.
_VALUE_MARKS = (b",", b":", b"[", b"{")


def holds_more_json_values(raw: bytes, limit: int) -> bool:
    """Whether the JSON text ``raw`` holds more than ``limit`` values and keys, counted without
    decoding it (an upper bound: each comma, colon and opening bracket outside its strings,
    plus one). Decoded, a value costs up to some 70 bytes, so JSON of empty objects grows 25
    times: what a body's byte limit does not bound."""
    encoding = json.detect_encoding(raw)
    if encoding not in ("utf-8", "utf-8-sig"):
        # json.loads reads UTF-16 and UTF-32 too, whose characters can hold a quote's byte
        # (review helper-172): counted as the UTF-8 it stands for.
        try:
            raw = raw.decode(encoding).encode("utf-8")
        except UnicodeError:
            return False  # not text at all: the parse refuses it
    if sum(raw.count(mark) for mark in _VALUE_MARKS) < limit:
        return False  # even counting the strings' own commas and colons
    structure = _STRING_BYTES.sub(b"", raw)
    return sum(structure.count(mark) for mark in _VALUE_MARKS) + 1 > limit


def _has_lone_surrogate(text: str) -> bool:
    # A str fails to encode as UTF-8 only for surrogate code points, which no stored text may
    # hold (an escaped pair in JSON decodes to the one character it stands for). ASCII text
    # holds none, and says so without the copy encoding makes.
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _deeper_than(structure: str, limit: int) -> bool:
    """Whether the JSON ``structure`` (its strings removed) nests more than ``limit`` deep.

    With everything but the brackets removed, a container holding no container reads ``[]``;
    each round removes all of those, i.e. one level, so what is left after ``limit`` rounds was
    nested deeper. Each round is one pass over a string that shrinks as it goes.
    """
    brackets = structure.translate(_ONLY_BRACKETS)
    for _ in range(limit):
        if not brackets:
            return False
        brackets = brackets.replace("[]", "")
    return bool(brackets)


def key_length(text: str) -> int:
    """``text``'s length as both databases' key columns hold it: in UTF-16 code units, as SQL
    Server's nvarchar counts, so a character beyond the Basic Multilingual Plane (most emoji)
    counts twice and a key that passes fits on either vendor."""
    return len(text) if text.isascii() else len(text.encode("utf-16-le", "surrogatepass")) // 2


#: How a key's limit is said, wherever one is refused.
KEY_UNITS = "characters (an emoji or another character beyond U+FFFF counts as two)"


def within_units(text: str, units: int, *, from_end: bool = False) -> str:
    """The longest start (or end) of ``text`` at most ``units`` UTF-16 code units long (see
    ``key_length``): what SQL Server's ``LEFT`` would keep, but never half a character."""
    units = max(units, 0)
    if key_length(text) <= units:
        return text
    if text.isascii():
        return text[len(text) - units :] if from_end else text[:units]
    kept: list[str] = []
    used = 0
    for character in reversed(text) if from_end else text:
        used += 2 if ord(character) > 0xFFFF else 1
        if used > units:
            break
        kept.append(character)
    return "".join(reversed(kept) if from_end else kept)
