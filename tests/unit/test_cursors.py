"""Cursor encoding: every partition key the publishers accept round-trips within the limit."""

from __future__ import annotations

import pytest

from workqueue.exceptions import InvalidInputError
from workqueue.operators import cursors
from workqueue.publishing import MAX_KEY_LENGTH


@pytest.mark.parametrize(
    "character",
    ["a", "é", "鍵", "😀", '"', "\\", "\x01", "\x1f", "\u2028"],
    ids=["ascii", "2-byte", "3-byte", "4-byte", "quote", "backslash", "control", "unit-sep", "ls"],
)
def test_a_cursor_for_the_longest_key_of_any_character_fits_and_round_trips(character):
    key = character * MAX_KEY_LENGTH

    cursor = cursors.encode({"partition_key": key}, "orders.billing")

    assert len(cursor) <= cursors.MAX_CURSOR_LENGTH
    assert (
        cursors.decode(cursor, "partition_key", max_length=MAX_KEY_LENGTH, listing="orders.billing")
        == key
    )
    with pytest.raises(InvalidInputError):  # another listing's
        cursors.decode(cursor, "partition_key", max_length=MAX_KEY_LENGTH, listing="orders.mail")


def test_the_limit_is_the_longest_cursor_and_no_longer():
    longest = cursors.encode({"partition_key": "\x01" * MAX_KEY_LENGTH}, "a" * 200)

    assert len(longest) == cursors.MAX_CURSOR_LENGTH
    with pytest.raises(InvalidInputError):
        cursors.decode(longest + "A", "partition_key", max_length=MAX_KEY_LENGTH, listing="a" * 200)
