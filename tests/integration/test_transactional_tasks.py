"""The Tasks API backend completes a task's delivery in the task's own transaction: the task's
database work, its SUCCESSFUL result and the completion commit together (a host runs them in
this process, against PostgreSQL)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import pytest
from django.db import connection

from tests.support import txn_handlers
from tests.support.hosts import running_tasks_queue
from tests.support.txn_handlers import effects
from tests.support.waiting import wait_until
from workqueue import transport
from workqueue.driver import get_driver
from workqueue.models import Delivery, Subscription, TaskResult
from workqueue.tasks.api import TaskContext, TaskResultStatus, default_task_backend, task
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")

QUEUE = "tasks.default"


def _write_effect(context: TaskContext) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {txn_handlers.EFFECT_TABLE} (message_id, delivery_id, attempt, pid) "
            "VALUES (%s, %s, %s, 0)",
            [context.task_result.id, str(uuid.uuid4()), context.attempt],
        )


@task(takes_context=True)
def writes_a_row(context: TaskContext, fail_first: bool) -> str:
    _write_effect(context)
    if context.attempt == 1 and fail_first:
        raise RuntimeError("the first attempt fails after writing")
    return f"wrote on attempt {context.attempt}"


@task(takes_context=True)
def writes_a_row_and_loses_its_lease(context: TaskContext) -> str:
    _write_effect(context)
    # A pause long enough for the lease to expire and another host to claim the delivery.
    subscription = Subscription.objects.get(name=QUEUE)
    get_driver().shift_time(3600, subscription_id=str(subscription.id))
    transport.expire_leases_all()
    assert Receiver(subscription.id, "host-b").receive(1).deliveries
    return "never kept"


@pytest.fixture
def host() -> Iterator[None]:
    txn_handlers.create_effect_table()
    try:
        with running_tasks_queue():
            yield
    finally:
        txn_handlers.drop_effect_table()


def test_a_tasks_work_and_its_successful_result_commit_with_the_completion(host):
    result = writes_a_row.enqueue(fail_first=True)

    done = wait_until(lambda: (r := default_task_backend.get_result(result.id)).is_finished and r)

    assert done.status == TaskResultStatus.SUCCESSFUL
    assert done.return_value == "wrote on attempt 2"
    assert [e.exception_class for e in done.errors] == [RuntimeError]
    assert effects(result.id) == [(result.id, 2)]  # the failed attempt's row rolled back


def test_a_task_that_lost_its_lease_keeps_neither_its_work_nor_its_result(host, caplog):
    with caplog.at_level(logging.ERROR, "workqueue.deliveries"):
        result = writes_a_row_and_loses_its_lease.enqueue()
        # The run finished: refused at completion, it rolled back and recorded nothing.
        wait_until(lambda: "Lease lost" in caplog.text)

    assert effects(result.id) == []
    record = TaskResult.objects.get(pk=result.id)
    assert record.return_value is None and record.errors == []
    assert default_task_backend.get_result(result.id).status == TaskResultStatus.RUNNING
    delivery = Delivery.objects.get(message_id=result.id)
    assert (delivery.status, delivery.lease_owner) == ("InFlight", "host-b")
