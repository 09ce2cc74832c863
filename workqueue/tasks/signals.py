"""The Tasks API's signals as the work queue sends them: ``task_enqueued`` by ``enqueue``,
``task_started`` and ``task_finished`` (SUCCESSFUL) by the host's handler around a run, and
``task_finished`` (FAILED) once a task's delivery is dead-lettered, by the receiver below."""

from __future__ import annotations

import logging
from typing import Any

from django.db import connections

from workqueue.conf import setting
from workqueue.ids import is_uuid
from workqueue.logtext import log_value
from workqueue.models import Delivery
from workqueue.tasks import api
from workqueue.tasks.messages import HANDLER_KEY
from workqueue.tasks.results import read_result

logger = logging.getLogger(__name__)


def send_task_finished_for_dead_letter(
    sender: Any, subscription_id: Any, delivery_id: str, **kwargs: Any
) -> None:
    """``workqueue.signals.dead_lettered`` receiver: a task's delivery was dead-lettered (by
    its handler's outcome, or by lease expiry on its last attempt) in this process, so the
    task has FAILED: send the Tasks API's ``task_finished``."""
    if not is_uuid(delivery_id):
        # A cloud transport's delivery (tasks run only from the queue tables, whose ids are
        # UUIDs): its id, read from the message body, is whatever a sender wrote there.
        return
    # The claim loop and the sweeper send dead_lettered from threads that do not use Django's
    # connections: one opened here is closed here, or it would outlive its thread unclosed.
    alias = setting("DATABASE_ALIAS")
    connection = connections[alias]
    opened_here = connection.connection is None
    try:
        message_id = (
            Delivery.objects.using(alias)
            .filter(pk=delivery_id, subscription__handler_key=HANDLER_KEY)
            .values_list("message_id", flat=True)
            .first()
        )
        if message_id is None:
            return
        result = read_result(str(message_id))
        if result.status != api.TaskResultStatus.FAILED:
            return  # replayed meanwhile
        try:
            raise TaskFailed(result)
        except TaskFailed:
            # Sent while the stand-in is being handled: a receiver that logs a failed task
            # with logger.exception (django_tasks's does, for error trackers) prints why.
            send(api.task_finished, type(result.task.get_backend()), result)
    except Exception:
        # The dead letter is recorded whatever happens here; a receiver must not undo it.
        logger.exception(
            "Could not send task_finished for dead-lettered delivery %s", log_value(delivery_id)
        )
    finally:
        if opened_here:
            connection.close()


class TaskFailed(Exception):
    """Stands in for the exception a task's last run raised, which is gone by the time its
    delivery is dead-lettered (the run ended, maybe in another process): its text is the
    traceback that run recorded."""

    def __init__(self, result: api.TaskResult) -> None:
        last = result.errors[-1] if result.errors else None
        detail = (
            f"{last.exception_class_path}\n{last.traceback.rstrip()}"
            if last is not None
            else "no error was recorded"
        )
        super().__init__(f"Task {result.task.module_path} (result {result.id}) failed: {detail}")


def send(signal: Any, sender: type, task_result: api.TaskResult) -> None:
    # A receiver's failure is logged, not raised: it must neither fail nor re-run a task.
    for receiver, error in signal.send_robust(sender, task_result=task_result):
        if isinstance(error, Exception):
            logger.error(
                "Tasks API signal receiver %r failed for task %s",
                receiver,
                task_result.id,
                exc_info=error,
            )
