"""Values that callers chose, made safe to write into a log line's text.

A partition key, a message id read from a cloud queue, a dead-letter reason or an error's
message come from publishers and handlers (often a payload's data). Written into a line as
they are, a newline in one starts a line of its own in a plain-text log, which can pass for
the host's (a fake ``ERROR`` line), and an ANSI escape repaints the terminal that shows the log
(review helper-142). The record's attributes keep the values as they are, for structured
handlers, whose formats escape them.

Pure Python: no Django.
"""

from __future__ import annotations

import re

__all__ = ["all_drawn", "drawn_as_nothing", "escaped", "log_text", "log_value"]

#: Characters ``str.isprintable`` accepts that draw as nothing or as a blank: Unicode's
#: default-ignorable letters and marks (the combining grapheme joiner, the Hangul fillers,
#: Khmer's inherent vowels, Mongolian's and the other variation selectors) and the blank
#: Braille pattern. "customer-42" followed by one reads "customer-42" (review helper-144).
_DRAWN_AS_NOTHING = re.compile(
    "[\u034f\u115f\u1160\u17b4\u17b5\u180b-\u180f\u2800\u3164\ufe00-\ufe0f"
    "\uffa0\U000e0100-\U000e01ef]"
)


def drawn_as_nothing(character: str) -> bool:
    """Whether ``character`` would be drawn as nothing a reader could tell apart: a control,
    format or separator character (``str.isprintable`` refuses those) or one of
    ``_DRAWN_AS_NOTHING``."""
    return not character.isprintable() or _DRAWN_AS_NOTHING.match(character) is not None


def escaped(character: str) -> str:
    """``character`` escaped as Python writes it (``\\n``, ``\\x1b``, ``\\u202e``,
    ``\\U000e0100``)."""
    code = ord(character)
    if code < 0x100 and character in "\n\r\t":
        return repr(character)[1:-1]
    if code < 0x100:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def all_drawn(text: str) -> bool:
    """Whether no character of ``text`` is drawn as nothing (the common case, checked in C)."""
    return text.isprintable() and _DRAWN_AS_NOTHING.search(text) is None


def log_value(value: object) -> str:
    """``value`` as one field of a line (``key=...``): as it is when it is printable text
    without a space, as most keys and ids are, else quoted with its control characters escaped
    (Python's ``repr``), so that it can neither end the line nor pass for the line's next
    field."""
    if value is None:
        return "None"
    text = str(value)
    # str.isprintable is false for every control character, line or paragraph separator and
    # space other than " " itself: one pass in C, no copy, for the common case.
    if text and " " not in text and all_drawn(text):
        return text
    # repr escapes what isprintable refuses, but not the printable ones drawn as nothing.
    return _DRAWN_AS_NOTHING.sub(lambda found: escaped(found.group()), repr(text))


def log_text(text: str) -> str:
    """Free text (a reason, an error's summary) for a log line: as it is, but with each control
    character, line or paragraph separator, and each character drawn as nothing, written as
    its escape (``\\n``, ``\\x1b``, ``\\u2028``, ``\\u115f``)."""
    if all_drawn(text):
        return text
    return "".join(escaped(c) if drawn_as_nothing(c) else c for c in text)
