"""The scheduler a host runs: each pass publishes every schedule's latest slot, at most once
across all hosts (see ``workqueue.scheduling`` for the policy)."""

from __future__ import annotations

import datetime as dt
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from django.db import DatabaseError

from workqueue.conf import get_settings
from workqueue.driver import database_away, get_driver
from workqueue.driver.base import SCHEDULE_RECORD_TABLE
from workqueue.exceptions import one_line
from workqueue.publishing import publish
from workqueue.scheduling import Schedule, Slot, recorded_slot_time
from workqueue.types import PublishErrorCode, PublishResult, PublishStatus, SubscriptionStatus

logger = logging.getLogger(__name__)

#: How many times a schedule's record is read and written over before the pass leaves it (the
#: next pass records the slot again): each try loses only to another host's write.
RECORD_TRIES = 5


@dataclass(slots=True)
class SchedulerPassResult:
    """What one pass did, by schedule name: the slot it published (or found already
    published by another host), and the schedules whose publish was refused."""

    published: dict[str, dt.datetime] = field(default_factory=dict)
    duplicates: dict[str, dt.datetime] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)


class Scheduler:
    """Publishes due slots of ``schedules``. ``clock`` defaults to the database clock."""

    def __init__(
        self, schedules: Sequence[Schedule], clock: Callable[[], dt.datetime] | None = None
    ) -> None:
        self.schedules = list(schedules)
        self.alias = get_settings().DATABASE_ALIAS
        self.clock = clock or get_driver(self.alias).database_now
        self._changed_slots_reported: set[tuple[str, dt.datetime]] = set()
        self._disabled_queues_reported: set[tuple[str, dt.datetime]] = set()
        self._records_ahead_reported: set[tuple[str, dt.datetime]] = set()
        self._records_failed_reported = False

    def run_once(self) -> SchedulerPassResult:
        result = SchedulerPassResult()
        if not self.schedules:
            return result
        # Read before the clock: a slot another host publishes and records in between is then
        # one this pass sees published (a Duplicate), not one a later slot was recorded past
        # (a definition changed, it would say: review helper-189).
        last_slots = self._last_slots()
        now = self.clock()
        for schedule in self.schedules:
            try:
                slot = schedule.latest_slot(now)
                if slot is None:
                    continue
                last, definition = last_slots.get(schedule.name, (None, None))
                if last is not None and slot.at <= last:
                    # Published already, or a later slot was, under an earlier definition (its
                    # zone or cron moved the slot's time, or its topic changed, where the slot's
                    # key is not kept): published again, the work ran twice (review helper-188).
                    result.duplicates[schedule.name] = slot.at
                    if last > now:
                        self._report_record_ahead(schedule, last, now)
                    elif slot.at < last or definition != schedule.digest:
                        self._report_changed(schedule, slot)
                    continue
                published = _publish_slot(schedule, slot, self.alias)
            except Exception:
                # One schedule's failure (its cron's arithmetic, a database error, a payload
                # that cannot be stored) must not keep the others from publishing; the next
                # pass tries again.
                logger.exception("Scheduler: publishing %s failed", schedule.name)
                result.refused[schedule.name] = "Error"
                continue
            if published is None or (
                published.status == PublishStatus.ACCEPTED
                and schedule.task is not None
                and (published.delivered_to is not None and not published.delivered_to)
            ):
                # Its queue's subscription is Disabled: the task would never run, and the slot
                # must not read as done without a word. Checked before the publish (stored with
                # no delivery, the slot's key was taken: once the subscription was enabled the
                # slot was a Duplicate, never run: review helper-188), and after it, for one
                # disabled (or deleted) meanwhile. The slot is tried again at every pass.
                result.refused[schedule.name] = "NoSubscription"
                if (schedule.name, slot.at) not in self._disabled_queues_reported:
                    self._disabled_queues_reported.add((schedule.name, slot.at))
                    logger.error(
                        "Scheduler: schedule %s slot %s did not enqueue task %s: subscription "
                        "%s is Disabled; %s",
                        schedule.name,
                        slot.at.isoformat(),
                        schedule.task,
                        schedule.topic,
                        "enable it and the next pass publishes the slot (until the next slot)"
                        if published is None
                        else f"disabled as the slot was published, its message "
                        f"{published.message_id} was stored with no delivery and will not "
                        "run; enable the subscription and the next slot runs",
                        extra={"action": "schedule_refused"},
                    )
            elif published.status == PublishStatus.ACCEPTED:
                self._record(schedule, slot)
                result.published[schedule.name] = slot.at
                logger.info(
                    "Scheduler: published %s slot %s as message %s",
                    schedule.name,
                    slot.at.isoformat(),
                    published.message_id,
                    extra={"action": "schedule_published"},
                )
            elif published.status == PublishStatus.DUPLICATE:
                result.duplicates[schedule.name] = slot.at
                if published.message_id in slot.own_message_ids:
                    self._record(schedule, slot)  # another host published it
                else:
                    # Not another host's publish of this slot (it has the slot's own id): a
                    # message of some other publisher holds the slot's key, so the slot's
                    # message was not stored.
                    logger.error(
                        "Scheduler: schedule %s slot %s was not published: its deduplication "
                        "key is held by message %s, which no scheduler with this host's "
                        "SECRET_KEY (or SECRET_KEY_FALLBACKS) published: hosts of one "
                        "deployment must share the key",
                        schedule.name,
                        slot.at.isoformat(),
                        published.message_id,
                        extra={"action": "schedule_refused"},
                    )
            elif (
                published.error is not None
                and published.error.code == PublishErrorCode.MESSAGE_ID_CONFLICT
            ):
                # The slot's own id (an HMAC only this deployment's schedulers make) holds
                # another message: this slot was published before the schedule's definition
                # changed (another payload, topic or cron naming a slot already run). It ran
                # once; refused, it was logged as an error on every pass until the next slot.
                result.duplicates[schedule.name] = slot.at
                self._record(schedule, slot)
                self._report_changed(schedule, slot)
            elif published.error is not None and published.error.retryable:
                # Another host is publishing this slot right now (DeduplicationPending), or the
                # database is busy: the next pass sees the outcome.
                result.refused[schedule.name] = published.error.code
            else:
                error = published.error
                result.refused[schedule.name] = error.code if error else published.status
                logger.error(
                    "Scheduler: schedule %s slot %s was refused: %s",
                    schedule.name,
                    slot.at.isoformat(),
                    f"{error.code}: {error.message}" if error else published.status,
                    extra={"action": "schedule_refused"},
                )
        return result

    def _report_changed(self, schedule: Schedule, slot: Slot) -> None:
        """Say once that ``slot`` is not published: it, or a later slot, was published before
        the schedule's definition changed."""
        if (schedule.name, slot.at) in self._changed_slots_reported:
            return
        self._changed_slots_reported.add((schedule.name, slot.at))
        logger.warning(
            "Scheduler: schedule %s slot %s was published before its definition changed, or a "
            "later slot was; it is not published again, and the next slot is published as now "
            "defined",
            schedule.name,
            slot.at.isoformat(),
            extra={"action": "schedule_changed"},
        )

    def _report_record_ahead(self, schedule: Schedule, last: dt.datetime, now: dt.datetime) -> None:
        """Say once that ``schedule`` publishes nothing until ``last``, the slot its record
        holds, which lies ahead of the database clock: told the definition changed, an
        operator would look in the wrong place while every slot until then is skipped."""
        if (schedule.name, last) in self._records_ahead_reported:
            return
        self._records_ahead_reported.add((schedule.name, last))
        logger.warning(
            "Scheduler: schedule %s's record says slot %s was published, which is later than "
            "the database clock's %s (a clock set back after running ahead, or a record edited "
            "by hand): no slot of it is published until then. If that slot never ran, delete "
            "the record: DELETE FROM %s WHERE name = '%s'",
            schedule.name,
            last.isoformat(),
            now.isoformat(),
            SCHEDULE_RECORD_TABLE,
            schedule.name.replace("'", "''"),
            extra={"action": "schedule_record_ahead"},
        )

    def _last_slots(self) -> dict[str, tuple[dt.datetime, str]]:
        """The latest slot each schedule published and the digest of the definition it was
        published under (ScheduleRecord), by name; none known if they cannot be read (the
        slots' keys still keep a slot from being published twice on its topic)."""
        from workqueue.models import ScheduleRecord

        names = [schedule.name for schedule in self.schedules]
        try:
            records = ScheduleRecord.objects.using(self.alias).filter(name__in=names)
            rows = list(records.values_list("name", "last_slot", "definition"))
        except DatabaseError as exc:
            self._records_failed(exc)
            return {}
        # Read again: a later failure (a grant taken back, say) is said again, not taken for
        # the one said before.
        self._records_failed_reported = False
        last_slots = {}
        for name, at, digest in rows:
            if (last := recorded_slot_time(at)) is not None:
                last_slots[name] = (last, digest)
            else:
                # Not a time (edited by hand): as if none were recorded, until the next
                # publish of the schedule's records its slot over it.
                logger.warning(
                    "Scheduler: schedule %s's record holds %r, not a slot time; delete its row "
                    "of %s",
                    name,
                    at,
                    SCHEDULE_RECORD_TABLE,
                )
        return last_slots

    def _record(self, schedule: Schedule, slot: Slot) -> None:
        """Record that ``slot`` of ``schedule`` was published (by this host or another), unless
        a later one already is."""
        from workqueue.models import ScheduleRecord

        records = ScheduleRecord.objects.using(self.alias)
        recorded = {"last_slot": slot.at.isoformat(), "definition": schedule.digest}
        try:
            # Compared here, as times: a database's collation may not order the text as
            # bytes. Written only over the value read, and read again when another host wrote
            # first, so that neither an earlier slot overwrites a later one nor the other way
            # round (review helper-191).
            for _ in range(RECORD_TRIES):
                record, made = records.get_or_create(name=schedule.name, defaults=recorded)
                if made:
                    return
                last = recorded_slot_time(record.last_slot)
                if last is not None and last >= slot.at:
                    return
                if records.filter(name=schedule.name, last_slot=record.last_slot).update(
                    **recorded
                ):
                    return
        except DatabaseError as exc:
            self._records_failed(exc)

    def _records_failed(self, exc: DatabaseError) -> None:
        if self._records_failed_reported:
            return
        self._records_failed_reported = True
        if database_away(exc):
            # Not the migration or grant the message below names: an outage (a restart, a
            # failover), which the pass's publishes meet too (review helper-201).
            logger.warning(
                "Scheduler: the schedules' records (%s) could not be read or written: the "
                "database is away (%s); the passes go on, and slots are published once it is "
                "back.",
                SCHEDULE_RECORD_TABLE,
                one_line(exc),
            )
        else:
            logger.warning(
                "Scheduler: the schedules' records (%s) could not be read or written: %s; a "
                "slot is still published once per topic, but a schedule whose zone, cron or "
                "topic changes may publish a slot it already ran. Run `manage.py migrate`, and "
                "`manage.py workqueue grant-runtime` for the host's database role.",
                SCHEDULE_RECORD_TABLE,
                exc,
            )


def _publish_slot(schedule: Schedule, slot: Slot, alias: str) -> PublishResult | None:
    """Publish ``slot``; None, publishing nothing, for a task whose queue's subscription is
    Disabled."""
    publishing = functools.partial(
        publish,
        schedule.topic,
        schedule.payload,
        partition_key=schedule.partition_key,
        attributes=schedule.attributes,
        priority=schedule.priority,
        deduplication_key=slot.deduplication_key,
        deduplication_ttl=slot.deduplication_ttl,
        message_id=slot.message_id,
    )
    if schedule.task is not None:
        # The task's queue made sure of before each slot, as the task's own enqueue makes sure
        # of it: made only when the topic was missing, a queue whose subscription was deleted
        # (its topic kept) took every slot with no delivery, the task never run and each slot
        # counted as published (audit helper-133).
        from django.utils.module_loading import import_string

        from workqueue.models import Subscription

        task = import_string(schedule.task)
        task.get_backend().ensure_queue(task.queue_name)
        status = (
            Subscription.objects.using(alias)
            .filter(name=schedule.topic)
            .values_list("status", flat=True)
            .first()
        )
        if status == SubscriptionStatus.DISABLED:
            return None
    return publishing()
