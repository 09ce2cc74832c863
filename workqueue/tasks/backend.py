"""``WorkQueueBackend``: Django's Tasks API on the durable queue.

Each enqueued task is one message published to topic ``tasks.<queue>``; subscription
``tasks.<queue>`` (handler key ``workqueue.tasks``) runs it in ``manage.py workqueue_host``.
Both are created on first use, as ordinary topology, so the operator CLI, REST API and admin
work on tasks unchanged (stats, dead letters, replay, discard), and the subscription's own
retry and dead-letter policy decides what happens when a task raises. No second queue, retry
policy or status: a result's status is its delivery's.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from django.core import checks
from django.core.exceptions import ValidationError
from django.db import ProgrammingError, connections, transaction
from django.utils import timezone
from django.utils.asyncio import async_unsafe

from workqueue.conf import get_settings
from workqueue.exceptions import (
    TransientDriverError,
    WorkQueueConfigurationError,
    WorkQueueError,
)
from workqueue.tasks import api
from workqueue.tasks.messages import (
    HANDLER_KEY,
    TaskMessage,
    build_result,
    topic_name,
)
from workqueue.types import PublishErrorCode, PublishResult, SubscriptionStatus

logger = logging.getLogger(__name__)

#: (queue's subscription name, the name of the one that runs it instead) said this process.
_RUNNERS_UNDER_OTHER_NAMES: set[tuple[str, str]] = set()

#: Subscription fields ``OPTIONS["SUBSCRIPTION"]`` may set for the subscriptions the backend
#: creates (later changes are the operator's, in the admin; the backend never updates them).
SUBSCRIPTION_OPTIONS = frozenset(
    {
        "max_attempts",
        "backoff_base_seconds",
        "backoff_max_seconds",
        "lease_seconds",
        "max_processing_seconds",
    }
)


T = TypeVar("T")


class TaskEnqueueError(WorkQueueError):
    """The queue refused a task's message (the text says why: a disabled topic, a payload over
    the topic's ``max_payload_bytes``, a database that stayed unavailable, ...)."""


