"""Ids the application chooses for the rows it asks the queue to create, and the test of text
that should hold one."""

from __future__ import annotations

import os
import time
import uuid


def new_message_id() -> str:
    """A new message id: a time-ordered UUID (version 7: 48 bits of Unix time in milliseconds,
    then 74 random bits) in canonical text.

    Ids of messages published together sort together, so each publish adds its entries to the
    right-hand edge of the message and delivery indexes keyed by message id, pages already in
    memory, instead of to a random page of ever larger indexes (a random page read, and after
    each checkpoint a full-page image in the WAL). Built from bytes: a UUID object is not
    needed only to be formatted.
    """
    return _formatted(bytearray(os.urandom(16)), _clock())


def new_message_ids(count: int) -> list[str]:
    """``count`` ids as ``new_message_id`` makes them, from one read of the clock and one of the
    system's randomness: a batch's ids pay for one system call instead of one each (about half
    a microsecond an id), and share their millisecond."""
    randomness, clock = os.urandom(16 * count), _clock()
    return [
        _formatted(bytearray(randomness[at : at + 16]), clock) for at in range(0, 16 * count, 16)
    ]


def _clock() -> bytes:
    return (time.time_ns() // 1_000_000).to_bytes(6, "big")


def _formatted(octets: bytearray, clock: bytes) -> str:
    """16 random ``octets`` made a version 7 id of ``clock`` (6 bytes of Unix milliseconds)."""
    octets[:6] = clock
    octets[6] = (octets[6] & 0x0F) | 0x70  # version 7
    octets[8] = (octets[8] & 0x3F) | 0x80  # RFC 9562 variant
    text = octets.hex()
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def is_uuid(value: object) -> bool:
    """Whether ``value`` reads as a UUID: text that reached this process from outside (a
    notification's payload, a cloud queue's message body) before it is taken for an id."""
    try:
        uuid.UUID(str(value))
    except ValueError:
        return False
    return True
