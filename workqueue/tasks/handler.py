"""The handler that runs Tasks API tasks in the host, and the Tasks API's signals.

A run records itself (``TaskResult``), calls the task (a coroutine through the API's own
``Task.call``, which runs it on an event loop), and stores the return value before the delivery
is completed. A task that raises has its exception recorded and re-raised, so the executor
applies the subscription's policy: retried with backoff, dead-lettered on the last attempt.
Tasks may raise ``FatalWorkError`` (dead-letter now) or ``TransientWorkError(retry_after_seconds)``
as any handler may.
"""

from __future__ import annotations

import logging
from typing import Any

from workqueue.models import Delivery
from workqueue.runtime.context import WorkContext, WorkMessage
from workqueue.runtime.handlers import BaseWorkHandler, register_handler
from workqueue.runtime.outcome import FatalWorkError, Outcome
from workqueue.tasks import api
from workqueue.tasks.messages import (
    HANDLER_KEY,
    TaskMessage,
    build_result,
    require_json_round_trip,
)
from workqueue.tasks.results import read_result, record_failure, record_start, record_success

logger = logging.getLogger(__name__)


@register_handler(HANDLER_KEY)
class TaskHandler(BaseWorkHandler):
    """Runs the task a ``tasks.<queue>`` message names."""

    def handle(self, message: WorkMessage, context: WorkContext) -> Outcome:
        try:
            task_message = TaskMessage.from_payload(message.payload)
        except ValueError as exc:
            # Someone published by hand to a task topic: no task to run, now or later.
            raise FatalWorkError(f"Not a task message: {exc}") from exc
        result_id = message.message_id
        worker_id = (
            Delivery.objects.filter(pk=context.delivery_id)
            .values_list("lease_owner", flat=True)
            .first()
        )
        record = record_start(result_id, worker_id or "unknown")
        try:
            task = task_message.load_task()
        except Exception as exc:
            # Retried like a failing task: a host running older code may import it later.
            record_failure(result_id, exc)
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
        _send(api.task_started, backend_class, running)
        try:
            if task.takes_context:
                value = task.call(
                    api.TaskContext(task_result=running), *task_message.args, **task_message.kwargs
                )
            else:
                value = task.call(*task_message.args, **task_message.kwargs)
        except Exception as exc:
            record_failure(result_id, exc)
            raise
        try:
            require_json_round_trip(value, "The task's return value")
        except (TypeError, ValueError) as exc:
            record_failure(result_id, exc)
            # Running it again would return the same kind of value: dead-letter it now.
            raise FatalWorkError(str(exc)) from exc
        record = record_success(result_id, value)
        finished = build_result(
            task,
            result_id,
            task_message,
            api.TaskResultStatus.SUCCESSFUL,
            enqueued_at=message.published_at,
            record=record,
        )
        _send(api.task_finished, backend_class, finished)
        return Outcome.complete()


def send_task_finished_for_dead_letter(
    sender: Any, subscription_id: Any, delivery_id: str, **kwargs: Any
) -> None:
    """``workqueue.signals.dead_lettered`` receiver: a task's delivery was dead-lettered (by
    its handler's outcome, or by lease expiry on its last attempt) in this process, so the
    task has FAILED: send the Tasks API's ``task_finished``."""
    try:
        message_id = (
            Delivery.objects.filter(pk=delivery_id, subscription__handler_key=HANDLER_KEY)
            .values_list("message_id", flat=True)
            .first()
        )
        if message_id is None:
            return
        result = read_result(str(message_id))
        if result.status != api.TaskResultStatus.FAILED:
            return  # replayed meanwhile
        _send(api.task_finished, type(result.task.get_backend()), result)
    except Exception:
        # The dead letter is recorded whatever happens here; a receiver must not undo it.
        logger.exception("Could not send task_finished for dead-lettered delivery %s", delivery_id)


def _send(signal: Any, sender: type, task_result: api.TaskResult) -> None:
    # A receiver's failure is logged, not raised: it must neither fail nor re-run a task.
    for receiver, error in signal.send_robust(sender, task_result=task_result):
        if isinstance(error, Exception):
            logger.error(
                "Tasks API signal receiver %r failed for task %s",
                receiver,
                task_result.id,
                exc_info=error,
            )