class WorkQueueBackend(api.BaseTaskBackend):
    """``TASKS = {"default": {"BACKEND": "workqueue.tasks.WorkQueueBackend"}}``.

    ``QUEUES`` (default ``["default"]``) name the queues; queue ``q`` is topic and subscription
    ``tasks.q``, so queue names follow topic names (lower-case words joined by ``.``, ``_`` or
    ``-``). ``OPTIONS = {"SUBSCRIPTION": {"max_attempts": 3, ...}}`` sets the retry policy of the
    subscriptions the backend creates.
    """

    # run_after is the message's not_before and the task's priority its priority: the
    # delivery is not claimed before run_after, and higher priorities are claimed first.
    supports_defer = True
    supports_priority = True
    supports_async_task = True
    supports_get_result = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.subscription_options = _subscription_options(self.options.get("SUBSCRIPTION", {}))
        # Queues whose topology this process has made sure of (one check per queue), with the
        # id of the subscription that runs their tasks (None if one of that name runs others).
        self._ready_queues: dict[str, str | None] = {}

    def validate_task(self, task: api.Task) -> None:
        if task.run_after is not None and not isinstance(task.run_after, dt.datetime):
            # The API's own check calls utcoffset() on it: a timedelta ("in five minutes")
            # failed there with an AttributeError naming neither run_after nor the fix.
            raise api.InvalidTaskError(
                f"run_after must be an aware datetime, not a {type(task.run_after).__name__}: "
                "for a delay, timezone.now() + timedelta(minutes=5)."
            )
        super().validate_task(task)
        problem = _queue_name_problem(task.queue_name)
        if problem:
            raise api.InvalidTaskError(problem)
        if not isinstance(task.priority, int) or isinstance(task.priority, bool):
            # The API accepts a whole float (5.0) or a bool; a delivery's priority is an int
            # (an IntEnum member is one).
            raise api.InvalidTaskError(
                f"priority must be an int from -100 to 100; got {task.priority!r} "
                f"({type(task.priority).__name__})."
            )
        if task.run_after is not None and not timezone.is_aware(task.run_after):
            # The API checks this only with USE_TZ; the queue's due times are instants
            # whatever USE_TZ says, and a naive time names none.
            raise api.InvalidTaskError(
                "run_after must be an aware datetime (with its UTC offset): the work queue "
                "schedules by instant, e.g. timezone.now() + timedelta(minutes=5) with "
                "USE_TZ = True, or datetime.now(timezone.utc) + ..."
            )

    # From an async context (a coroutine task, an async view) the thread's Django connection
    # is not the one its transaction runs on: a task's plain enqueue() published at once, and a
    # failed run left a copy (audit helper-133). ``aenqueue`` runs this on the sync thread.
    @async_unsafe(
        "Task.enqueue() cannot be called from an async context (a coroutine task, an async "
        "view): use `await task.aenqueue(...)`, which joins a running task's transaction."
    )
    def enqueue(self, task: api.Task, args: Any, kwargs: Any) -> api.TaskResult:
        """Publish the task as one message on ``tasks.<queue>`` and return its READY result.

        The publish commits at once on the work queue's own connection, inside a
        ``transaction.atomic()`` or not, as the Tasks API defines ``enqueue``. To enqueue only
        if (and once) your transaction commits, enqueue from
        ``transaction.on_commit(functools.partial(task.enqueue, ...))``. An enqueue made by a
        running task is the exception: it joins the transaction the task runs in, and is
        published with the task's writes and result, or not at all.
        """
        from workqueue.publishing import rejections_reported_by_caller

        self.validate_task(task)
        message = TaskMessage.enqueued(task, args, kwargs, run_after=task.run_after)
        # Not logged as rejections: an enqueue not accepted raises below, saying why.
        with rejections_reported_by_caller():
            published = self._publish(message)
            if published.error is not None and published.error.code == (
                PublishErrorCode.TOPIC_NOT_FOUND
            ):
                # The topic went away since this process created it (an operator deleted it,
                # or a test flushed the database): create it again, once.
                self._ready_queues.pop(task.queue_name, None)
                published = self._publish(message)
        # The message's id is made by the publish rather than chosen here, so that a publish
        # whose first answer was lost and that found its message stored when sent again is
        # Accepted, not a Duplicate of itself (which would read as not enqueued, and a caller
        # retrying would run the task twice).
        if not published.accepted:
            error = published.error
            reason = f"{error.code}: {error.message}" if error else published.status
            if error is not None and error.code == PublishErrorCode.INVALID_SCHEDULE:
                reason += _run_after_advice(task.queue_name)
            raise TaskEnqueueError(
                f"The task {task.module_path} was not enqueued on topic "
                f"{topic_name(task.queue_name)}: {reason}"
            )
        delivered_to = published.delivered_to
        if delivered_to is not None and not delivered_to:
            delivered = False  # no subscription took it
        elif delivered_to is not None and self._ready_queues.get(task.queue_name) in delivered_to:
            delivered = True  # the queue's task subscription took it
        else:
            # The transport cannot tell, or another subscription of the topic took it (or the
            # queue's subscription was made again by another process): asked.
            delivered = _has_a_task_delivery(published.message_id)
        if not delivered:
            # Stored, but no subscription took it (a message with no delivery is purged as an
            # orphan): the task would never run and no result would ever be found. The queue
            # is made sure of again at the next enqueue (a deleted subscription made anew).
            self._ready_queues.pop(task.queue_name, None)
            raise TaskEnqueueError(
                f"The task {task.module_path} was not enqueued: no subscription of topic "
                f"{topic_name(task.queue_name)} runs tasks "
                f"({_why_no_subscription_runs(task.queue_name)})."
            )
        # The task's result id is its message's id: time-ordered, like every message id.
        result_id = str(published.message_id)
        result = build_result(
            task,
            result_id,
            message,
            api.TaskResultStatus.READY,
            enqueued_at=timezone.now(),
        )
        # Imported here: they read models or reach the driver (see get_result, _publish).
        from workqueue.publishing import RUNS_A_TASK
        from workqueue.tasks.signals import send

        # The task is queued whatever a receiver does: its failure is logged, not raised, so
        # a caller never enqueues the task twice because a receiver failed.
        announce = functools.partial(send, api.task_enqueued, type(self), result)
        alias = get_settings().DATABASE_ALIAS
        blocks = connections[alias].atomic_blocks
        if blocks and getattr(blocks[0], RUNS_A_TASK, False):
            # Enlisted in the transaction of a running task, which commits on its own: enqueued
            # only if that commits (told at once, receivers heard of follow-ups a failed run
            # took back: audit helper-133).
            transaction.on_commit(announce, using=alias)
        else:
            # Published already, or enlisted in a task run inside a test's transaction (test
            # mode), whose commit never comes (review helper-135).
            announce()
        return result

    def get_result(self, result_id: str) -> api.TaskResult:
        """The result as it stands now (status from the task's delivery), from any process."""
        # Imported here: it reads models, which may not be ready when TASKS is first loaded.
        from workqueue.tasks.results import read_result

        try:
            return read_result(result_id)
        except api.TaskResultDoesNotExist:
            if not connections[get_settings().DATABASE_ALIAS].in_atomic_block:
                raise
            # The caller's transaction may read from a snapshot taken before the task's
            # publish committed (REPEATABLE READ, SERIALIZABLE): the result enqueue() had just
            # returned "did not exist" (audit helper-133). Read again outside it, as enqueue
            # itself asks.
            return _on_a_connection_of_its_own(read_result, result_id)

    def ensure_queue(self, queue_name: str) -> None:
        """Create topic and subscription ``tasks.<queue_name>`` if missing; leave existing ones
        as they are. ``enqueue`` does this once per queue and process; call it to create them
        before any task is enqueued (e.g. so a host started with ``-s tasks.<queue>`` finds
        its subscription)."""
        problem = _queue_name_problem(queue_name)
        if problem:
            raise api.InvalidTaskError(problem)
        # Imported here: the backend is built at a @task's import, before the driver loads.
        from workqueue.driver.base import routed_to_django_connection

        alias = get_settings().DATABASE_ALIAS
        try:
            if routed_to_django_connection(alias):
                # Test mode: the publish runs in the caller's transaction, so the topic and
                # subscription are made there, in a savepoint as every queue call of test
                # mode, and go with the test's rollback like everything else the queue wrote.
                with transaction.atomic(using=alias):
                    runner = _create_topology(queue_name, self.subscription_options)
            elif connections[alias].in_atomic_block:
                # The caller's transaction must not hold the new topic: the publish runs on the
                # queue's own connection and would not see it (and a rollback would undo it). A
                # thread has a connection of its own, in autocommit.
                runner = _on_a_connection_of_its_own(
                    _create_topology, queue_name, self.subscription_options
                )
            else:
                runner = _create_topology(queue_name, self.subscription_options)
        except ProgrammingError as exc:
            # Imported here: the backend is built at a @task's import, before the runtime.
            from workqueue.runtime.process import unmigrated_problem

            if (unmigrated := unmigrated_problem(exc)) is not None:
                # Its tables missing: the privilege advice below sent a user after grants.
                raise TaskEnqueueError(unmigrated) from exc
            # Most often a role without the right to write topology (the runtime grant gives
            # none) meeting a queue nobody has created yet: the database's words alone do not
            # say that this is a one-off, nor how to do it.
            raise TaskEnqueueError(
                f"Queue {queue_name!r} needs its topic and subscription "
                f"{topic_name(queue_name)!r}, and creating them failed: {exc}. If the database "
                "refused for lack of privilege: a role that may not write the topology tables "
                "(the runtime grant gives none) cannot create a queue; create it once as a role "
                "that may (the tables' owner), e.g. in a deploy step: python manage.py shell -c "
                f'"from {api.MODULE} import task_backends; task_backends[{self.alias!r}]'
                f'.ensure_queue({queue_name!r})"'
            ) from exc
        self._ready_queues[queue_name] = runner

    def check(self, **kwargs: Any) -> Iterable[checks.CheckMessage]:
        yield from super().check(**kwargs)
        for queue_name in sorted(self.queues, key=repr):  # not all text, perhaps
            problem = _queue_name_problem(queue_name)
            if problem:
                yield checks.Error(
                    f"TASKS[{self.alias!r}]['QUEUES']: {problem}",
                    hint="Rename the queue; queue q runs on topic and subscription tasks.q.",
                    id="workqueue.E004",
                )
        yield from self._subscription_option_errors()

    def subscription_option_drift(self) -> Iterable[checks.CheckMessage]:
        """A queue's subscription that differs from OPTIONS['SUBSCRIPTION']: the options apply
        when the backend makes a queue, once, and a later change to them did nothing, without
        a word. A database check (``workqueue.checks.check_task_queue_drift``): the API's own
        check of the backends is not given the databases to read."""
        # Imported here: the backend is built when a @task decorator runs, before models load.
        from django.db import DatabaseError

        from workqueue.models import Subscription

        if not self.subscription_options:
            return
        names = [topic_name(queue) for queue in sorted(self.queues)]
        try:
            stored = list(
                Subscription.objects.filter(name__in=names).values(
                    "name", *self.subscription_options
                )
            )
        except DatabaseError:
            return  # not migrated yet: other checks say so
        where = f"TASKS[{self.alias!r}]['OPTIONS']['SUBSCRIPTION']"
        for row in stored:
            differing = [
                f"{field} {row[field]!r} (the option: {value!r})"
                for field, value in sorted(self.subscription_options.items())
                if row[field] != value
            ]
            if differing:
                yield checks.Warning(
                    f"Subscription {row['name']} differs from {where}: "
                    f"{'; '.join(differing)}. The options apply when the backend makes a "
                    "queue, once; a queue made before the change keeps what it was made with.",
                    hint="Change the subscription in the admin (or WORKQUEUE['TOPOLOGY'] and "
                    "`manage.py workqueue sync-topology`), or the option back.",
                    id="workqueue.W008",
                )

    def _subscription_option_errors(self) -> Iterable[checks.CheckMessage]:
        """Values of OPTIONS['SUBSCRIPTION'] a queue's subscription could not be saved with:
        told by ``manage.py check``, not by the first ``enqueue`` to each queue."""
        # Imported here: the backend is built when a @task decorator runs, before models load.
        from workqueue.models import Subscription

        where = f"TASKS[{self.alias!r}]['OPTIONS']['SUBSCRIPTION']"
        defaults = Subscription()
        valid = True
        for name, value in sorted(self.subscription_options.items()):
            try:
                setattr(defaults, name, Subscription._meta.get_field(name).clean(value, defaults))
            except ValidationError as exc:
                valid = False
                yield checks.Error(
                    f"{where}[{name!r}] is {value!r}: {' '.join(exc.messages)}",
                    hint="Set a value the subscription's field takes (see the README's "
                    "subscription settings), or leave the option out for its default.",
                    id="workqueue.E007",
                )
        if valid and defaults.backoff_max_seconds < defaults.backoff_base_seconds:
            yield checks.Error(
                f"{where}: backoff_max_seconds ({defaults.backoff_max_seconds}) is less than "
                f"backoff_base_seconds ({defaults.backoff_base_seconds}).",
                hint="Raise backoff_max_seconds or lower backoff_base_seconds.",
                id="workqueue.E007",
            )

    def _publish(self, message: TaskMessage) -> PublishResult:
        # Imported here: publishing reaches the driver, which this module must not load at
        # import time (the backend is built when a @task decorator runs, at module import).
        from workqueue.driver.base import routed_to_django_connection
        from workqueue.publishing import publish, running_a_task

        alias = get_settings().DATABASE_ALIAS
        # In test mode a rollback (the test's, or a block's inside it) may have taken the
        # queue's topology since it was made, or only its subscription: made sure of at every
        # enqueue there (two reads), where a process otherwise does it once per queue.
        if message.queue_name not in self._ready_queues or routed_to_django_connection(alias):
            self.ensure_queue(message.queue_name)
        publishing = functools.partial(
            publish,
            topic_name(message.queue_name),
            message.to_payload(),
            not_before=message.run_after,
            priority=message.priority,
        )
        if not running_a_task(alias):
            return publishing()
        # Enqueued by a running task: published in its transaction, so with its writes and
        # result, or not at all. Sent at once, the follow-up could run before the task's rows
        # were committed (and not see them), and a task that then failed left a copy each run.
        # In a savepoint: a publish the database refuses (a lock timeout) must not leave the
        # task's whole transaction aborted, only this enqueue failed.
        try:
            with transaction.atomic(using=alias):
                return publishing(enlist=True)
        except WorkQueueError as exc:
            retry = (
                " (it may succeed if tried again)" if isinstance(exc, TransientDriverError) else ""
            )
            raise TaskEnqueueError(
                f"The task {message.task_path} was not enqueued on topic "
                f"{topic_name(message.queue_name)}: {exc}{retry}"
            ) from exc


