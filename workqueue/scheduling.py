"""Recurring publish: the schedules of ``WORKQUEUE["SCHEDULES"]`` and their slots.

A schedule publishes one message per *slot*, a time its cron expression names in its time zone
(cron expressions are read by ``cronsim``; DST gaps and repeats follow its rules). The policy,
which the README states for users:

- A slot is published by whichever host's scheduler sees it first; every other host's publish
  of that slot is a ``Duplicate``, because each slot has its own deduplication key
  (``wq.schedule:<name>:<slot in UTC>``) and message id. The message id is keyed with the
  deployment's ``SECRET_KEY``: the same on every host, and unguessable to a publisher who
  knows the schedule's name and cron (see ``slot_message_id``).
- A scheduler publishes only the *latest* slot at or before now. After downtime the slots
  missed meanwhile are not caught up: the latest one is published once, the earlier ones never.
- A slot stays publishable until the next slot, and at most ``MAX_LATENESS`` (30 days, the
  longest deduplication window): a slot missed for longer than that is skipped. The slot's
  deduplication key lives as long as the slot is publishable, so no slot is published twice.

All times are the database clock's, so hosts whose own clocks disagree still agree on slots.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError
from django.conf import settings
from django.utils.crypto import salted_hmac

from workqueue.exceptions import WorkQueueConfigurationError
from workqueue.publishing import RESERVED_DEDUPLICATION_PREFIX, OutgoingMessage, message_problem

#: How late a slot may still be published (the longest deduplication window, 30 days).
MAX_LATENESS = dt.timedelta(days=30)
#: The shortest deduplication window publish accepts.
MIN_WINDOW = dt.timedelta(seconds=60)
NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,99}")
# A slot's search takes a few dozen of cronsim's steps; a search that takes this many will not
# end (cronsim 2.8's backward search near Pacific/Chatham's fall-back, which is off the hour).
MAX_CRON_STEPS = 10_000


def _machine_local(name: Any) -> bool:
    """Whether ``name`` is a file of the zone database that is no zone of its own but this
    machine's setting, or a variant tree of the database: each host would read its own."""
    return isinstance(name, str) and (
        name in ("localtime", "posixrules") or name.startswith(("posix/", "right/"))
    )


class CronSearchError(CronSimError):
    """cronsim's search for a schedule's slot did not end."""


class _BoundedCronSim(CronSim):
    """cronsim, whose search gives up after MAX_CRON_STEPS steps instead of spinning for
    good: a pass that never returned stopped every schedule of every host, and `manage.py
    check` and `workqueue schedules` hung with it (review helper-201)."""

    def __init__(self, expr: str, start: dt.datetime, reverse: bool = False) -> None:
        self._steps, self._expression, self._zone = 0, expr, start.tzinfo
        super().__init__(expr, start, reverse)

    def tick(self, seconds: int = 1) -> None:
        self._steps += 1
        if self._steps > MAX_CRON_STEPS:
            raise CronSearchError(
                f"cron {self._expression!r}: cronsim's search for a slot did not end near a "
                f"time zone change ({self._zone}); write the hour as numbers (e.g. "
                "'0 0,2,4,6,8,10,12,14,16,18,20,22 * * *', which cronsim handles across "
                "the change) or use another time zone."
            )
        super().tick(seconds)


# The unkeyed slot ids of earlier releases: uuid5 of the slot's deduplication key here.
PREVIOUS_SLOT_NAMESPACE = uuid.UUID("7b0c2f5e-4f1a-4c55-9d0e-2f6c3d1a9b80")
_REQUIRED = ("name", "cron", "topic")
_OPTIONAL = ("timezone", "payload", "partition_key", "attributes", "priority")
#: A schedule that enqueues a Tasks API task names it instead of a topic and payload.
_TASK_KEYS = ("task", "args", "kwargs")


@dataclass(frozen=True, slots=True)
class Slot:
    """One publishable slot of a schedule, and what its publish carries."""

    at: dt.datetime
    deduplication_key: str
    message_id: str
    #: The ids other hosts of this deployment may have published the slot under: keyed with a
    #: key of ``SECRET_KEY_FALLBACKS`` (hosts not yet given a rotated key), or unkeyed, by a
    #: host of an earlier release (during a rolling upgrade). The slot counts as published
    #: under any of them.
    other_message_ids: tuple[str, ...]
    #: Seconds the slot's deduplication key must live: from its publish (at or after the slot)
    #: until the slot stops being publishable.
    deduplication_ttl: int

    @property
    def own_message_ids(self) -> tuple[str, ...]:
        """Every id the slot may have been published under by a host of this deployment."""
        return (self.message_id, *self.other_message_ids)


