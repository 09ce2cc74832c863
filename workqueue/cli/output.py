"""Rendering for the CLI: aligned tables for people, JSON for machines."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Sequence
from typing import Any

from workqueue.logtext import log_text


def _plain(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


def to_json(data: Any) -> str:
    return json.dumps(data, default=_plain, indent=2, sort_keys=False)


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    """Format rows as a left-aligned text table with a header rule.

    Cells hold what publishers and handlers chose (keys, reasons, errors): their control
    characters are escaped, so that a newline cannot break a row in two nor an ANSI escape
    repaint the operator's terminal (review helper-142)."""
    cells = [[("" if v is None else log_text(str(_plain(v)))) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    lines = [
        "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip(),
        "  ".join("-" * w for w in widths),
    ]
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    return "\n".join(lines)