def _run_after_advice(queue_name: str) -> str:
    """What to do about a ``run_after`` the queue's topic refused: name its limit and how to
    raise it (it said only "at most the topic's retention_days ahead")."""
    from workqueue.models import Topic

    name = topic_name(queue_name)
    days = Topic.objects.filter(name=name).values_list("retention_days", flat=True).first()
    limit = f"{days} day{'' if days == 1 else 's'}" if days is not None else "its retention_days"
    return (
        f" A task's run_after may be at most {limit} ahead on this queue: raise "
        f"retention_days of topic {name} (the admin, or WORKQUEUE['TOPOLOGY']['topics'] and "
        "`manage.py workqueue sync-topology`), or enqueue nearer the time."
    )


def _subscription_options(options: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(options) - SUBSCRIPTION_OPTIONS)
    if unknown:
        raise WorkQueueConfigurationError(
            f"TASKS OPTIONS['SUBSCRIPTION'] has unknown key(s) {', '.join(unknown)}; it may set "
            f"{', '.join(sorted(SUBSCRIPTION_OPTIONS))}."
        )
    return dict(options)


def _has_a_task_delivery(message_id: str | None) -> bool:
    """Whether the message (committed on the queue's own connection) got a delivery that runs
    it as a task."""
    from workqueue.models import Delivery

    alias = get_settings().DATABASE_ALIAS

    def found() -> bool:
        return (
            Delivery.objects.using(alias)
            .filter(message_id=message_id, subscription__handler_key=HANDLER_KEY)
            .exists()
        )

    if found():
        return True
    if not connections[alias].in_atomic_block:
        return False
    # The caller's transaction may read from a snapshot taken before the publish committed
    # (REPEATABLE READ, SERIALIZABLE): asked again outside it.
    return _on_a_connection_of_its_own(found)