@dataclass(frozen=True, slots=True)
class Schedule:
    """One entry of ``WORKQUEUE["SCHEDULES"]``, validated."""

    name: str
    cron: str
    topic: str
    timezone: str = "UTC"
    payload: Any = None
    partition_key: str | None = None
    attributes: Mapping[str, str] | None = None
    priority: int = 0
    #: The dotted path of the Tasks API task each slot enqueues (its ``topic`` and ``payload``
    #: are then the task's queue and message), or None.
    task: str | None = None

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    @property
    def digest(self) -> str:
        """A digest of what the schedule publishes and when (everything but its name)."""
        definition = [
            self.cron,
            self.topic,
            self.timezone,
            self.payload,
            self.partition_key,
            None if self.attributes is None else dict(self.attributes),
            self.priority,
            self.task,
        ]
        text = json.dumps(definition, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def next_slot_time(self, now: dt.datetime) -> dt.datetime:
        """The first slot after ``now``, in UTC: the next one ``latest_slot`` publishes.

        cronsim's forward search passes over a slot in the half hour a zone repeats or skips
        at a 30-minute DST change (Australia/Lord_Howe: 01:30 the night clocks go back, 02:30
        the night they go forward), which its backward search, and so ``latest_slot``, finds:
        the earliest of both (review helper-188: `workqueue schedules` showed the slot after
        the one published, and the W009 check measured gaps the slots do not have)."""
        after = now.astimezone(dt.UTC)
        forward = _BoundedCronSim(self.cron, after.astimezone(self.zone))
        earliest = next(forward).astimezone(dt.UTC)
        while earliest <= after:
            # Started in the second pass of an hour a zone repeats, cronsim may answer the
            # first pass's slot, before the start.
            earliest = next(forward).astimezone(dt.UTC)
        while True:
            try:
                # cronsim never returns its start time itself: the latest slot before it.
                before = next(
                    _BoundedCronSim(self.cron, earliest.astimezone(self.zone), reverse=True)
                )
            except StopIteration:
                return earliest
            before = before.astimezone(dt.UTC)
            if before <= after:
                return earliest
            earliest = before

    def shortest_gap(self, start: dt.datetime, slots: int = 200) -> dt.timedelta:
        """The shortest time between two of the next ``slots`` slots after ``start``."""
        previous = self.next_slot_time(start)
        shortest = dt.timedelta.max
        for _ in range(slots - 1):
            current = self.next_slot_time(previous)
            shortest = min(shortest, current - previous)
            previous = current
        return shortest

    def latest_slot(self, now: dt.datetime) -> Slot | None:
        """The slot to publish at ``now``: the latest at or before it, unless that one is no
        longer publishable (see the module's policy)."""
        # cronsim never returns its start time itself: start a microsecond later.
        start = (now + dt.timedelta(microseconds=1)).astimezone(self.zone)
        try:
            at = next(_BoundedCronSim(self.cron, start, reverse=True))
        except StopIteration:
            return None
        following = next(_BoundedCronSim(self.cron, at))
        while following.astimezone(dt.UTC) <= now:
            # Started in the hour a zone repeats when its clocks go back, the backward search
            # passes over a slot made in that hour's first pass (01:30 EDT, searched from
            # 01:10 EST) and returns the day before's, which is no longer publishable: the
            # slot had none for up to an hour (audit helper-130). The forward one does not.
            at, following = following, next(_BoundedCronSim(self.cron, following))
        # In UTC: two times of one zone subtract by their wall clocks, which makes the gap
        # across a DST change an hour short or long (01:00 EDT to 01:00 EST: zero).
        gap = following.astimezone(dt.UTC) - at.astimezone(dt.UTC)
        window = max(min(gap, MAX_LATENESS), MIN_WINDOW)
        if now - at >= window:
            return None
        at_utc = at.astimezone(dt.UTC)
        # Under the reserved prefix: no external publisher may take a slot's key first.
        key = f"{RESERVED_DEDUPLICATION_PREFIX}schedule:{self.name}:{at_utc.isoformat()}"
        return Slot(
            at=at_utc,
            deduplication_key=key,
            message_id=slot_message_id(key),
            other_message_ids=(
                *(slot_message_id(key, secret) for secret in settings.SECRET_KEY_FALLBACKS),
                str(uuid.uuid5(PREVIOUS_SLOT_NAMESPACE, key)),
            ),
            deduplication_ttl=int(window.total_seconds()),
        )


def recorded_slot_time(text: str) -> dt.datetime | None:
    """The slot time a schedule record holds (UTC ISO text), or None for text that is none: a
    row edited by hand into something else, or into a time without its offset (which could not
    be compared with a slot's: review helper-191)."""
    try:
        at = dt.datetime.fromisoformat(text)
    except (TypeError, ValueError):
        return None
    return at if at.tzinfo is not None else None


def slot_message_id(deduplication_key: str, secret: str | None = None) -> str:
    """The message id of the slot with ``deduplication_key``: an HMAC of it under the
    deployment's ``SECRET_KEY`` (or ``secret``), so every host agrees on it and nobody else can
    work it out.
    Derived in the open (uuid5, until this release), anyone who could publish to any topic
    could take a slot's id first: the scheduler's publish was then refused (another topic:
    MessageIDConflict, the slot never ran) or, on the schedule's own topic with the same
    payload, taken for the slot itself (a Duplicate) while the squatter's copy was due days
    later."""
    digest = salted_hmac(
        "workqueue.scheduling.slot", deduplication_key, secret=secret, algorithm="sha256"
    )
    return str(uuid.UUID(bytes=digest.digest()[:16], version=4))


def _is_topic_name(value: Any) -> bool:
    """Whether ``value`` names a topic as publish() reads it: in any case, spaces around it
    (the procedures compare names so; review helper-172)."""
    from workqueue.models.topology import DOTTED_NAME  # models: not before the apps are ready

    return isinstance(value, str) and bool(DOTTED_NAME.match(value.strip().lower()))


def load_schedules(entries: Iterable[Mapping[str, Any]]) -> list[Schedule]:
    """Validate ``WORKQUEUE["SCHEDULES"]``; the error names the entry and what to change."""
    if not isinstance(entries, (list, tuple)):
        raise WorkQueueConfigurationError(
            f"WORKQUEUE['SCHEDULES'] is {entries!r}: it takes a list of schedules."
        )
    schedules: list[Schedule] = []
    for index, entry in enumerate(entries):
        where = f"WORKQUEUE['SCHEDULES'][{index}]"
        if not isinstance(entry, Mapping):
            raise WorkQueueConfigurationError(f"{where} must be a dict, not {entry!r}.")
        if entry.get("task") is not None:
            entry = _task_entry(entry, where)
        missing = [key for key in _REQUIRED if not entry.get(key)]
        unknown = sorted(set(entry) - set(_REQUIRED) - set(_OPTIONAL) - {"task"})
        if missing or unknown:
            raise WorkQueueConfigurationError(
                f"{where}: "
                + (f"missing {', '.join(missing)}; " if missing else "")
                + (f"unknown key(s) {', '.join(unknown)}; " if unknown else "")
                + f"a schedule has {', '.join(_REQUIRED)} and optionally {', '.join(_OPTIONAL)}"
                + " (or, to enqueue a Tasks API task, task and optionally args and kwargs "
                "instead of topic and payload)."
            )
        schedule = Schedule(**entry)
        if not isinstance(schedule.name, str) or not NAME.fullmatch(schedule.name):
            raise WorkQueueConfigurationError(
                f"{where}: name {schedule.name!r} must be 1-100 lower-case letters, digits, "
                "'.', '_' or '-' (it is part of each slot's deduplication key)."
            )
        if schedule.name in {s.name for s in schedules}:
            raise WorkQueueConfigurationError(
                f"{where}: another schedule is already named {schedule.name!r}; names identify "
                "a schedule's slots, so each must be unique."
            )
        try:
            if _machine_local(schedule.timezone):
                # "localtime" (Debian's tzdata links it to /etc/localtime) loads too, as each
                # host's own zone: hosts in different zones each published the slot at its
                # own 03:00 (review helper-201).
                raise ZoneInfoNotFoundError(schedule.timezone)
            zone = ZoneInfo(schedule.timezone)
        except (ZoneInfoNotFoundError, ValueError, TypeError):
            raise WorkQueueConfigurationError(
                f"{where}: timezone {schedule.timezone!r} is not an IANA time zone name such as "
                "'UTC' or 'Europe/Amsterdam'."
            ) from None
        if not isinstance(schedule.cron, str):
            # cronsim reads a number or a list (from YAML, JSON or the environment) with an
            # AttributeError, which nothing here would name (review helper-170).
            raise WorkQueueConfigurationError(
                f"{where}: cron {schedule.cron!r} must be text: five fields, minute hour "
                "day-of-month month day-of-week, e.g. '0 3 * * *'."
            )
        if not _is_topic_name(schedule.topic):
            # Accepted, the host started and every pass refused the slot's publish: a
            # schedule that never fired, an ERROR a pass (review helper-170).
            raise WorkQueueConfigurationError(
                f"{where}: topic {schedule.topic!r} is not a topic's name: lower-case words of "
                "letters and digits joined by '.', '_' or '-' (e.g. orders.created)."
            )
        if len(schedule.cron.split()) == 6:
            # cronsim reads a seconds field first (Quartz's habit) but keeps a DST night's
            # rules for five fields only: '0 30 1 * * *' ran twice the night New York's clocks
            # went back, and '0 30 2 * * *' not at all the night they went forward (review
            # helper-201).
            raise WorkQueueConfigurationError(
                f"{where}: cron {schedule.cron!r} has six fields; slots are whole minutes: use "
                "five fields, minute hour day-of-month month day-of-week, e.g. '0 3 * * *'."
            )
        try:
            CronSim(schedule.cron, dt.datetime.now(zone))
        except (CronSimError, TypeError) as exc:
            raise WorkQueueConfigurationError(
                f"{where}: cron {schedule.cron!r} is not a cron expression ({exc}); use five "
                "fields, minute hour day-of-month month day-of-week, e.g. '0 3 * * *'."
            ) from None
        problem = message_problem(
            OutgoingMessage(
                payload=schedule.payload,
                partition_key=schedule.partition_key,
                attributes=schedule.attributes,
                priority=schedule.priority,
            )
        )
        if problem is not None:
            raise WorkQueueConfigurationError(
                f"{where}: its slots could never be published ({problem}); change the entry's "
                "payload, partition_key, attributes or priority."
            )
        schedules.append(schedule)
    return schedules


def _task_entry(entry: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A schedule entry that names a Tasks API task (``task``, optional ``args`` and
    ``kwargs``), made the entry of its slots' publish: the task's queue's topic and the
    message ``task.enqueue(*args, **kwargs)`` would publish, so each slot runs the task once,
    its result readable by the slot's message id."""
    # Imported here: the Tasks API is needed only by schedules that name a task.
    from django.utils.module_loading import import_string

    from workqueue.tasks import WorkQueueBackend, api
    from workqueue.tasks.messages import TaskMessage, topic_name

    clashing = sorted({"topic", "payload", "partition_key", "attributes"} & set(entry))
    if clashing:
        raise WorkQueueConfigurationError(
            f"{where}: a schedule of a task publishes to the task's queue with the task's "
            f"message; leave out {', '.join(clashing)}."
        )
    path = entry["task"]
    try:
        task = import_string(path) if isinstance(path, str) else None
    except ImportError as exc:
        raise WorkQueueConfigurationError(
            f"{where}: task {path!r} cannot be imported ({exc}); give the dotted path of a "
            "@task function, e.g. 'shop.tasks.send_digest'."
        ) from None
    if not isinstance(task, api.Task):
        raise WorkQueueConfigurationError(
            f"{where}: task {path!r} is not a Tasks API task: decorate the function with @task."
        )
    if not isinstance(task.get_backend(), WorkQueueBackend):
        raise WorkQueueConfigurationError(
            f"{where}: task {path!r} runs on TASKS[{task.backend!r}], which is not this work "
            "queue's backend (workqueue.tasks.WorkQueueBackend): only its tasks can be "
            "scheduled here."
        )
    args, kwargs = entry.get("args", []), entry.get("kwargs", {})
    if not isinstance(args, (list, tuple)) or not isinstance(kwargs, dict):
        # list("12") is ['1', '2']: said, not taken for arguments.
        raise WorkQueueConfigurationError(
            f"{where}: args must be a list and kwargs a dict (got {type(args).__name__} and "
            f"{type(kwargs).__name__})."
        )
    priority = entry.get("priority", task.priority)
    try:
        # The slot's delivery runs at the schedule's priority, so its result says the same.
        message = TaskMessage.enqueued(task, args, kwargs, priority=priority)
    except (TypeError, ValueError) as exc:
        raise WorkQueueConfigurationError(f"{where}: {exc}") from None
    kept = {key: value for key, value in entry.items() if key not in _TASK_KEYS}
    return {
        **kept,
        "task": task.module_path,
        "topic": topic_name(task.queue_name),
        "payload": message.to_payload(),
        "priority": priority,
    }
