"""Recurring publish: every host runs the scheduler, each slot is published once across all of
them, and after downtime only the latest missed slot is. Schedulers run on real threads against
PostgreSQL with a clock the test controls; a last test runs them inside two real hosts on the
database clock."""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections

from tests.factories import SubscriptionFactory, TopicFactory
from tests.support.waiting import wait_until
from workqueue import publish
from workqueue.checks import check_settings
from workqueue.driver import get_driver
from workqueue.exceptions import WorkQueueConfigurationError
from workqueue.models import Delivery, Message
from workqueue.runtime.host import Host, HostConfig
from workqueue.runtime.scheduler import Scheduler
from workqueue.runtime.sweeper import Sweeper
from workqueue.scheduling import load_schedules
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")

UTC = dt.UTC


class Clock:
    """A clock the test sets; every scheduler sharing it sees the same time."""

    def __init__(self, now: dt.datetime) -> None:
        self.now = now

    def __call__(self) -> dt.datetime:
        return self.now


def schedule(topic: str, cron: str, **extra: Any) -> dict[str, Any]:
    return {"name": "report", "cron": cron, "topic": topic, **extra}


def published(topic_name: str) -> int:
    return Message.objects.filter(topic__name=topic_name).count()


def run_together(schedulers: list[Scheduler]) -> list[Any]:
    """Run one pass of every scheduler at the same moment, each on its own thread (and so its
    own database connection), as separate hosts would."""
    barrier = threading.Barrier(len(schedulers))
    results: list[Any] = [None] * len(schedulers)

    def run(index: int) -> None:
        try:
            barrier.wait()
            results[index] = schedulers[index].run_once()
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(schedulers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    get_driver().close_all()
    return results


@pytest.fixture
def topic_name() -> str:
    topic = TopicFactory()
    SubscriptionFactory(topic=topic)
    return topic.name


def test_two_hosts_publish_each_slot_exactly_once(topic_name):
    clock = Clock(dt.datetime(2026, 5, 4, 9, 0, 20, tzinfo=UTC))
    entries = [schedule(topic_name, "* * * * *")]
    hosts = [Scheduler(load_schedules(entries), clock=clock) for _ in range(2)]

    for minute in range(12):
        clock.now = dt.datetime(2026, 5, 4, 9, minute, 20, tzinfo=UTC)
        results = run_together(hosts)
        # One host published the slot; the other found it published (or being published).
        assert sorted(len(r.published) for r in results) == [0, 1], results
        # Another pass in the same minute publishes nothing more.
        assert [r.published for r in run_together(hosts)] == [{}, {}]
        assert published(topic_name) == minute + 1


def test_a_slot_whose_key_another_publisher_holds_is_reported_not_taken_for_published(
    topic_name, caplog
):
    """A Duplicate naming a message of some other publisher (not the slot's own id) was read
    as another host's publish: the slot was silently never published."""
    clock = Clock(dt.datetime(2026, 7, 2, 1, 0, 5, tzinfo=UTC))
    scheduler = Scheduler(load_schedules([schedule(topic_name, "0 1 * * *")]), clock=clock)
    slot_key = "wq.schedule:report:2026-07-02T01:00:00+00:00"
    squatter = publish(topic_name, {"not": "the report"}, deduplication_key=slot_key)

    with caplog.at_level(logging.ERROR, logger="workqueue.runtime.scheduler"):
        result = scheduler.run_once()

    assert result.published == {}
    assert f"its deduplication key is held by message {squatter.message_id}" in caplog.text
    assert "report slot 2026-07-02T01:00:00+00:00 was not published" in caplog.text


@pytest.mark.parametrize("where", ["another topic", "the schedule's topic"])
def test_a_publisher_who_knows_the_schedule_cannot_take_its_slot_first(topic_name, where):
    """Audit helper-88: a slot's message id was uuid5 of its deduplication key in a namespace
    the package publishes, so an API key that may publish to any topic could publish the next
    slots' ids first: on another topic the scheduler's publish was refused (MessageIDConflict,
    the slot never ran); on the schedule's own topic, with the same payload and a due time days
    away, the scheduler took the squatter's message for its slot (a Duplicate, nothing
    logged). Slot ids are keyed with SECRET_KEY now."""
    other = TopicFactory()
    SubscriptionFactory(topic=other)
    slot_key = "wq.schedule:report:2026-07-02T01:00:00+00:00"
    guessed = str(uuid.uuid5(uuid.UUID("7b0c2f5e-4f1a-4c55-9d0e-2f6c3d1a9b80"), slot_key))
    squatted_topic = other.name if where == "another topic" else topic_name
    squat = publish(
        squatted_topic,
        {"run": "report"},
        message_id=guessed,
        not_before=dt.datetime.now(UTC) + dt.timedelta(days=6),
    )
    assert squat.status == "Accepted"
    clock = Clock(dt.datetime(2026, 7, 2, 1, 0, 5, tzinfo=UTC))
    entries = [schedule(topic_name, "0 1 * * *", payload={"run": "report"})]

    result = Scheduler(load_schedules(entries), clock=clock).run_once()

    assert result.published == {"report": dt.datetime(2026, 7, 2, 1, 0, tzinfo=UTC)}
    slot = Message.objects.filter(topic__name=topic_name).exclude(pk=guessed).get()
    assert Delivery.objects.get(message=slot).visible_at <= dt.datetime.now(UTC)


@pytest.mark.parametrize("publisher", ["a host without the rotated key", "an earlier release"])
def test_a_slot_another_host_of_the_deployment_published_under_its_id_counts_as_published(
    topic_name, settings, caplog, capsys, publisher
):
    """Slot ids are keyed with SECRET_KEY, so hosts whose keys differ give a slot different
    ids: during a key rotation (the old key in SECRET_KEY_FALLBACKS) and a rolling upgrade from
    a release whose ids were unkeyed, a slot published under the other id is the slot's own
    publish, not a squatter's (review helper-90: an ERROR each pass until the next slot, and
    `workqueue schedules` saying unpublished)."""
    entries = [schedule(topic_name, "0 * * * *")]  # hourly: one slot while the test runs
    settings.WORKQUEUE = {**settings.WORKQUEUE, "SCHEDULES": entries}
    now = get_driver().database_now()
    [current] = load_schedules(entries)
    settings.SECRET_KEY = "the key before the rotation " * 3
    before = current.latest_slot(now)
    settings.SECRET_KEY = "the key after the rotation " * 3
    if publisher == "an earlier release":
        other_id = before.other_message_ids[-1]  # unkeyed: the same under any key
    else:
        settings.SECRET_KEY_FALLBACKS = ["the key before the rotation " * 3]
        other_id = before.message_id
    slot = current.latest_slot(now)
    assert slot.message_id != other_id
    publish(
        topic_name,
        None,
        message_id=other_id,
        deduplication_key=slot.deduplication_key,
        deduplication_ttl=slot.deduplication_ttl,
    )

    with caplog.at_level(logging.ERROR, logger="workqueue.runtime.scheduler"):
        result = Scheduler([current]).run_once()
    call_command("workqueue", "schedules", "--json")

    assert (result.published, result.duplicates) == ({}, {"report": slot.at})
    assert caplog.text == ""
    assert json.loads(capsys.readouterr().out)[0]["published"] is True


def test_after_downtime_only_the_latest_missed_slot_is_published(topic_name):
    clock = Clock(dt.datetime(2026, 5, 4, 10, 0, 30, tzinfo=UTC))
    scheduler = Scheduler(load_schedules([schedule(topic_name, "*/5 * * * *")]), clock=clock)

    assert scheduler.run_once().published == {"report": clock.now.replace(second=0)}
    clock.now = dt.datetime(2026, 5, 4, 10, 27, tzinfo=UTC)  # 10:05 ... 10:25 were missed
    assert scheduler.run_once().published == {"report": dt.datetime(2026, 5, 4, 10, 25, tzinfo=UTC)}
    clock.now = dt.datetime(2026, 5, 4, 10, 29, 59, tzinfo=UTC)
    assert scheduler.run_once().duplicates == {
        "report": dt.datetime(2026, 5, 4, 10, 25, tzinfo=UTC)
    }

    assert published(topic_name) == 2


def test_a_slot_missed_for_longer_than_thirty_days_is_skipped(topic_name):
    # Once a year: the slot of 1 January is publishable for 30 days, then never.
    clock = Clock(dt.datetime(2026, 2, 1, 0, 0, 1, tzinfo=UTC))
    scheduler = Scheduler(load_schedules([schedule(topic_name, "0 0 1 1 *")]), clock=clock)

    assert scheduler.run_once().published == {}
    clock.now = dt.datetime(2026, 1, 30, 23, 59, tzinfo=UTC)
    assert scheduler.run_once().published == {"report": dt.datetime(2026, 1, 1, tzinfo=UTC)}


def test_slots_follow_the_schedules_time_zone_and_carry_its_message(topic_name):
    topic = TopicFactory()
    subscription = SubscriptionFactory(topic=topic, partition_mode="Exclusive")
    entry = schedule(
        topic.name,
        "0 3 * * *",
        timezone="Europe/Amsterdam",
        payload={"report": "daily"},
        partition_key="reports",
        attributes={"kind": "daily"},
        priority=7,
    )
    # 03:30 in Amsterdam in summer (CEST, UTC+2): the slot is 03:00 local, 01:00 UTC.
    clock = Clock(dt.datetime(2026, 7, 1, 1, 30, tzinfo=UTC))

    result = Scheduler(load_schedules([entry]), clock=clock).run_once()

    assert result.published == {"report": dt.datetime(2026, 7, 1, 1, 0, tzinfo=UTC)}
    delivery = Delivery.objects.select_related("message").get(subscription=subscription)
    assert delivery.message.payload == {"report": "daily"}
    assert delivery.message.attributes == {"kind": "daily"}
    assert (delivery.partition_key, delivery.priority) == ("reports", 7)


def test_a_slot_stays_publishable_until_the_next_across_a_dst_change(topic_name):
    """The gap between slots was counted on the wall clock: on the night New York falls back,
    01:00 EDT to 01:00 EST is an hour, but counted as none (so 60 s): a host restarting
    through that minute never published the 01:00 EDT slot."""
    clock = Clock(dt.datetime(2025, 11, 2, 5, 30, tzinfo=UTC))  # 01:30 EDT, the first 01:30
    entry = schedule(topic_name, "0 * * * *", timezone="America/New_York")

    result = Scheduler(load_schedules([entry]), clock=clock).run_once()

    assert result.published == {"report": dt.datetime(2025, 11, 2, 5, 0, tzinfo=UTC)}
    assert published(topic_name) == 1


def test_a_schedule_of_a_task_enqueues_it_once_a_slot_and_its_result_reads_by_the_slots_id():
    """There was no way to run a Tasks API task on a schedule but to publish the task's
    internal message by hand (helper-120). Its queue need not exist yet."""
    from workqueue.tasks.api import default_task_backend
    from workqueue.testing import run_until_idle

    get_user_model().objects.create_user("workqueue-system")
    entries = [
        {
            "name": "sums",
            "cron": "0 * * * *",
            "task": "tests.task_functions.add",
            "args": [1, 2],
            "priority": 7,
        }
    ]
    clock = Clock(dt.datetime(2026, 7, 1, 1, 30, tzinfo=UTC))
    first = Scheduler(load_schedules(entries), clock=clock).run_once()
    again = Scheduler(load_schedules(entries), clock=clock).run_once()  # another host

    assert first.published == {"sums": dt.datetime(2026, 7, 1, 1, 0, tzinfo=UTC)}
    assert again.duplicates == first.published
    [message] = Message.objects.filter(topic__name="tasks.default")
    [run] = run_until_idle("tasks.default")
    result = default_task_backend.get_result(str(message.id))
    assert (run.status, result.status, result.return_value) == ("Completed", "SUCCESSFUL", 3)
    # The priority it ran at is the one its result reports (review helper-121).
    assert Delivery.objects.get(message=message).priority == result.task.priority == 7


def test_a_schedule_of_a_task_whose_queue_takes_no_delivery_is_reported_not_counted_done(caplog):
    """Published to a queue whose subscription is Disabled, the slot read as published while
    the task would never run (review helper-121)."""
    from workqueue.models import Subscription
    from workqueue.tasks.api import default_task_backend

    default_task_backend.ensure_queue("default")
    Subscription.objects.filter(name="tasks.default").update(status="Disabled")
    entries = [{"name": "sums", "cron": "0 * * * *", "task": "tests.task_functions.add"}]
    clock = Clock(dt.datetime(2026, 7, 1, 1, 30, tzinfo=UTC))

    with caplog.at_level(logging.ERROR, logger="workqueue.runtime.scheduler"):
        result = Scheduler(load_schedules(entries), clock=clock).run_once()

    assert (result.published, result.refused) == ({}, {"sums": "NoSubscription"})
    assert "subscription tasks.default is Disabled" in caplog.text


def test_a_task_slot_refused_for_a_disabled_queue_runs_once_the_queue_is_enabled(settings, capsys):
    """Review helper-188: `schedules --publish` said "Not published: sums (NoSubscription)
    ... the next run tries again", but the slot's message had been stored (with no delivery)
    and its key taken: the next run was a Duplicate, exited 0 and showed the slot published,
    and once the operator enabled the subscription, that slot's task never ran."""
    from workqueue.models import Subscription
    from workqueue.tasks.api import default_task_backend

    get_user_model().objects.create_user("workqueue-system")
    default_task_backend.ensure_queue("default")
    Subscription.objects.filter(name="tasks.default").update(status="Disabled")
    entries = [{"name": "sums", "cron": "0 * * * *", "task": "tests.task_functions.add"}]
    settings.WORKQUEUE = {**settings.WORKQUEUE, "SCHEDULES": entries}

    with pytest.raises(CommandError, match="the next run tries again"):
        call_command("workqueue", "schedules", "--publish", "--json")
    [refused] = json.loads(capsys.readouterr().out)
    Subscription.objects.filter(name="tasks.default").update(status="Active")  # the fix
    call_command("workqueue", "schedules", "--publish", "--json")
    [published_row] = json.loads(capsys.readouterr().out)

    assert (refused["published"], published_row["published"]) == (False, True)
    assert Delivery.objects.filter(subscription__name="tasks.default").count() == 1


def test_a_schedule_whose_zone_is_fixed_after_its_slot_ran_does_not_run_again_that_day():
    """Review helper-188: a nightly 03:00 in UTC ran at 03:00 UTC; at 03:30 an operator deploys
    the zone meant (Europe/Amsterdam): the day's 03:00 Amsterdam slot (01:00 UTC) is still
    publishable, under another key, and was published at once: the nightly job ran twice. A
    schedule's slots are published in time order, whatever its definition became."""
    topic = TopicFactory()
    SubscriptionFactory(topic=topic)
    clock = Clock(dt.datetime(2026, 7, 1, 3, 0, 5, tzinfo=UTC))
    before = Scheduler(load_schedules([schedule(topic.name, "0 3 * * *")]), clock=clock)
    assert before.run_once().published == {"report": dt.datetime(2026, 7, 1, 3, 0, tzinfo=UTC)}

    clock.now = dt.datetime(2026, 7, 1, 3, 30, tzinfo=UTC)
    entries = [schedule(topic.name, "0 3 * * *", timezone="Europe/Amsterdam")]
    after = Scheduler(load_schedules(entries), clock=clock)
    fixed = after.run_once()
    clock.now = dt.datetime(2026, 7, 2, 1, 0, 5, tzinfo=UTC)  # the next night, 03:00 there
    next_night = after.run_once()

    assert (fixed.published, fixed.duplicates) == (
        {},
        {"report": dt.datetime(2026, 7, 1, 1, 0, tzinfo=UTC)},
    )
    assert next_night.published == {"report": dt.datetime(2026, 7, 2, 1, 0, tzinfo=UTC)}
    assert published(topic.name) == 2


def test_a_hosts_runtime_role_records_the_slots_its_scheduler_publishes(pg_conn, caplog):
    """The record that keeps a schedule's slots in time order is written by the host's
    scheduler as the role ``grant-runtime`` gives: without the grant every pass would warn and
    the record would stay empty."""
    from tests.support.roles import acting_as_granted_role
    from workqueue.models import ScheduleRecord

    topic = TopicFactory()
    SubscriptionFactory(topic=topic)
    clock = Clock(dt.datetime(2026, 7, 1, 3, 0, 5, tzinfo=UTC))
    with (
        caplog.at_level(logging.WARNING, logger="workqueue.runtime.scheduler"),
        acting_as_granted_role(pg_conn, "wq_sched", "grant-runtime"),
    ):
        result = Scheduler(load_schedules([schedule(topic.name, "0 3 * * *")]), clock=clock)
        assert result.run_once().published == {"report": dt.datetime(2026, 7, 1, 3, tzinfo=UTC)}

    assert caplog.text == ""
    record = ScheduleRecord.objects.get(name="report")
    assert record.last_slot == "2026-07-01T03:00:00+00:00"


def test_a_schedules_record_reads_back_the_same_without_use_tz(settings, topic_name):
    """Review helper-189: kept in a datetime column, the latest slot read back naive with
    ``USE_TZ = False`` (which PostgreSQL deployments may run with), and comparing it with the
    next slot raised: every pass refused the schedule from its second slot on."""
    settings.USE_TZ = False
    clock = Clock(dt.datetime(2026, 7, 1, 1, 0, 5, tzinfo=UTC))
    scheduler = Scheduler(load_schedules([schedule(topic_name, "0 * * * *")]), clock=clock)
    first = scheduler.run_once()
    clock.now = dt.datetime(2026, 7, 1, 2, 0, 5, tzinfo=UTC)
    second = scheduler.run_once()

    assert (first.refused, second.refused) == ({}, {})
    assert second.published == {"report": dt.datetime(2026, 7, 1, 2, tzinfo=UTC)}


@pytest.mark.parametrize("edited", ["yesterday", "2026-07-01T00:00:00"])
def test_a_schedule_record_edited_into_no_time_is_warned_of_not_a_failed_pass(
    settings, topic_name, caplog, capsys, edited
):
    """A record whose slot an operator edited into something that is not a time, or a time
    without its offset (review helper-191): read as a time, it failed every pass (and
    `workqueue schedules`)."""
    from workqueue.models import ScheduleRecord

    ScheduleRecord.objects.create(name="report", last_slot=edited, definition="x")
    entries = [schedule(topic_name, "0 * * * *")]
    settings.WORKQUEUE = {**settings.WORKQUEUE, "SCHEDULES": entries}
    clock = Clock(dt.datetime(2026, 7, 1, 1, 0, 5, tzinfo=UTC))

    with caplog.at_level(logging.WARNING, logger="workqueue.runtime.scheduler"):
        result = Scheduler(load_schedules(entries), clock=clock).run_once()
    call_command("workqueue", "schedules", "--json")

    assert result.published == {"report": dt.datetime(2026, 7, 1, 1, tzinfo=UTC)}
    assert f"holds {edited!r}, not a slot time" in caplog.text
    assert json.loads(capsys.readouterr().out)[0]["name"] == "report"
    assert ScheduleRecord.objects.get(name="report").last_slot == "2026-07-01T01:00:00+00:00"


def test_a_record_ahead_of_the_clock_is_named_with_its_fix_not_as_a_changed_definition(
    settings, topic_name, caplog, capsys
):
    """A record whose slot lies ahead of the database clock (a clock set back after running
    ahead) keeps the schedule from publishing until then. The scheduler said at each slot that
    the schedule's definition had changed, and `workqueue schedules` showed each skipped slot
    as published, under an id no message had: an operator looked for a deploy that never
    happened. The warning names the record and how to clear it; the command says skipped."""
    from workqueue.models import ScheduleRecord

    entries = [schedule(topic_name, "0 * * * *")]
    settings.WORKQUEUE = {**settings.WORKQUEUE, "SCHEDULES": entries}
    [report] = load_schedules(entries)
    ahead = (get_driver().database_now() + dt.timedelta(days=2)).replace(minute=0, second=0)
    ScheduleRecord.objects.create(
        name="report", last_slot=ahead.replace(microsecond=0).isoformat(), definition=report.digest
    )

    with caplog.at_level(logging.WARNING, logger="workqueue.runtime.scheduler"):
        skipped = Scheduler(load_schedules(entries)).run_once()
    call_command("workqueue", "schedules", "--json")
    [row] = json.loads(capsys.readouterr().out)
    call_command("workqueue", "schedules")
    shown = capsys.readouterr().out

    assert (skipped.published, published(topic_name)) == ({}, 0)
    assert "later than the database clock" in caplog.text, caplog.text
    assert "DELETE FROM workqueue_schedulerecord WHERE name = 'report'" in caplog.text
    assert "definition changed" not in caplog.text
    assert (row["published"], row["message_id"]) == (False, None), row
    assert "later than the database clock" in row["skipped"]
    assert "report: skipped: its record holds slot" in shown
    ScheduleRecord.objects.filter(name="report").delete()  # the fix the warning names
    assert Scheduler(load_schedules(entries)).run_once().published


def test_schedules_shows_a_slot_skipped_for_a_later_one_as_skipped_with_no_message_id(
    settings, topic_name, capsys
):
    """A slot before the latest one its schedule published (under an earlier zone or cron) is
    never published; `workqueue schedules` said "yes" and gave the id it would have had, so a
    caller of `get_result` with that id found nothing."""
    from workqueue.models import ScheduleRecord

    entries = [schedule(topic_name, "0 0 * * *")]
    settings.WORKQUEUE = {**settings.WORKQUEUE, "SCHEDULES": entries}
    [report] = load_schedules(entries)
    now = get_driver().database_now()
    slot = report.latest_slot(now)
    if (now - slot.at).total_seconds() < 2:  # a later slot recorded must not lie ahead
        time.sleep(2)
    later = slot.at + dt.timedelta(seconds=1)
    ScheduleRecord.objects.create(name="report", last_slot=later.isoformat(), definition="old")

    call_command("workqueue", "schedules", "--json")
    [row] = json.loads(capsys.readouterr().out)

    assert (row["published"], row["message_id"]) == (False, None), row
    assert row["skipped"].startswith("a later slot"), row


def test_records_that_cannot_be_read_are_warned_of_once_until_they_can_be_again(
    monkeypatch, topic_name, caplog
):
    """The warning that the schedules' records cannot be read (a grant missing) was said once
    per process: after the grant came back and went again, a host that had warned once said
    nothing the second time."""
    from django.db import DatabaseError

    from workqueue.models import ScheduleRecord

    manager = ScheduleRecord.objects
    reading = manager.using

    class Refusing:
        """Every query of the records refused, as for a role without their grant."""

        def __getattr__(self, name: str) -> Any:
            def refuse(*args: Any, **kwargs: Any) -> Any:
                raise DatabaseError("permission denied for table workqueue_schedulerecord")

            return refuse

    def refused(alias: str) -> Any:
        return Refusing()

    clock = Clock(dt.datetime(2026, 7, 1, 1, 0, 5, tzinfo=UTC))
    scheduler = Scheduler(load_schedules([schedule(topic_name, "0 * * * *")]), clock=clock)
    said = []
    with caplog.at_level(logging.WARNING, logger="workqueue.runtime.scheduler"):
        for readable in (False, False, True, False):
            caplog.clear()
            monkeypatch.setattr(manager, "using", reading if readable else refused)
            scheduler.run_once()
            said.append("could not be read or written" in caplog.text)

    assert said == [True, False, False, True]


def test_a_later_slot_is_recorded_over_an_earlier_one_another_host_wrote_meanwhile(
    monkeypatch, topic_name
):
    """Review helper-191: the record was written only over the value read, so a host recording
    03:00 lost to one that recorded 02:00 between its read and its write, and the record stayed
    at the earlier slot. It is read again and written until it holds the later one."""
    from django.db.models import QuerySet

    from workqueue.models import ScheduleRecord

    ScheduleRecord.objects.create(
        name="report", last_slot="2026-07-01T01:00:00+00:00", definition="x"
    )
    [report] = load_schedules([schedule(topic_name, "0 * * * *")])
    earlier = report.latest_slot(dt.datetime(2026, 7, 1, 2, 0, 5, tzinfo=UTC))
    later = report.latest_slot(dt.datetime(2026, 7, 1, 3, 0, 5, tzinfo=UTC))
    update = QuerySet.update

    def another_host_writes_first(self: QuerySet, **fields: Any) -> int:
        monkeypatch.setattr(QuerySet, "update", update)  # once
        ScheduleRecord.objects.filter(name="report").update(last_slot=earlier.at.isoformat())
        return update(self, **fields)

    monkeypatch.setattr(QuerySet, "update", another_host_writes_first)
    Scheduler([report])._record(report, later)

    assert ScheduleRecord.objects.get(name="report").last_slot == "2026-07-01T03:00:00+00:00"


def test_a_schedule_moved_to_another_topic_does_not_run_its_slot_again_once_it_was_purged():
    """Review helper-188: a definition moved to another topic counted the slot it had run as
    published only while the slot's message existed (its key is kept on the old topic): once
    the old topic's retention (1 day) purged it, a mid-week deploy moving the weekly schedule
    published Monday's slot again."""
    old, new = TopicFactory(retention_days=1), TopicFactory()
    subscription = SubscriptionFactory(topic=old)
    SubscriptionFactory(topic=new)
    clock = Clock(dt.datetime(2026, 7, 6, 1, 0, 5, tzinfo=UTC))  # a Monday
    ran = Scheduler(load_schedules([schedule(old.name, "0 1 * * 1")]), clock=clock).run_once()
    assert ran.published == {"report": dt.datetime(2026, 7, 6, 1, 0, tzinfo=UTC)}
    receiver = Receiver(subscription.id)
    (delivery,) = receiver.receive(1).deliveries
    assert receiver.complete(delivery).settled
    get_driver().shift_time(86_400 + 60, topic_id=str(old.id))
    Sweeper().run_once()
    assert not Message.objects.filter(topic=old).exists()

    clock.now = dt.datetime(2026, 7, 8, 12, 0, tzinfo=UTC)  # Wednesday: a deploy moves it
    moved = Scheduler(load_schedules([schedule(new.name, "0 1 * * 1")]), clock=clock).run_once()

    assert (moved.published, published(new.name)) == ({}, 0)


def test_a_schedule_of_a_task_whose_subscription_was_deleted_makes_it_again_as_enqueue_does():
    """Audit helper-133: the queue was made only when its topic was missing. With the topic
    kept and its subscription deleted (the admin, a topology sync), every slot was stored with
    no delivery, counted as published, and the task never ran; a queue fed only by its
    schedule never got the enqueue that would have made the subscription again."""
    from workqueue.models import Subscription
    from workqueue.tasks.api import default_task_backend

    get_user_model().objects.create_user("workqueue-system")
    default_task_backend.ensure_queue("default")
    Subscription.objects.filter(name="tasks.default").delete()
    schedules = load_schedules(
        [{"name": "sums", "cron": "0 * * * *", "task": "tests.task_functions.add", "args": [1, 2]}]
    )

    first = Scheduler(schedules, clock=Clock(dt.datetime(2026, 7, 1, 1, 30, tzinfo=UTC))).run_once()
    second = Scheduler(
        schedules, clock=Clock(dt.datetime(2026, 7, 1, 2, 30, tzinfo=UTC))
    ).run_once()

    assert (first.published, first.refused) == (
        {"sums": dt.datetime(2026, 7, 1, 1, tzinfo=UTC)},
        {},
    )
    assert (second.published, second.refused) == (
        {"sums": dt.datetime(2026, 7, 1, 2, tzinfo=UTC)},
        {},
    )
    assert Delivery.objects.filter(subscription__name="tasks.default").count() == 2


def test_a_task_schedule_of_an_existing_queue_only_reads_the_topology(pg_conn):
    """Review helper-135: making sure of the queue at each pass looked up the transport named
    "Database" first; with the seeded transport renamed (which the topology allows), each pass
    made a new one, or, run as the runtime role (which may not write the topology), failed and
    published nothing, although the queue existed."""
    from tests.support.roles import acting_as_granted_role
    from workqueue.models import Transport
    from workqueue.tasks.api import default_task_backend

    get_user_model().objects.create_user("workqueue-system")
    default_task_backend.ensure_queue("default")
    Transport.objects.filter(name="Database").update(name="main-db")
    schedules = load_schedules(
        [{"name": "sums", "cron": "0 * * * *", "task": "tests.task_functions.add", "args": [1, 2]}]
    )

    with acting_as_granted_role(pg_conn, "wq_sched", "grant-runtime"):
        result = Scheduler(
            schedules, clock=Clock(dt.datetime(2026, 7, 1, 1, 30, tzinfo=UTC))
        ).run_once()

    assert (result.published, result.refused) == (
        {"sums": dt.datetime(2026, 7, 1, 1, tzinfo=UTC)},
        {},
    )
    assert list(Transport.objects.values_list("name", flat=True)) == ["main-db"]


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        (
            {"name": "a", "cron": "* * * * *", "task": "tests.task_functions.no_such_task"},
            "cannot be imported",
        ),
        (
            {"name": "a", "cron": "* * * * *", "task": "tests.task_functions.RUNS"},
            "decorate the function with @task",
        ),
        (
            {"name": "a", "cron": "* * * * *", "task": "tests.task_functions.add", "topic": "t"},
            "leave out topic",
        ),
        (
            {"name": "a", "cron": "* * * * *", "task": "tests.task_functions.add", "args": [{1}]},
            "args[0] is a set",
        ),
        # list("12") would have been the arguments '1' and '2' (review helper-121).
        (
            {"name": "a", "cron": "* * * * *", "task": "tests.task_functions.add", "args": "12"},
            "args must be a list and kwargs a dict (got str and dict)",
        ),
        (
            {"name": "a", "cron": "* * * * *", "task": "tests.task_functions.add", "kwargs": 5},
            "args must be a list and kwargs a dict (got list and int)",
        ),
        ({"name": "a", "cron": "61 * * * *", "topic": "t"}, "cron '61 * * * *' is not a cron"),
        # From YAML, JSON or the environment: cronsim's AttributeError crashed `manage.py
        # check`, and with it migrate and runserver (review helper-170).
        ({"name": "a", "cron": 5, "topic": "t"}, "cron 5 must be text"),
        ({"name": "a", "cron": ["0 3 * * *"], "topic": "t"}, "must be text"),
        # Accepted, every pass refused the slot's publish and the schedule never fired.
        ({"name": "a", "cron": "* * * * *", "topic": 5}, "topic 5 is not a topic's name"),
        ({"name": "a", "cron": "* * * * *", "topic": "Bad Topic!"}, "lower-case words"),
        ({"name": "a", "cron": "* * * * *", "topic": "t", "timezone": "Mars/Base"}, "IANA"),
        ({"name": "a", "cron": "* * * * *"}, "missing topic"),
        ({"name": "a", "cron": "* * * * *", "topic": "t", "every": 5}, "unknown key(s) every"),
        ({"name": "Nightly Report", "cron": "* * * * *", "topic": "t"}, "lower-case"),
        # Refused at every slot before, a log line every pass and the schedule never firing.
        ({"name": "a", "cron": "* * * * *", "topic": "t", "priority": 500}, "InvalidPriority"),
        ({"name": "a", "cron": "* * * * *", "topic": "t", "partition_key": ""}, "partition_key"),
        (
            {"name": "a", "cron": "* * * * *", "topic": "t", "payload": {"ids": {1, 2}}},
            "never be published",
        ),
        (
            {"name": "a", "cron": "* * * * *", "topic": "t", "attributes": {"wq.x": "1"}},
            "never be published",
        ),
    ],
)
def test_a_bad_schedule_is_refused_naming_the_entry_and_the_fix(entry, says):
    with pytest.raises(WorkQueueConfigurationError) as raised:
        load_schedules([{"name": "ok", "cron": "0 * * * *", "topic": "t"}, entry])
    assert "WORKQUEUE['SCHEDULES'][1]" in str(raised.value)
    assert says in str(raised.value)