def _on_a_connection_of_its_own(run: Callable[..., T], *args: Any) -> T:
    """``run(*args)`` outside the caller's transaction: on a thread, whose connections are its
    own and in autocommit (closed when it is done)."""

    def on_the_thread() -> T:
        try:
            return run(*args)
        finally:
            connections.close_all()

    with ThreadPoolExecutor(1, thread_name_prefix="wq-tasks") as pool:
        return pool.submit(on_the_thread).result()


def _why_no_subscription_runs(queue_name: str) -> str:
    from workqueue.models import Subscription

    name = topic_name(queue_name)
    found = (
        Subscription.objects.using(get_settings().DATABASE_ALIAS)
        .filter(name=name)
        .values_list("status", flat=True)
        .first()
    )
    if found is None:
        return f"its subscription {name!r} was deleted; it is created again for the next task"
    if found == "Disabled":
        return (
            f"its subscription {name!r} is Disabled, and a Disabled subscription receives "
            "nothing: enable it, or set it Paused to keep tasks waiting while nothing runs them"
        )
    return (
        f"its subscription {name!r} does not receive this task: check its filter and that "
        f"its handler key is {HANDLER_KEY!r}"
    )


def _queue_name_problem(queue_name: object) -> str | None:
    # Imported here: this module loads when TASKS is first read, perhaps before the models.
    from workqueue.models.topology import DOTTED_NAME

    if not isinstance(queue_name, str):
        # A number or null from settings read out of the environment, JSON or YAML.
        return f"Queue name {queue_name!r} is not text ({type(queue_name).__name__})."
    name = topic_name(queue_name)
    if not DOTTED_NAME.match(name) or len(name) > 200:
        return (
            f"Queue name {queue_name!r} cannot name a work-queue topic ({name!r}): use "
            "lower-case letters and digits, words joined by '.', '_' or '-', at most 194 "
            "characters."
        )
    return None


