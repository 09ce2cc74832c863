"""The scheduler a host runs: each pass publishes every schedule's latest slot, at most once
across all hosts (see ``workqueue.scheduling`` for the policy)."""

from __future__ import annotations

import datetime as dt
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from workqueue.conf import get_settings
from workqueue.driver import get_driver
from workqueue.publishing import publish
from workqueue.scheduling import Schedule, Slot
from workqueue.types import PublishErrorCode, PublishResult, PublishStatus

logger = logging.getLogger(__name__)


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
        self.clock = clock or get_driver(get_settings().DATABASE_ALIAS).database_now
        self._changed_slots_reported: set[tuple[str, dt.datetime]] = set()

    def run_once(self) -> SchedulerPassResult:
        result = SchedulerPassResult()
        if not self.schedules:
            return result
        now = self.clock()
        for schedule in self.schedules:
            try:
                slot = schedule.latest_slot(now)
                if slot is None:
                    continue
                published = _publish_slot(schedule, slot)
            except Exception:
                # One schedule's failure (its cron's arithmetic, a database error, a payload
                # that cannot be stored) must not keep the others from publishing; the next
                # pass tries again.
                logger.exception("Scheduler: publishing %s failed", schedule.name)
                result.refused[schedule.name] = "Error"
                continue
            if (
                published.status == PublishStatus.ACCEPTED
                and schedule.task is not None
                and (published.delivered_to is not None and not published.delivered_to)
            ):
                # Stored, but its queue's subscription is Disabled (or was deleted just now):
                # the task would never run, and the slot must not read as done without a word.
                result.refused[schedule.name] = "NoSubscription"
                logger.error(
                    "Scheduler: schedule %s slot %s enqueued task %s as message %s, but no "
                    "subscription of %s took it (Disabled): it will not run; enable the "
                    "subscription, or delete it (the next slot makes it again)",
                    schedule.name,
                    slot.at.isoformat(),
                    schedule.task,
                    published.message_id,
                    schedule.topic,
                    extra={"action": "schedule_refused"},
                )
            elif published.status == PublishStatus.ACCEPTED:
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
                if published.message_id not in slot.own_message_ids:
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
                if (schedule.name, slot.at) not in self._changed_slots_reported:
                    self._changed_slots_reported.add((schedule.name, slot.at))
                    logger.warning(
                        "Scheduler: schedule %s slot %s was published before its definition "
                        "changed; it is not published again, and the next slot is published "
                        "as now defined",
                        schedule.name,
                        slot.at.isoformat(),
                        extra={"action": "schedule_changed"},
                    )
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


def _publish_slot(schedule: Schedule, slot: Slot) -> PublishResult:
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

        task = import_string(schedule.task)
        task.get_backend().ensure_queue(task.queue_name)
    return publishing()