def test_passes_further_apart_than_a_schedules_slots_are_warned_of(settings, topic_name):
    """Audit helper-130: a slot is publishable only until the next one, so a scheduler whose
    passes come further apart skips slots for good (90 s passes published 8 of 12 minutely
    slots here), and nothing said so."""
    entries = [schedule(topic_name, "* * * * *")]
    settings.WORKQUEUE = {**settings.WORKQUEUE, "SCHEDULES": entries}
    clock = Clock(dt.datetime(2026, 5, 4, 9, 0, 30, tzinfo=UTC))
    scheduler = Scheduler(load_schedules(entries), clock=clock)
    for _ in range(8):
        scheduler.run_once()
        clock.now += dt.timedelta(seconds=90)
    assert published(topic_name) == 8

    quiet = check_settings()
    settings.WORKQUEUE = {**settings.WORKQUEUE, "SCHEDULER_INTERVAL_MS": 90_000}
    warned = [e for e in check_settings() if e.id == "workqueue.W009"]

    assert not [e for e in quiet if e.id == "workqueue.W009"]
    assert len(warned) == 1
    assert "'report' (* * * * *) has slots 60 s apart" in warned[0].msg
    assert "Lower SCHEDULER_INTERVAL_MS" in warned[0].hint


def test_two_schedules_cannot_share_a_name(settings):
    twice = [{"name": "a", "cron": "* * * * *", "topic": "t"}] * 2
    with pytest.raises(WorkQueueConfigurationError, match="already named 'a'"):
        load_schedules(twice)
    settings.WORKQUEUE = {**settings.WORKQUEUE, "SCHEDULES": twice}
    assert [e.id for e in check_settings()] == ["workqueue.E005"]


