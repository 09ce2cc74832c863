"""The claim-check reference (``payload_ref``): one stored shape, whatever the caller's spelling.

A message carries either a payload or a reference to one kept elsewhere (an object store, a
file share): ``{"uri": ..., "content_type": ..., "size_bytes": ..., "checksum": ...}``, where
only ``uri`` is required. Callers spell keys their own way (the REST API's ``contentType``, the
reference system's ``ContentType``, Python's ``content_type``); the queue stores, and handlers
receive, the snake_case keys above. Pure Python: no Django.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["PAYLOAD_REF_KEYS", "PayloadRefError", "canonical_payload_ref", "stored_payload_ref"]

#: The stored keys, in the order they are stored.
PAYLOAD_REF_KEYS = ("uri", "content_type", "size_bytes", "checksum")

_SHAPE = "an object {uri, content_type?, size_bytes?, checksum?}"
# Spellings are told apart by letters alone: contentType, content_type, ContentType, content-type.
_SEPARATORS = re.compile(r"[_\-\s]")
_BY_LETTERS = {key.replace("_", ""): key for key in PAYLOAD_REF_KEYS}


class PayloadRefError(ValueError):
    """A claim-check reference that cannot be stored; the message names the key and the fix."""


def _stored_key(key: object) -> str | None:
    if not isinstance(key, str):
        return None
    return _BY_LETTERS.get(_SEPARATORS.sub("", key).lower())


def canonical_payload_ref(raw: object) -> dict[str, Any]:
    """Validate a reference as a caller gave it and return it with the stored keys.

    A key given as ``None`` counts as absent. Raises :class:`PayloadRefError` for anything
    else that is not an object with a non-empty string ``uri``, an optional non-empty string
    ``content_type`` and ``checksum`` and a whole number ``size_bytes`` of 0 or more, each key
    given once in any spelling.
    """
    if not isinstance(raw, Mapping):
        raise PayloadRefError(f"payload_ref must be {_SHAPE}.")
    given: dict[str, tuple[str, Any]] = {}
    for key, value in raw.items():
        stored = _stored_key(key)
        if stored is None:
            raise PayloadRefError(
                f"payload_ref has an unknown key {key!r} (allowed: {', '.join(PAYLOAD_REF_KEYS)}, "
                "in snake_case, camelCase or PascalCase)."
            )
        if stored in given:
            raise PayloadRefError(
                f"payload_ref gives {stored} twice ({given[stored][0]!r} and {key!r}); keep one."
            )
        given[stored] = (key, value)
    values = {stored: value for stored, (_, value) in given.items() if value is not None}
    if "uri" not in values:
        raise PayloadRefError("payload_ref needs a 'uri' naming where the payload is kept.")
    for key in ("uri", "content_type", "checksum"):
        value = values.get(key)
        if key in values and (not isinstance(value, str) or not value.strip()):
            raise PayloadRefError(f"payload_ref.{key} must be a non-empty string.")
    size = values.get("size_bytes")
    if "size_bytes" in values and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
        raise PayloadRefError(
            f"payload_ref.size_bytes must be a whole number of bytes (0 or more), got {size!r}."
        )
    return {key: values[key] for key in PAYLOAD_REF_KEYS if key in values}


def stored_payload_ref(stored: Any) -> Any:
    """A reference as read back, with the stored keys: rows published before references were
    stored in one shape (the REST API kept ``contentType``) reach handlers like new ones."""
    if not isinstance(stored, Mapping):
        return stored
    return {_stored_key(key) or key: value for key, value in stored.items()}
