"""Keyset cursors (opaque base64url JSON) and page-size rules for operator listings."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from workqueue.exceptions import InvalidInputError

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 500
MAX_CURSOR_LENGTH = 500


def page_size(value: Any) -> int:
    if value is None:
        return DEFAULT_PAGE_SIZE
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            value = int(str(value))
        except ValueError:
            raise InvalidInputError("page_size must be a whole number from 1 to 500.") from None
    if not 1 <= value <= MAX_PAGE_SIZE:
        raise InvalidInputError(f"page_size must be from 1 to {MAX_PAGE_SIZE}; got {value}.")
    return value


def encode(position: dict[str, Any]) -> str:
    raw = json.dumps(position, separators=(",", ":"), sort_keys=True).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode(cursor: str | None, key: str) -> Any:
    """The ``key`` field of a cursor made by ``encode`` (None for no cursor)."""
    if cursor is None or cursor == "":
        return None
    if not isinstance(cursor, str) or len(cursor) > MAX_CURSOR_LENGTH:
        raise InvalidInputError("cursor is not valid; pass the next_cursor of a previous page.")
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        position = json.loads(base64.urlsafe_b64decode(padded.encode()))
        value = position[key]
    except (binascii.Error, ValueError, KeyError, TypeError):
        raise InvalidInputError(
            "cursor is not valid; pass the next_cursor of a previous page."
        ) from None
    return value