def _create_topology(queue_name: str, subscription_options: Mapping[str, Any]) -> str | None:
    """Make sure of the queue's topic and subscription; the id of the subscription if it runs
    tasks (one of that name made by hand may not)."""
    from workqueue.models import Subscription, Topic, Transport

    alias = get_settings().DATABASE_ALIAS
    name = topic_name(queue_name)
    # Read first: an existing queue costs reads only (a scheduler makes sure of its task's
    # queue at every pass, perhaps as a role that may not write the topology), and the
    # transport is looked up only for a topic to make (review helper-135: the seeded
    # transport renamed, a "Database" one was made again at each pass).
    topic = Topic.objects.db_manager(alias).select_related("transport").filter(name=name).first()
    if topic is None:
        # Seeded by the migrations; recreated here only if someone deleted it.
        transport, _ = Transport.objects.db_manager(alias).get_or_create(
            name="Database", defaults={"driver_class": "Database"}
        )
        topic, _ = Topic.objects.db_manager(alias).get_or_create(
            name=name,
            defaults={
                "transport": transport,
                "description": f"Django Tasks API queue {queue_name!r} (workqueue.tasks).",
            },
        )
    if not topic.transport.transport_class().keeps_deliveries_in_database:
        # Task results are read from this database's deliveries (workqueue.tasks.results): on
        # a transport that keeps them elsewhere the tasks would run, but no result would ever
        # be found. Refused before anything is published.
        raise TaskEnqueueError(
            f"Queue {queue_name!r} runs on topic {name!r}, which is bound to the "
            f"{topic.transport.driver_class} transport {topic.transport.name!r}. The Tasks API "
            "backend reads task results from this database's queue tables, so its topics must "
            "stay on the Database transport: bind the topic back to it (admin, or "
            "sync-topology)."
        )
    subscriptions = Subscription.objects.db_manager(alias)
    if not subscriptions.filter(name=name).exists():
        runner = (
            subscriptions.filter(topic=topic, handler_key=HANDLER_KEY)
            .exclude(status=SubscriptionStatus.DISABLED)
            .order_by("name")
            .first()
        )
        if runner is not None:
            # Renamed (to have the queue made again with new OPTIONS, say): a second one made
            # beside it would run every task twice (review helper-192).
            if (name, runner.name) not in _RUNNERS_UNDER_OTHER_NAMES:
                _RUNNERS_UNDER_OTHER_NAMES.add((name, runner.name))
                logger.warning(
                    "Queue %r is run by subscription %r, on its topic %r: %s is not made "
                    "beside it, which would run every task twice. To make it afresh (with "
                    "OPTIONS['SUBSCRIPTION'] as they are now), disable or delete %r first.",
                    queue_name,
                    runner.name,
                    name,
                    name,
                    runner.name,
                )
            return str(runner.pk)
    subscription, _ = subscriptions.get_or_create(
        name=name,
        defaults={
            "topic": topic,
            "handler_key": HANDLER_KEY,
            "description": f"Runs the tasks of queue {queue_name!r}.",
            **subscription_options,
        },
    )
    return str(subscription.pk) if subscription.handler_key == HANDLER_KEY else None
