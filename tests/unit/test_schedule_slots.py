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


UTC = dt.UTC


@pytest.mark.parametrize(
    ("zone", "cron", "slot_utc", "now_utc"),
    [
        # New York falls back on 2026-11-01 at 02:00 EDT to 01:00 EST (06:00 UTC): the 01:30
        # slot is 01:30 EDT (05:30 UTC), and at 01:10 EST (06:10 UTC) it is still the latest.
        ("America/New_York", "30 1 * * *", dt.datetime(2026, 11, 1, 5, 30, tzinfo=UTC),
         dt.datetime(2026, 11, 1, 6, 10, tzinfo=UTC)),
        ("America/New_York", "59 1 * * *", dt.datetime(2026, 11, 1, 5, 59, tzinfo=UTC),
         dt.datetime(2026, 11, 1, 6, 45, tzinfo=UTC)),
        # Sydney falls back on 2026-04-05 at 03:00 AEDT to 02:00 AEST (16:00 UTC on the 4th).
        ("Australia/Sydney", "30 2 * * *", dt.datetime(2026, 4, 4, 15, 30, tzinfo=UTC),
         dt.datetime(2026, 4, 4, 16, 10, tzinfo=UTC)),
    ],
)  # fmt: skip
def test_a_slot_in_the_hour_clocks_repeat_stays_publishable_until_the_next(
    zone, cron, slot_utc, now_utc
):
    """Audit helper-130: searched backwards from the repeated hour, the slot of its first pass
    was passed over for the day before's, no longer publishable: no slot for up to an hour,
    published that much late by hosts coming back then, and none shown by `schedules`."""
    schedule = Schedule(name="s", cron=cron, topic="t", timezone=zone)
    assert schedule.latest_slot(slot_utc + dt.timedelta(minutes=1)).at == slot_utc
    assert schedule.next_slot_time(slot_utc) > now_utc

    slot = schedule.latest_slot(now_utc)

    assert slot is not None and slot.at == slot_utc, slot


@pytest.mark.parametrize(
    ("zone", "changes_at"),
    [
        # Falls back 2026-04-05 02:00 +11:00 to 01:30 +10:30: a 30-minute repeat.
        ("Australia/Lord_Howe", dt.datetime(2026, 4, 4, 15, 0, tzinfo=UTC)),
        # Springs forward 2026-10-04 02:00 +10:30 to 02:30 +11:00: a 30-minute gap.
        ("Australia/Lord_Howe", dt.datetime(2026, 10, 3, 15, 30, tzinfo=UTC)),
        ("America/New_York", dt.datetime(2026, 11, 1, 6, 0, tzinfo=UTC)),
        ("America/New_York", dt.datetime(2026, 3, 8, 7, 0, tzinfo=UTC)),
    ],
)
@pytest.mark.parametrize("cron", ["30 * * * *", "*/15 * * * *", "30 1 * * *", "45 1-3 * * *"])
def test_the_next_slot_told_is_the_next_slot_published_across_dst_changes(zone, cron, changes_at):
    """Review helper-188: `workqueue schedules` (and the W009 check of gaps) found the next
    slot by cronsim's forward search, which passes over the slot of Lord Howe's half hour
    (01:30 the night clocks go back, 02:30 the night they go forward) that ``latest_slot``
    publishes, and, started in New York's repeated hour, answered a slot before its start.
    Every minute from four hours before the change to four after: the next slot told is the
    next one published."""
    schedule = Schedule(name="s", cron=cron, topic="t", timezone=zone)
    minutes = [changes_at + dt.timedelta(minutes=m) for m in range(-240, 24 * 60 + 241)]
    published = sorted({slot.at for t in minutes if (slot := schedule.latest_slot(t))})
    for now in minutes[:481]:
        following = next(at for at in published if at > now)
        assert schedule.next_slot_time(now) == following, now
