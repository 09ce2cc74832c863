"""The handler that runs Tasks API tasks in the host (handler key ``workqueue.tasks``).

A run records itself (``TaskResult``), then calls the task (a coroutine through the API's own
``Task.call``, which runs it on an event loop), stores the return value and completes the
delivery, all in one transaction on the work queue's database alias (``context.complete(enlist=
True)``): the task's own database work on that alias, its SUCCESSFUL result and the completion
commit together, or not at all. A task that raises rolls its work back, has its exception
recorded and re-raised, so the executor applies the subscription's policy: retried with
backoff, dead-lettered on the last attempt. Tasks may raise ``FatalWorkError`` (dead-letter now)
or ``TransientWorkError(retry_after_seconds)`` as any handler may. A run that finds its lease
lost at completion (``LeaseLost``) keeps nothing and records no error: it was not the task's;
nor does a run that fails after another run took its delivery over (its lease ran out). A
callback the task registered with ``transaction.on_commit`` that raises runs after all of it
committed: the task succeeded, and the callback's error is logged.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, NoReturn

from django.db import DatabaseError, connections, transaction
from django.utils import timezone

from workqueue.conf import setting
from workqueue.driver import get_driver
from workqueue.exceptions import LeaseLost, UnstorableValueError
from workqueue.publishing import RUNS_A_TASK
from workqueue.runtime.context import WorkContext, WorkMessage
from workqueue.runtime.handlers import BaseWorkHandler, register_handler
from workqueue.runtime.outcome import FatalWorkError, Outcome
from workqueue.tasks import api
from workqueue.tasks.messages import (
    HANDLER_KEY,
    TaskMessage,
    build_result,
    require_json_round_trip,
    tuples_as_lists,
)
from workqueue.tasks.results import record_failure, record_start, record_success
from workqueue.tasks.signals import send
from workqueue.transport import stored_at_attempt
from workqueue.types import DeliveryStatus

logger = logging.getLogger(__name__)


@register_handler(HANDLER_KEY)
class TaskHandler(BaseWorkHandler):
    """Runs the task a ``tasks.<queue>`` message names."""

    # django_tasks logs a FAILED task's traceback (``task_finished``, at ERROR).
    logs_failures = True

    def handle(self, message: WorkMessage, context: WorkContext) -> Outcome:
        try:
            task_message = TaskMessage.from_payload(message.payload)
        except ValueError as exc:
            # Someone published by hand to a task topic: no task to run, now or later.
            raise FatalWorkError(f"Not a task message: {exc}") from exc
        result_id = message.message_id
        record = record_start(
            result_id,
            message.topic,
            context.worker_id,
            first_run=context.attempt == 1 and not context.is_replay,
        )
        try:
            task = task_message.load_task()
        except Exception as exc:
            # Retried like a failing task: a host running older code may import it later.
            _record(result_id, exc, context)
            raise
        running = build_result(
            task,
            result_id,
            task_message,
            api.TaskResultStatus.RUNNING,
            enqueued_at=message.published_at,
            record=record,
        )
        backend_class = type(task.get_backend())
        send(api.task_started, backend_class, running)
        alias = setting("DATABASE_ALIAS")
        committed = False

        def mark_committed() -> None:
            nonlocal committed
            committed = True

        # Marked: an enqueue in it joins it (the backend), and test mode does not take it for
        # a block of the code under test (publishing.PublishInsideAtomicInTestWarning).
        task_transaction = transaction.atomic(using=alias)
        setattr(task_transaction, RUNS_A_TASK, True)
        completing = False  # the block's work is done: what fails now is its commit
        try:
            with task_transaction:
                # Registered before the task's own callbacks, so it runs before any of them.
                transaction.on_commit(mark_committed, using=alias)
                value = tuples_as_lists(_call(task, running, task_message))
                if transaction.get_rollback(using=alias):
                    raise _DatabaseErrorCaughtInside()
                try:
                    require_json_round_trip(value, "The task's return value")
                except (TypeError, ValueError) as exc:
                    raise _UnusableReturnValue(exc) from exc
                try:
                    record_success(record, value)
                except DatabaseError as exc:
                    # Refused for what it is (too large for the database, say): the next run
                    # would return the same.
                    if isinstance(get_driver().translate_error(exc), UnstorableValueError):
                        raise _UnusableReturnValue(exc) from exc
                    raise
                context.complete(enlist=True)
                completing = True
        except LeaseLost:
            raise
        except BaseException as exc:
            if (
                isinstance(exc, KeyboardInterrupt)
                and threading.current_thread() is threading.main_thread()
            ):
                raise  # Ctrl-C during run_until_idle (a test), as the executor lets it through
            # SystemExit and asyncio's CancelledError too, which the executor retries like any
            # failure: unrecorded, that run left no error in the result (audit helper-133).
            if not committed and not (completing and _completed_by_this_run(context, alias)):
                _record_and_raise(result_id, exc, context)
            if committed:
                # Raised by one of the task's on_commit callbacks, after the task's work, its
                # result and its completion committed: the task succeeded.
                logger.exception(
                    "Task %s (result %s) succeeded, but a callback it registered with "
                    "transaction.on_commit raised after the commit",
                    task_message.task_path,
                    result_id,
                )
            else:
                # The commit reached the server and its answer was lost with the connection:
                # the task succeeded too, its callbacks never ran (Django saw a failed commit).
                # Taken for a failure, it sent no task_finished, though it read SUCCESSFUL
                # (audit helper-133).
                logger.warning(
                    "Task %s (result %s) succeeded: its commit raised, but reached the "
                    "database (its completion is stored); the callbacks it registered with "
                    "transaction.on_commit did not run",
                    task_message.task_path,
                    result_id,
                    exc_info=exc,
                )
        finished = build_result(
            task,
            result_id,
            task_message,
            api.TaskResultStatus.SUCCESSFUL,
            enqueued_at=message.published_at,
            # As Django's backends send it: within milliseconds of the completion's own time,
            # which get_result reads (this saves a read per task); never before the start,
            # which the database's clock dated (review helper-159: clocks apart).
            finished_at=max(timezone.now(), record.started_at) if record else timezone.now(),
            record=record,
        )
        send(api.task_finished, backend_class, finished)
        return Outcome.complete()


def _completed_by_this_run(context: WorkContext, alias: str) -> bool:
    """Whether this run's completion is stored, though its commit raised: read on a connection
    of its own (the task's is the one that failed). False when that cannot be told."""
    if not connections[alias].in_atomic_block:  # (test mode runs tasks inside the test's)
        connections[alias].close()  # broken or not: the read opens a new one
    try:
        return stored_at_attempt(
            alias, context.delivery_id, context.attempt, status=DeliveryStatus.COMPLETED
        )
    except DatabaseError:
        return False


def _record_and_raise(result_id: str, exc: BaseException, context: WorkContext) -> NoReturn:
    """Record the task's failure ``exc`` (after the rollback, on its own: the failure
    outlives the task's work) and raise what the executor settles by."""
    if isinstance(exc, _UnusableReturnValue):
        _record(result_id, exc.error, context)
        # Running it again would return the same kind of value: dead-letter it now.
        raise FatalWorkError(str(exc.error)) from exc.error
    if isinstance(exc, RuntimeError) and _is_durable_block_refusal(exc):
        explained = RuntimeError(
            f"{exc} The task runs inside the transaction that records its result and "
            "completes its delivery (so its database work commits with them), where Django "
            "refuses a durable block: use transaction.atomic() without durable=True in tasks."
        )
        explained.__cause__ = exc
        _record(result_id, explained, context)
        # Every attempt would fail the same way: dead-letter it now.
        raise FatalWorkError(str(explained)) from exc
    _record(result_id, exc, context)
    raise exc


def _record(result_id: str, error: BaseException, context: WorkContext) -> None:
    """Add ``error`` to the task's result; when that fails, log it with its traceback instead.

    The run still settles by the task's own failure (a value that cannot be stored still
    dead-letters at once): the recording's error would have taken its place, and with the
    host's dead-letter line leaving tracebacks to django_tasks (``logs_failures``), whose
    line reads the result's errors, the task's traceback would have reached no log."""
    try:
        record_failure(result_id, error, context)
    except Exception as recording_error:
        logger.error(
            "Task result %s: the task failed and its error could not be added to its result "
            "(%s: %s); the task's error follows",
            result_id,
            type(recording_error).__name__,
            str(recording_error).strip().partition("\n")[0],
            exc_info=error,
        )


class _DatabaseErrorCaughtInside(RuntimeError):
    """The task returned after catching a database error that its transaction cannot outlive
    (Django marks the block for rollback): the result's update would fail with "You can't
    execute queries until the end of the 'atomic' block", which names neither the cause nor
    the fix (review helper-192)."""

    def __init__(self) -> None:
        super().__init__(
            "The task caught a database error (an IntegrityError, say) inside the transaction "
            "the work queue runs it in, which records its result and completes its delivery "
            "so that its database work commits with them: after such an error the database "
            "refuses every further statement of the transaction, so neither its work nor its "
            "result can commit. Put the statement that may fail in a transaction.atomic() "
            "block of its own inside the try (a savepoint: only that statement is rolled "
            "back), as Django advises for any atomic block."
        )


class _UnusableReturnValue(Exception):
    """The task returned a value that does not round-trip through JSON."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _is_durable_block_refusal(exc: RuntimeError) -> bool:
    # Django's own words (django.db.transaction.Atomic.__enter__); it has no exception class.
    return "durable atomic block cannot be nested" in str(exc)


def _call(task: api.Task, running: api.TaskResult, message: TaskMessage) -> Any:
    if task.takes_context:
        return task.call(api.TaskContext(task_result=running), *message.args, **message.kwargs)
    return task.call(*message.args, **message.kwargs)
