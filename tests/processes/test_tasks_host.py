"""Django's Tasks API end to end: tasks enqueued here (``TASKS`` names
``workqueue.tasks.WorkQueueBackend`` in the project's settings) run in a real
``manage.py workqueue_host`` process that has no task configuration of its own, and their
results are read back here and from a third process.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from functools import partial
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from tests.support.processes import Processes
from tests.support.waiting import wait_until
from tests.task_functions import (
    add,
    always_fails,
    describe_context,
    fails_on_first_attempt,
    multiply_later,
    user_exists,
)
from workqueue.models import Delivery, HostRecord, Message, Subscription
from workqueue.tasks.api import TaskResultStatus, default_task_backend

pytestmark = [pytest.mark.processes, pytest.mark.usefixtures("queue_db")]

QUEUE = "tasks.default"


@pytest.fixture
def processes(processes: Processes) -> Processes:
    """The suite's ``processes``, with queue "default" as the backend creates it and a quick
    retry policy set the way an operator would: three attempts, no backoff."""
    default_task_backend.ensure_queue("default")
    Subscription.objects.filter(name=QUEUE).update(
        max_attempts=3, backoff_base_seconds=0, backoff_max_seconds=1
    )
    return processes


def finished(result_id: str, timeout: float = 30) -> Any:
    return wait_until(
        lambda: (r := default_task_backend.get_result(result_id)).is_finished and r, timeout
    )


def read_in_another_process(processes: Processes, result_id: str) -> dict[str, Any]:
    script = (
        "import json; from workqueue.tasks.api import default_task_backend as b; "
        f"r = b.get_result({result_id!r}); "
        "print(json.dumps({'status': r.status, 'task': r.task.module_path, 'args': r.args, "
        "'return_value': r.return_value if r.status == 'SUCCESSFUL' else None, "
        "'attempts': r.attempts, 'worker_ids': r.worker_ids, "
        "'errors': [[e.exception_class.__name__, e.traceback] for e in r.errors], "
        "'finished_at': r.finished_at.isoformat() if r.finished_at else None}))"
    )
    done = processes.run("shell", "-v", "0", "-c", script)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_enqueued_task_runs_in_a_host_process_and_reads_successful_with_its_return_value(
    processes,
):
    result = add.enqueue(2, 3)
    assert result.status == TaskResultStatus.READY
    assert default_task_backend.get_result(result.id).status == TaskResultStatus.READY

    host = processes.host(QUEUE)
    done = finished(result.id)

    assert done.status == TaskResultStatus.SUCCESSFUL
    assert done.return_value == 5
    assert done.args == [2, 3] and done.kwargs == {}
    assert done.errors == []
    record = HostRecord.objects.get(pid=host.pid)
    assert done.worker_ids == [record.instance_id] and done.attempts == 1
    assert "workqueue.tasks" in record.handler_keys  # registered by the app, not the settings
    assert done.enqueued_at <= done.started_at <= done.last_attempted_at <= done.finished_at
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == 5

    elsewhere = read_in_another_process(processes, result.id)
    assert elsewhere["status"] == "SUCCESSFUL" and elsewhere["return_value"] == 5
    assert elsewhere["task"] == "tests.task_functions.add" and elsewhere["args"] == [2, 3]
    assert elsewhere["worker_ids"] == [record.instance_id]


def test_a_host_runs_higher_priorities_first_and_a_deferred_task_not_before_run_after(
    processes,
):
    # Enqueued before any host runs; one handler thread, so the start order is the claim order.
    low = add.using(priority=-10).enqueue(1, 0)
    high = add.using(priority=50).enqueue(2, 0)
    middle = add.enqueue(3, 0)
    # The highest priority of all: were run_after ignored, it would run first, at once.
    run_after = timezone.now() + dt.timedelta(seconds=5)
    deferred = add.using(run_after=run_after, priority=100).enqueue(4, 0)

    processes.host(QUEUE, concurrency=1)
    done = [finished(r.id) for r in (high, middle, low)]

    assert [r.return_value for r in sorted(done, key=lambda r: r.started_at)] == [2, 3, 1]
    ran = finished(deferred.id)
    assert ran.return_value == 4 and ran.started_at >= run_after
    assert ran.task.run_after == run_after and ran.task.priority == 100


def test_a_coroutine_task_and_a_task_taking_its_context_run_in_the_host(processes):
    coroutine = multiply_later.enqueue(6, y=7)
    with_context = describe_context.enqueue("hello")
    processes.host(QUEUE)

    assert finished(coroutine.id).return_value == 42
    described = finished(with_context.id).return_value
    assert described == {
        "label": "hello",
        "attempt": 1,
        "result_id": with_context.id,
        "status": "RUNNING",
        "args": ["hello"],
    }


def test_a_raising_task_is_retried_by_the_subscription_and_reads_failed_only_once_dead_lettered(
    processes,
):
    failing = always_fails.enqueue("boom")
    flaky = fails_on_first_attempt.enqueue()
    processes.host(QUEUE)

    seen: list[tuple[str, str]] = []

    def failed() -> bool:
        status = default_task_backend.get_result(failing.id).status
        delivery = Delivery.objects.get(message_id=failing.id).status
        seen.append((status, delivery))
        return status == TaskResultStatus.FAILED

    wait_until(failed, timeout=30, interval=0.005)
    # FAILED appears only with the dead letter; before it, failed runs read READY or RUNNING.
    assert {s for s, d in seen if d != "DeadLettered"} <= {"READY", "RUNNING"}
    assert all(d == "DeadLettered" for s, d in seen if s == "FAILED")
    result = default_task_backend.get_result(failing.id)
    assert result.attempts == 3 and len(result.errors) == 3
    for error in result.errors:
        assert error.exception_class is ValueError
        assert "in always_fails" in error.traceback and "ValueError: boom" in error.traceback
    with pytest.raises(ValueError, match="Task failed"):
        _ = result.return_value
    delivery = Delivery.objects.get(message_id=failing.id)
    assert delivery.dead_letter_reason == "MaxAttemptsExceeded"
    assert result.finished_at == delivery.dead_lettered_at

    # A failure that is retried and then succeeds ends SUCCESSFUL, its failure kept.
    recovered = finished(flaky.id)
    assert recovered.status == TaskResultStatus.SUCCESSFUL and recovered.return_value == 2
    assert [e.exception_class for e in recovered.errors] == [RuntimeError]

    elsewhere = read_in_another_process(processes, failing.id)
    assert elsewhere["status"] == "FAILED" and elsewhere["attempts"] == 3
    assert [name for name, _ in elsewhere["errors"]] == ["ValueError"] * 3
    assert "ValueError: boom" in elsewhere["errors"][0][1]


def test_operators_replay_a_failed_task_with_the_usual_commands(processes):
    failing = always_fails.enqueue("again")
    processes.host(QUEUE)
    finished(failing.id)

    listed = processes.run("workqueue", "dead-letters", "-s", QUEUE, "--json")
    assert listed.returncode == 0, listed.stderr
    (item,) = json.loads(listed.stdout)["items"]
    assert item["message_id"] == failing.id

    replay = processes.run("workqueue", "replay", "-s", QUEUE, "--delivery", item["delivery_id"])
    assert replay.returncode == 0, replay.stderr
    # Replayed: waiting or running again, then FAILED after three more attempts.
    wait_until(lambda: default_task_backend.get_result(failing.id).attempts == 6, timeout=30)
    again = finished(failing.id)
    assert again.status == TaskResultStatus.FAILED and len(again.errors) == 6


def test_enqueue_on_commit_runs_the_task_after_the_commit_and_never_after_a_rollback(processes):
    """The Tasks API's way: ``transaction.on_commit(partial(task.enqueue, ...))``. A bare
    ``enqueue()`` in a transaction is published at once, on the queue's own connection."""
    processes.host(QUEUE)
    users = get_user_model().objects
    on_tasks_topic = Message.objects.filter(topic__name=QUEUE)

    with transaction.atomic():
        users.create_user("made-in-the-transaction")
        transaction.on_commit(partial(user_exists.enqueue, "made-in-the-transaction"))
        time.sleep(0.3)  # a host that saw the task now would run it before the commit
        assert not on_tasks_topic.exists()
    (committed,) = on_tasks_topic.values_list("id", flat=True)
    assert finished(str(committed)).return_value is True  # the task saw the committed row

    with pytest.raises(RuntimeError), transaction.atomic():
        users.create_user("rolled-back")
        transaction.on_commit(partial(user_exists.enqueue, "rolled-back"))
        raise RuntimeError("roll back")
    assert on_tasks_topic.count() == 1  # nothing was enqueued

    with pytest.raises(RuntimeError), transaction.atomic():
        users.create_user("never-committed")
        bare = user_exists.enqueue("never-committed")
        raise RuntimeError("roll back")
    assert finished(bare.id).return_value is False  # published and run whatever the caller did