def test_manage_py_check_reports_a_cron_that_is_not_text(settings):
    """Review helper-170: check_settings() raised cronsim's AttributeError instead."""
    entries = [{"name": "nightly", "cron": 3, "topic": "t"}]
    settings.WORKQUEUE = {**settings.WORKQUEUE, "SCHEDULES": entries}
    assert [e.id for e in check_settings()] == ["workqueue.E005"]


@pytest.fixture
def hosts() -> Iterator[Callable[..., Host]]:
    get_user_model().objects.create_user("workqueue-system")
    started: list[Host] = []

    def start(**config: Any) -> Host:
        host = Host(
            HostConfig(
                subscriptions=[],
                sweeper_interval_ms=0,
                reconcile_interval_ms=0,
                scheduler_interval_ms=50,
                **config,
            )
        )
        started.append(host)
        host.start()
        return host

    yield start
    for host in started:
        host.shutdown()
    get_driver().close()


def test_hosts_run_the_scheduler_on_the_database_clock(hosts, topic_name):
    entries = [schedule(topic_name, "* * * * *", payload={"every": "minute"})]
    started = get_driver().database_now()
    for _ in range(2):
        hosts(schedules=entries)

    wait_until(lambda: published(topic_name))
    time.sleep(0.5)  # ten passes of each host
    ended = get_driver().database_now()

    # One message for each minute the hosts ran in (one, or two across a minute's turn).
    minutes = {started.replace(second=0, microsecond=0), ended.replace(second=0, microsecond=0)}
    assert published(topic_name) == len(minutes)
    assert Message.objects.filter(topic__name=topic_name).first().payload == {"every": "minute"}


