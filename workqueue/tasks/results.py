"""Reading a task's result from any process, and the host's writes to its ``TaskResult`` row.
See ``workqueue.tasks.messages`` for where each fact of a result comes from."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from django.db import IntegrityError, connections, transaction
from django.db.models.functions import Now

from workqueue.conf import setting
from workqueue.driver.base import CanonicalJSONEncoder
from workqueue.models import Delivery, TaskResult
from workqueue.runtime.executor import describe_error
from workqueue.tasks import api
from workqueue.tasks.messages import (
    HANDLER_KEY,
    STATUS_BY_DELIVERY,
    TaskMessage,
    build_result,
    unloadable_task,
)
from workqueue.types import DeliveryStatus

if TYPE_CHECKING:
    from workqueue.runtime.context import WorkContext


def read_result(result_id: str) -> api.TaskResult:
    """The task result ``result_id`` as it stands now, from any process."""
    try:
        message_id = uuid.UUID(str(result_id))
    except ValueError:
        raise api.TaskResultDoesNotExist(result_id) from None
    alias = setting("DATABASE_ALIAS")
    delivery = (
        Delivery.objects.using(alias)
        .select_related("message")
        .filter(message_id=message_id, subscription__handler_key=HANDLER_KEY)
        .first()
    )
    if delivery is None:
        raise api.TaskResultDoesNotExist(result_id)
    # Read after the delivery: the host writes the return value in the transaction that
    # completes the delivery, so a Completed delivery always finds it here.
    record = TaskResult.objects.using(alias).filter(pk=message_id).first()
    try:
        message = TaskMessage.from_payload(delivery.message.payload)
    except ValueError:
        raise api.TaskResultDoesNotExist(result_id) from None
    finished_at = {
        DeliveryStatus.COMPLETED: delivery.completed_at,
        DeliveryStatus.DISCARDED: delivery.completed_at,
        DeliveryStatus.DEAD_LETTERED: delivery.dead_lettered_at,
    }.get(delivery.status)
    try:
        task = message.load_task()
    except Exception as exc:
        # Renamed or removed by a later deploy (or its queue or backend since unconfigured):
        # the result stays readable, around a stand-in that names the task.
        task = unloadable_task(message, exc)
    return build_result(
        task,
        str(message_id),
        message,
        STATUS_BY_DELIVERY[delivery.status],
        enqueued_at=delivery.message.published_at,
        finished_at=finished_at,
        record=record,
    )


# -- written by the host ----------------------------------------------------------------------


def record_start(result_id: str, topic: str, worker_id: str, *, first_run: bool) -> TaskResult:
    """Count a run, committed before the task runs: the first sets ``started_at``; each sets
    ``last_attempted_at`` (database clock, like ``published_at``) and adds its worker id.
    ``topic`` (the task's queue's topic, by name) decides when the sweeper reaps the row.

    A ``first_run`` (first attempt, not a replay) normally finds no row and inserts it in one
    statement, the insert returning the database's times; an earlier run's row (a lease that
    expired before the attempt was counted) sends it down the locked path every later run takes.
    Every statement goes to the work queue's alias, the one its delivery is settled on (a
    project's router might send the model elsewhere, or only reads there).
    """
    alias = setting("DATABASE_ALIAS")
    results = TaskResult.objects.db_manager(alias)
    if first_run:
        # Outside a transaction the INSERT commits on its own (no BEGIN round trip); inside one
        # (a test's), a savepoint keeps the caller's transaction usable after a clash.
        in_transaction = transaction.get_connection(alias).in_atomic_block
        try:
            with transaction.atomic(using=alias) if in_transaction else nullcontext():
                return results.create(pk=result_id, topic=topic, worker_ids=[worker_id])
        except IntegrityError:
            pass
    with transaction.atomic(using=alias):
        record, _ = results.select_for_update().get_or_create(
            pk=result_id, defaults={"topic": topic}
        )
        results.filter(pk=result_id).update(
            last_attempted_at=Now(), worker_ids=[*record.worker_ids, worker_id]
        )
    record.refresh_from_db(using=alias)
    return record


def record_failure(result_id: str, exc: BaseException, context: WorkContext) -> None:
    """Add the run's error to the result, unless the run no longer holds its delivery: its
    lease ran out and another run took the delivery over (and may have finished it), whose
    result this failure is not part of. A replay counts attempts from 1 again, so the run is
    told by its host and whether it is a replay's too (review helper-192: a run from before a
    replay wrote its error into the replay's run on another host)."""
    alias = setting("DATABASE_ALIAS")
    still_held = (
        Delivery.objects.using(alias)
        .filter(
            pk=context.delivery_id,
            status=DeliveryStatus.IN_FLIGHT,
            attempt_count=context.attempt,
            is_replay=context.is_replay,
            lease_owner=context.worker_id,
        )
        .exists()
    )
    if not still_held:
        return  # and takes no lock on the result another run may be writing
    with transaction.atomic(using=alias):
        record = TaskResult.objects.using(alias).select_for_update().get(pk=result_id)
        record.errors = [
            *record.errors,
            {
                "exception_class_path": f"{type(exc).__module__}.{type(exc).__qualname__}",
                # Kept as a delivery's error is: storable whatever the exception's text
                # (refused, it would have taken the whole record with it), and bounded.
                "traceback": describe_error(exc),
            },
        ]
        record.save(update_fields=["errors"], using=alias)


_RETURN_VALUE = TaskResult._meta.get_field("return_value")
_PRIMARY_KEY = TaskResult._meta.pk


def record_success(record: TaskResult, value: Any) -> None:
    """Store the return value (in the caller's transaction, which completes the delivery).

    One UPDATE by primary key, written out here rather than built by the ORM for every task:
    on the build machine the ORM's query building cost ~0.25 ms of CPU a task, as much as
    sending the statement. It goes to the work queue's alias, in the transaction that
    completes the delivery, and the model's own fields prepare the values as
    ``QuerySet.update`` does (None is SQL NULL)."""
    connection = connections[setting("DATABASE_ALIAS")]
    with connection.cursor() as cursor:
        cursor.execute(
            _return_value_update(connection.ops.quote_name),
            [
                # As JSONField prepares it (None is SQL NULL), written the way payloads are,
                # so that a float such as 1e23 is not read back as the integer 10**23.
                None
                if value is None
                else connection.ops.adapt_json_value(value, CanonicalJSONEncoder),
                _PRIMARY_KEY.get_db_prep_save(record.pk, connection),
            ],
        )
    record.return_value = value


def _return_value_update(quote_name: Callable[[str], str]) -> str:
    return (
        f"UPDATE {quote_name(TaskResult._meta.db_table)} "
        f"SET {quote_name(_RETURN_VALUE.column)} = %s WHERE {quote_name(_PRIMARY_KEY.column)} = %s"
    )
