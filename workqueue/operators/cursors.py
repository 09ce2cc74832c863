"""Keyset cursors and page-size rules for operator listings.

A cursor is opaque to callers: unpadded base64url of the UTF-8 JSON object ``{field: value}``
naming the last row of the previous page. UTF-8 rather than JSON's ASCII ``\\u`` escapes keeps
cursors compact (a 200-character key of 4-byte characters is 800 bytes instead of 2,400). What
comes back is untrusted: :func:`decode` accepts only a string of the expected size in the
expected field, so a crafted cursor is a clear ``InvalidInputError`` (400), never a query on a
number, an object, a NUL or a lone surrogate.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from workqueue.exceptions import InvalidInputError
from workqueue.publishing import MAX_KEY_LENGTH

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 500
_INVALID = "cursor is not valid; pass the next_cursor of a previous page."


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


def encode(position: dict[str, str], listing: str) -> str:
    """A cursor for ``position`` in ``listing`` (what was listed: a subscription's name), so
    that one from another listing is refused rather than read as a place in this one."""
    raw = json.dumps(
        {**position, LISTING: listing}, ensure_ascii=False, separators=(",", ":"), sort_keys=True
    )
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


LISTING = "of"
# The longest cursor made for the longest partition key of the longest listing name: a control
# character is the longest character in JSON (a 6-byte \u00XX escape; any other takes at most 4
# bytes of UTF-8), and names are 200 characters of ASCII at most.
MAX_CURSOR_LENGTH = len(encode({"partition_key": "\x01" * MAX_KEY_LENGTH}, "a" * 200))


def decode(cursor: str | None, field: str, *, max_length: int, listing: str) -> str | None:
    """The ``field`` of a cursor made by :func:`encode` for ``listing``, or None for no cursor.

    The value is a string of 1 to ``max_length`` characters without NUL that encodes as UTF-8;
    anything else, or a cursor of another listing, raises ``InvalidInputError``.
    """
    if cursor is None or cursor == "":
        return None
    if not isinstance(cursor, str) or len(cursor) > MAX_CURSOR_LENGTH:
        raise InvalidInputError(_INVALID)
    try:
        padded = cursor.encode("ascii") + b"=" * (-len(cursor) % 4)
        # validate=True: characters outside the alphabet are an error, not silently skipped.
        position = json.loads(base64.b64decode(padded, altchars=b"-_", validate=True))
        value = position[field]
        of = position[LISTING]
    except (UnicodeError, binascii.Error, ValueError, KeyError, TypeError, RecursionError):
        # RecursionError: a cursor of a thousand nested brackets fits in its length.
        raise InvalidInputError(_INVALID) from None
    if of != listing:
        raise InvalidInputError(_INVALID)
    if not isinstance(value, str) or not 1 <= len(value) <= max_length or "\x00" in value:
        raise InvalidInputError(_INVALID)
    try:
        value.encode()
    except UnicodeEncodeError:  # a lone surrogate from a \ud800 escape
        raise InvalidInputError(_INVALID) from None
    return value
