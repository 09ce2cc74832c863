"""Recurring schedules where tests/runtime/test_scheduler.py does not look (attack review
helper-201; every case failed before its fix): a zone change cronsim's search never gets past,
six-field expressions, a machine-local zone, passes exactly one gap apart, and an outage taken
for a missing migration."""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import OperationalError, connections

from tests.factories import SubscriptionFactory, TopicFactory
from workqueue.checks import check_settings
from workqueue.exceptions import WorkQueueConfigurationError
from workqueue.models import Message, ScheduleRecord
from workqueue.runtime.scheduler import Scheduler
from workqueue.scheduling import load_schedules

pytestmark = pytest.mark.usefixtures("queue_db")

# 2026-04-05 03:15:00.5 in Pacific/Chatham (+13:45), half an hour before its clocks go back to
# 02:45 (+12:45): an off-the-hour change, around which cronsim 2.8's backward search for an
# hour field like */2 never ended.
BEFORE_CHATHAM_FALLS_BACK = dt.datetime(2026, 4, 4, 13, 30, 0, 500000, tzinfo=dt.UTC)
CHATHAM = {"name": "chatham", "cron": "0 */2 * * *", "timezone": "Pacific/Chatham"}


def _topic() -> str:
    topic = TopicFactory()
    SubscriptionFactory(topic=topic)
    return topic.name


def _returns_within(function: Callable[[], Any], seconds: float) -> bool:
    """Whether ``function`` returns (or raises) within ``seconds``; a search that never ends
    is left spinning on a daemon thread."""
    thread = threading.Thread(target=lambda: _swallow(function), daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


def _swallow(function: Callable[[], Any]) -> None:
    try:
        with contextlib.suppress(Exception):
            function()
    finally:
        connections.close_all()  # the thread's own, or the test database outlives the run


def test_a_schedule_whose_slot_search_never_ends_keeps_no_other_from_publishing(caplog):
    """The pass never returned: every schedule of every host stopped with it."""
    topic = _topic()
    entries = [
        {**CHATHAM, "topic": topic},
        {"name": "hourly", "cron": "0 * * * *", "topic": topic},
    ]
    scheduler = Scheduler(load_schedules(entries), clock=lambda: BEFORE_CHATHAM_FALLS_BACK)
    outcome: list[Any] = []

    assert _returns_within(lambda: outcome.append(scheduler.run_once()), 30)
    assert outcome[0].refused == {"chatham": "Error"}
    assert Message.objects.filter(topic__name=topic).count() == 1  # the hourly slot
    assert "cronsim's search for a slot did not end" in caplog.text


def test_the_check_and_the_schedules_verb_name_a_search_that_never_ends(settings, monkeypatch):
    """`manage.py check` (W009 works out the next 200 slots) and `workqueue schedules` hung."""
    from workqueue.driver.base import BaseDriver

    [schedule] = load_schedules([{**CHATHAM, "topic": "t"}])
    assert _returns_within(lambda: schedule.shortest_gap(BEFORE_CHATHAM_FALLS_BACK), 30)

    settings.WORKQUEUE = {**settings.WORKQUEUE, "SCHEDULES": [{**CHATHAM, "topic": "t"}]}
    found: list[Any] = []
    assert _returns_within(lambda: found.extend(check_settings(None)), 60)
    # Hangs only within days of the change; anywhere else the check simply passes.
    assert all(w.id != "workqueue.W009" or "did not end" in w.msg for w in found)

    monkeypatch.setattr(BaseDriver, "database_now", lambda self: BEFORE_CHATHAM_FALLS_BACK)
    refused: list[str] = []

    def listed() -> None:
        try:
            call_command("workqueue", "schedules", stdout=io.StringIO())
        except CommandError as exc:
            refused.append(str(exc))

    assert _returns_within(listed, 30)
    assert refused and "did not end near a time zone change" in refused[0]


@pytest.mark.parametrize("cron", ["0 30 1 * * *", "0 30 2 * * *"])
def test_a_six_field_cron_is_refused(cron):
    """cronsim read the seconds field and dropped its DST rules: '0 30 1 * * *' ran twice the
    night New York's clocks went back, '0 30 2 * * *' not at all the night they went forward."""
    entry = {"name": "nightly", "cron": cron, "topic": "t", "timezone": "America/New_York"}
    with pytest.raises(WorkQueueConfigurationError, match=r"six fields; .* use five fields"):
        load_schedules([entry])


@pytest.mark.parametrize("zone", ["localtime", "posixrules", "posix/Europe/Amsterdam"])
def test_a_zone_that_is_each_machines_own_setting_is_refused(zone, settings):
    """'localtime' loads (Debian's tzdata links it to /etc/localtime) as each host's own zone:
    two hosts set to different zones each published their own 03:00."""
    entries = [{"name": "nightly", "cron": "0 3 * * *", "topic": "t", "timezone": zone}]
    with pytest.raises(WorkQueueConfigurationError, match="is not an IANA time zone name"):
        load_schedules(entries)
    settings.WORKQUEUE = {**settings.WORKQUEUE, "SCHEDULES": entries}
    assert "workqueue.E005" in [e.id for e in check_settings(None)]


def test_passes_exactly_a_schedules_gap_apart_are_warned_of(settings):
    """Each pass starts an interval after the last one ended, so passes an interval apart
    drift later by their own length and now and then skip a slot for good; W009 warned only
    of a shorter gap."""
    entries = [{"name": "minutely", "cron": "* * * * *", "topic": "t"}]
    settings.WORKQUEUE = {
        **settings.WORKQUEUE,
        "SCHEDULES": entries,
        "SCHEDULER_INTERVAL_MS": 60_000,
    }
    assert "workqueue.W009" in [e.id for e in check_settings(None)]
    # What it warns of: passes 60.05 s apart (the interval, then the pass) skip a slot a day.
    [schedule] = load_schedules(entries)
    start = dt.datetime(2026, 7, 1, 10, 0, 30, tzinfo=dt.UTC)
    passes = [start + k * dt.timedelta(seconds=60.05) for k in range(24 * 60)]
    published = {slot.at for now in passes if (slot := schedule.latest_slot(now))}
    minutes = {start.replace(second=0) + dt.timedelta(minutes=m) for m in range(24 * 60)}
    assert minutes - published


def test_a_database_outage_is_not_told_as_a_missing_migration_or_grant(monkeypatch, caplog):
    class Away:
        def __getattr__(self, name: str) -> Any:
            def fail(*args: Any, **kwargs: Any) -> Any:
                raise OperationalError(
                    'connection to server at "db" (10.0.0.5), port 5432 failed: server closed '
                    "the connection unexpectedly"
                )

            return fail

    monkeypatch.setattr(ScheduleRecord.objects, "using", lambda alias: Away())
    topic = _topic()
    scheduler = Scheduler(
        load_schedules([{"name": "hourly", "cron": "0 * * * *", "topic": topic}]),
        clock=lambda: dt.datetime(2026, 7, 1, 1, 0, 5, tzinfo=dt.UTC),
    )
    with caplog.at_level(logging.WARNING, logger="workqueue.runtime.scheduler"):
        scheduler.run_once()

    assert "the database is away" in caplog.text
    assert "manage.py migrate" not in caplog.text