def test_the_schedules_command_shows_each_slot_whether_published_and_the_next(
    settings, topic_name, capsys
):
    # Hourly, so the slot does not change between the three reads below.
    settings.WORKQUEUE = {**settings.WORKQUEUE, "SCHEDULES": [schedule(topic_name, "0 * * * *")]}

    call_command("workqueue", "schedules", "--json")
    [before] = json.loads(capsys.readouterr().out)
    Scheduler(load_schedules(settings.WORKQUEUE["SCHEDULES"])).run_once()
    call_command("workqueue", "schedules", "--json")
    [after] = json.loads(capsys.readouterr().out)

    assert (before["published"], after["published"]) == (False, True)
    assert (after["name"], after["topic"], after["timezone"]) == ("report", topic_name, "UTC")
    # The slot's message (a task schedule's result is read by its id).
    assert Message.objects.filter(pk=after["message_id"], topic__name=topic_name).exists()
    slot, following = dt.datetime.fromisoformat(after["slot"]), after["next_slot"]
    assert dt.datetime.fromisoformat(following) - slot == dt.timedelta(hours=1)


def test_schedules_still_says_published_once_retention_purged_the_slots_message(settings, capsys):
    """Audit helper-130: "published" was read from the messages table, which retention purges
    long before a slot stops being publishable (a yearly slot here, kept by its key for 30
    days), so the command said "no" while the key kept every host from publishing it again."""
    topic = TopicFactory(retention_days=1)
    subscription = SubscriptionFactory(topic=topic)
    slot_at = (get_driver().database_now() - dt.timedelta(days=2)).replace(second=0, microsecond=0)
    entries = [
        schedule(topic.name, f"{slot_at.minute} {slot_at.hour} {slot_at.day} {slot_at.month} *")
    ]
    settings.WORKQUEUE = {**settings.WORKQUEUE, "SCHEDULES": entries}
    assert Scheduler(load_schedules(entries)).run_once().published == {"report": slot_at}
    receiver = Receiver(subscription.id)
    (delivery,) = receiver.receive(1).deliveries
    assert receiver.complete(delivery).settled
    get_driver().shift_time(86_400 + 60, topic_id=str(topic.id))  # a day and a minute on
    Sweeper().run_once()
    assert not Message.objects.filter(topic=topic).exists()
    assert Scheduler(load_schedules(entries)).run_once().duplicates == {"report": slot_at}

    call_command("workqueue", "schedules", "--json")
    [row] = json.loads(capsys.readouterr().out)

    assert (dt.datetime.fromisoformat(row["slot"]), row["published"]) == (slot_at, True)


