"""Text that publishers and handlers chose, drawn on the admin's pages as it is stored.

Django escapes HTML, but not the Unicode characters that are invisible or reorder the text
after them: a partition key published as ``"\\u202e24-remotsuc"`` (U+202E RIGHT-TO-LEFT
OVERRIDE) was drawn as "customer-42", ``"customer-42\\u200b"`` (a zero-width space) as
"customer-42", and a payload's ``{"amount": "\\u202e00.01"}`` as ``"10.00"``, in the lists, the
detail pages and the Replay/Discard confirmation page an operator decides from (review
helper-143). The CLI's tables already write such characters as escapes
(``workqueue.logtext.log_text``); the admin writes them the same way: every character
``str.isprintable`` refuses (controls, format characters such as the bidirectional overrides
and zero-width ones, separators other than the space), and the printable ones drawn as nothing
(Hangul fillers, variation selectors: ``workqueue.logtext``), becomes its escape, ``\\u202e``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from workqueue.logtext import all_drawn, drawn_as_nothing, log_text


def visible_text(value: str | None, *, lines: bool = False) -> str | None:
    """``value`` with its invisible and reordering characters written as escapes; None stays
    None. With ``lines``, newlines are kept (a traceback stays one frame a line)."""
    if value is None:
        return None
    if not lines:
        return log_text(value)
    return "\n".join(log_text(line) for line in value.split("\n"))


# The escapes visible_text writes (Python's, as repr writes a character it cannot print).
_ESCAPE = re.compile(r"\\(?:x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|([ntr]))")
_CONTROL = {"n": "\n", "t": "\t", "r": "\r"}


def stored_text(shown: str) -> str:
    """The text ``shown`` was drawn from: its escapes read back (``\\u200b`` as U+200B), so
    that a key copied from a page finds its rows in the exact search."""

    def character(match: re.Match[str]) -> str:
        hex_code = match.group(1) or match.group(2) or match.group(3)
        if hex_code is None:
            return _CONTROL[match.group(4)]
        code = int(hex_code, 16)
        # Not a NUL nor half a surrogate pair, which no stored text holds (PostgreSQL refuses
        # them, a search for one failed with a 500: review helper-144): searched as typed.
        if code == 0 or 0xD800 <= code <= 0xDFFF or code > 0x10FFFF:
            return match.group(0)
        return chr(code)

    return _ESCAPE.sub(character, shown)


def visible_json(value: Any, *, indent: int | None = None) -> str:
    """``value`` as JSON text whose strings (keys and values) write their invisible and
    reordering characters as JSON escapes (``\\u202e``): the same JSON, read back, and drawn
    as stored. Newlines are the layout's own (JSON escapes those inside strings)."""
    text = json.dumps(value, indent=indent, ensure_ascii=False, sort_keys=True)
    return "\n".join(
        line if all_drawn(line) else "".join(map(_json_character, line))
        for line in text.split("\n")
    )


def _json_character(character: str) -> str:
    if not drawn_as_nothing(character):
        return character
    code = ord(character)
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    # Beyond the BMP (tag characters, U+E0001...): JSON writes a surrogate pair.
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"
