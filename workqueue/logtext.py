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

__all__ = ["log_text", "log_value"]


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
    if text and text.isprintable() and " " not in text:
        return text
    return repr(text)


def log_text(text: str) -> str:
    """Free text (a reason, an error's summary) for a log line: as it is, but with each control
    character, line or paragraph separator written as its escape (``\\n``, ``\\x1b``,
    ``\\u2028``)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