def test_schedules_does_not_take_a_message_squatting_a_slots_old_id_for_the_slot(
    client, settings, capsys
):
    """Audit helper-137: a slot's ids include the unkeyed one of earlier releases, which anyone
    who knows the schedule can compute; a key holder published it to a topic of its own, and
    `workqueue schedules` said the slot, never run, was published."""
    from tests.factories import ApiKeyFactory
    from tests.support.api import post

    topic = TopicFactory(name="reports")
    SubscriptionFactory(topic=topic)
    entries = [schedule(topic.name, "0 * * * *")]
    settings.WORKQUEUE = {**settings.WORKQUEUE, "SCHEDULES": entries}
    [report] = load_schedules(entries)
    unkeyed = report.latest_slot(get_driver().database_now()).own_message_ids[-1]
    TopicFactory(name="inbox", allow_external_publish=True)
    key = ApiKeyFactory(scopes=["workqueue:publish"], topics=["inbox"])
    squat = post(client, "inbox", {"messages": [{"messageId": unkeyed, "payload": 1}]}, key=key)
    assert squat.json()["results"][0]["status"] == "Accepted"

    call_command("workqueue", "schedules", "--json")
    [row] = json.loads(capsys.readouterr().out)

    assert (row["published"], row["message_id"] != unkeyed) == (False, True), row


