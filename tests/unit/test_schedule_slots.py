"""A recurring schedule's slot keeps its deduplication key for as long as the slot may be
published: until the next slot, at least a minute and at most thirty days (the scheduler's
publish relies on it once the slot's message is purged, which a topic's retention may do long
before the next slot)."""

from __future__ import annotations

import datetime as dt

import pytest

from workqueue.scheduling import Schedule


@pytest.mark.parametrize(
    ("cron", "window"),
    [
        ("* * * * *", dt.timedelta(minutes=1)),
        ("0 * * * *", dt.timedelta(hours=1)),
        ("0 0 * * 1", dt.timedelta(days=7)),
        ("0 0 1 1 *", dt.timedelta(days=30)),  # a year apart: held to thirty days
    ],
)
def test_a_slots_key_lives_until_the_slot_stops_being_publishable(cron, window):
    """Audit helper-107: a key kept for a minute whatever the schedule went unseen; a weekly
    slot published again once its message was purged."""
    schedule = Schedule(name="s", cron=cron, topic="t")
    # Thirty seconds after a slot of each (a Friday, and the first of a year).
    slot = schedule.latest_slot(dt.datetime(2027, 1, 1, 0, 0, 30, tzinfo=dt.UTC))
    assert slot is not None
    assert slot.deduplication_ttl == window.total_seconds()