def test_a_schedule_changed_after_its_slot_ran_counts_the_slot_as_published(caplog):
    """Audit helper-130: a definition changed under the same name (another payload and a cron
    naming a slot already run; or another topic) had that slot's publish refused
    MessageIDConflict, the slot's own id holding its earlier message: an ERROR on every pass of
    every host, and `schedules --publish` failing, until the next slot (up to a day)."""
    old, new = TopicFactory(), TopicFactory()
    SubscriptionFactory(topic=old)
    SubscriptionFactory(topic=new)
    clock = Clock(dt.datetime(2026, 5, 4, 10, 0, 30, tzinfo=UTC))
    before = [schedule(old.name, "*/5 * * * *", payload={"format": "csv"})]
    ran = Scheduler(load_schedules(before), clock=clock).run_once()
    assert ran.published == {"report": dt.datetime(2026, 5, 4, 10, 0, tzinfo=UTC)}

    changes = [  # each when its latest slot is 10:00 again
        (schedule(old.name, "0 * * * *", payload={"format": "pdf"}), 20),
        (schedule(new.name, "*/5 * * * *", payload={"format": "csv"}), 4),
    ]
    with caplog.at_level(logging.WARNING, logger="workqueue.runtime.scheduler"):
        for entries, minute in changes:
            get_driver().shift_time(301, topic_id=str(old.id))  # the slot's key has expired
            clock.now = dt.datetime(2026, 5, 4, 10, minute, 40, tzinfo=UTC)
            after = Scheduler(load_schedules([entries]), clock=clock)
            passes = [after.run_once() for _ in range(3)]
            assert [(p.refused, p.published) for p in passes] == [({}, {})] * 3, passes
            assert passes[0].duplicates == {"report": dt.datetime(2026, 5, 4, 10, 0, tzinfo=UTC)}

    assert (published(old.name), published(new.name)) == (1, 0)
    told = [r for r in caplog.records if r.name == "workqueue.runtime.scheduler"]
    assert [r.levelname for r in told] == ["WARNING", "WARNING"], caplog.text
    assert "was published before its definition changed" in told[0].getMessage()


def test_schedules_publish_runs_a_pass_for_deployments_without_a_host(settings, topic_name, capsys):
    """Only long-running hosts ran the scheduler: a deployment of container jobs alone never
    published a slot. ``schedules --publish`` from cron does, once per slot however often."""
    settings.WORKQUEUE = {
        **settings.WORKQUEUE,
        "SCHEDULES": [
            schedule(topic_name, "0 * * * *"),
            {"name": "nowhere", "cron": "0 * * * *", "topic": "no.such.topic"},
        ],
    }

    slots = set()
    for _ in range(2):
        with pytest.raises(CommandError, match=r"Not published: nowhere \(TopicNotFound\)"):
            call_command("workqueue", "schedules", "--publish", "--json")
        rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
        assert (rows["report"]["published"], rows["nowhere"]["published"]) == (True, False)
        slots.add(rows["report"]["slot"])

    # One message per slot (two only if the runs fell either side of the hour).
    assert published(topic_name) == len(slots)


def test_a_topic_name_publish_accepts_is_accepted_in_a_schedule():
    """Review helper-172: publish() reads a name in any case, spaces around it; refused here,
    a schedule that fired before the check stopped `manage.py check` (E005) and the host."""
    topic = TopicFactory(name="orders.created")
    SubscriptionFactory(topic=topic)
    assert publish("Orders.Created", {"n": 1}).status == "Accepted"  # as the scheduler does
    assert Message.objects.count() == 1

    load_schedules([{"name": "a", "cron": "* * * * *", "topic": "Orders.Created"}])


def test_a_schedule_whose_slot_cannot_be_worked_out_keeps_no_other_from_publishing(
    topic_name, monkeypatch, caplog
):
    """Each schedule's publish failing was caught, but not the slot's arithmetic before it
    (cronsim's, on a time or an expression it fails on): the pass raised and every schedule
    after that one went unpublished at each pass (review helper-170)."""
    clock = Clock(dt.datetime(2026, 5, 4, 9, 0, 20, tzinfo=UTC))
    entries = [
        {**schedule(topic_name, "* * * * *"), "name": "broken"},
        {**schedule(topic_name, "* * * * *"), "name": "fine"},
    ]
    schedules = load_schedules(entries)
    real_latest_slot = type(schedules[0]).latest_slot

    def latest_slot(self, now):
        if self.name == "broken":
            raise ValueError("an expression cronsim cannot step through")
        return real_latest_slot(self, now)

    monkeypatch.setattr(type(schedules[0]), "latest_slot", latest_slot)

    with caplog.at_level(logging.ERROR, logger="workqueue.runtime.scheduler"):
        result = Scheduler(schedules, clock=clock).run_once()

    assert (list(result.published), result.refused) == (["fine"], {"broken": "Error"})
    assert published(topic_name) == 1
    assert "publishing broken failed" in caplog.text
