"""The Tasks API backend at its edges (audit helper-133), a host running tasks.default in this
process: a coroutine task's plain enqueue, a run ended by a BaseException, the task_enqueued
signal of a follow-up a failed run took back, a commit whose answer was lost, and a result read
inside a REPEATABLE READ transaction."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import OperationalError, connection, transaction

from tests.factories import TopicFactory
from tests.support.hosts import running_tasks_queue
from tests.support.waiting import wait_until
from workqueue.exceptions import PublishInsideAtomicInTestWarning
from workqueue.models import Delivery, Message
from workqueue.tasks.api import (
    TaskContext,
    TaskResultStatus,
    default_task_backend,
    task,
    task_enqueued,
    task_finished,
)
from workqueue.testing import run_until_idle, use_test_connection

QUEUE = "tasks.default"


@task()
def edge_noop(label: str) -> str:
    return label


@task(takes_context=True)
def edge_enqueues_a_follow_up_then_fails_first(context: TaskContext) -> str:
    edge_noop.enqueue("follow-up")
    if context.attempt == 1:
        raise RuntimeError("the first run fails after enqueueing its follow-up")
    return "ok"


@task(takes_context=True)
def edge_exits_on_first_attempt(context: TaskContext) -> str:
    if context.attempt == 1:
        sys.exit("a command-line parser called inside the task gave up")
    return "ok"


@task(takes_context=True)
async def edge_cancelled_on_first_attempt(context: TaskContext) -> str:
    if context.attempt == 1:
        raise asyncio.CancelledError("an awaited call was cancelled")
    return "ok"


@task()
def edge_commit_answer_lost(label: str) -> str:
    """Its transaction's commit reaches the server, then the connection fails before the
    answer comes back (once), as in test_transactional_completion's lost-answer test."""
    real_commit = connection._commit

    def commits_then_fails() -> None:
        connection._commit = real_commit
        real_commit()
        raise OperationalError("server closed the connection unexpectedly (test)")

    connection._commit = commits_then_fails
    return label


@task()
def edge_warm_up() -> str:
    """Enqueues once on the host's handler thread, as any task chaining another does: the
    queue is then "ready" in that thread's backend, which a coroutine task run from the
    thread shares (django_tasks' task_backends is an asgiref Local, not thread-critical)."""
    edge_noop.enqueue("warm-up")
    return "warm"


@task(takes_context=True)
async def edge_coroutine_enqueues_then_fails_first(context: TaskContext) -> str:
    edge_noop.enqueue("follow-up from a coroutine")  # the plain call, not aenqueue
    if context.attempt == 1:
        raise RuntimeError("the first run fails after enqueueing its follow-up")
    return "ok"


@task(takes_context=True)
async def edge_coroutine_aenqueues_then_fails_first(context: TaskContext) -> str:
    await edge_noop.aenqueue("aenqueued")
    if context.attempt == 1:
        raise RuntimeError("the first run fails after enqueueing its follow-up")
    return "ok"


@pytest.fixture
def host(queue_db: None) -> Iterator[None]:
    with running_tasks_queue():
        yield


def finished(result_id: str) -> Any:
    return wait_until(lambda: (r := default_task_backend.get_result(result_id)).is_finished and r)


def test_task_enqueued_is_sent_only_for_a_follow_up_that_was_enqueued(host):
    """An enqueue made by a running task joins the task's transaction; a run that fails takes
    it back. task_enqueued was sent all the same, at the enqueue, for a task that never
    existed (its id is found by no get_result)."""
    announced: list[str] = []

    def receive(sender: Any, task_result: Any, **kwargs: Any) -> None:
        if task_result.task.name == "edge_noop":
            announced.append(task_result.id)

    task_enqueued.connect(receive)
    try:
        result = edge_enqueues_a_follow_up_then_fails_first.enqueue()
        assert finished(result.id).status == TaskResultStatus.SUCCESSFUL
        stored = [
            str(m.id)
            for m in Message.objects.filter(topic__name=QUEUE)
            if m.payload["task"] == edge_noop.module_path
        ]
        # The host announces a task's follow-ups once their transaction commits, which a
        # loaded machine may run after the task's result already reads finished.
        wait_until(lambda: set(stored) <= set(announced))
    finally:
        task_enqueued.disconnect(receive)

    assert len(stored) == 1  # the failed run's enqueue rolled back with it (as documented)
    assert announced == stored  # fails: the rolled-back follow-up was announced too


@pytest.mark.django_db
@use_test_connection()
def test_task_enqueued_is_sent_for_a_follow_up_in_test_mode():
    """Review helper-135: in test mode the task's transaction is a savepoint of the test's,
    whose commit never comes: sent on commit, a follow-up's task_enqueued was never sent."""
    from tests.task_functions import enqueues_a_follow_up

    get_user_model().objects.create_user("workqueue-system")
    default_task_backend.ensure_queue("default")
    announced: list[str] = []

    def receive(sender: Any, task_result: Any, **kwargs: Any) -> None:
        announced.append(task_result.task.name)

    task_enqueued.connect(receive)
    try:
        enqueues_a_follow_up.enqueue(1)
        run_until_idle()
    finally:
        task_enqueued.disconnect(receive)

    assert len(announced) == 2, announced


@pytest.mark.django_db
@use_test_connection()
def test_the_queue_a_first_enqueue_makes_in_test_mode_goes_with_the_tests_rollback(pg_conn):
    """Test mode promises that the test's rollback removes what the queue wrote. The topic
    and subscription a first enqueue makes for its queue were committed on a connection of
    their own instead, and stayed for every later test: a test making a topic of that name
    failed on its unique name, or not, by the order the tests ran in."""
    from tests.task_functions import add

    def committed() -> tuple[int, int]:
        return pg_conn.execute(
            "SELECT (SELECT count(*) FROM workqueue_topic WHERE name = 'tasks.default'),"
            " (SELECT count(*) FROM workqueue_subscription WHERE name = 'tasks.default')"
        ).fetchone()

    assert committed() == (0, 0)
    # A test before this one, and its rollback (told, as a publish inside atomic() is).
    with pytest.warns(PublishInsideAtomicInTestWarning), transaction.atomic():
        add.enqueue(1, 2)
        transaction.set_rollback(True)
    assert committed() == (0, 0)
    # The backend remembers the queue as made: its publish finds no topic and makes it again.
    add.enqueue(1, 2)

    assert Message.objects.filter(topic__name="tasks.default").count() == 1
    assert committed() == (0, 0)


@pytest.mark.django_db
@use_test_connection()
def test_a_queue_whose_subscription_a_rollback_took_is_made_again_in_test_mode():
    """Review helper-151: with the queue's topology made in the test's transaction, a rollback
    can take the subscription and leave a topic the test made itself (or declared); the
    backend, remembering the queue as made, published to a topic nothing subscribed to, and
    every later enqueue of the test (and of the tests after it) failed."""
    from tests.task_functions import add

    TopicFactory(name="tasks.default")
    with pytest.warns(PublishInsideAtomicInTestWarning), transaction.atomic():
        add.enqueue(1, 2)
        transaction.set_rollback(True)

    add.enqueue(1, 2)

    assert Delivery.objects.filter(subscription__name="tasks.default").count() == 1


@pytest.mark.parametrize(
    ("the_task", "exception_class_path"),
    [
        (edge_exits_on_first_attempt, "builtins.SystemExit"),
        (edge_cancelled_on_first_attempt, "asyncio.exceptions.CancelledError"),
    ],
)
def test_a_run_that_raises_a_base_exception_keeps_its_error_in_the_result(
    host, the_task, exception_class_path
):
    """The executor retries a handler that raised SystemExit or CancelledError (a
    BaseException); the task's handler records only Exception, so that failed run left no
    entry in result.errors (README: "errors (one per failed run ...)"). A task that always
    does so reads FAILED with errors == [] ("no error was recorded")."""
    result = the_task.enqueue()
    done = finished(result.id)
    assert (done.status, done.attempts) == (TaskResultStatus.SUCCESSFUL, 2)
    assert [e.exception_class_path for e in done.errors] == [exception_class_path]


def test_a_task_whose_commit_answer_was_lost_sends_task_finished_successful(host):
    """The task's transaction (its result and its completion) committed, but Django saw the
    commit fail: the handler took the task for failed (nothing recorded, the delivery no longer
    held), the executor found the completion and settled it as Completed, and
    task_finished(SUCCESSFUL) was never sent, though the task reads SUCCESSFUL."""
    seen: list[str] = []

    def receive(sender: Any, task_result: Any, **kwargs: Any) -> None:
        seen.append(str(task_result.status))

    task_finished.connect(receive)
    try:
        result = edge_commit_answer_lost.enqueue("done")
        done = finished(result.id)
        # Sent after the commit, on the host's thread.
        wait_until(lambda: seen, timeout=5)
    finally:
        task_finished.disconnect(receive)

    assert (done.status, done.return_value, done.attempts) == ("SUCCESSFUL", "done", 1)
    assert seen == ["SUCCESSFUL"]


@pytest.mark.usefixtures("queue_db")
def test_get_result_right_after_enqueue_in_a_repeatable_read_transaction():
    """enqueue publishes on the queue's own connection and asks again outside a REPEATABLE
    READ caller's snapshot before deciding the task got a delivery (fixed before); get_result
    reads from the caller's snapshot only, so the result enqueue just returned "does not
    exist" until the caller's transaction ends (and result.refresh() raises likewise)."""
    from tests.task_functions import add

    default_task_backend.ensure_queue("default")
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        cursor.execute("SELECT count(*) FROM workqueue_delivery")  # the snapshot is taken
        result = add.enqueue(1, 2)
        assert add.get_result(result.id).status == TaskResultStatus.READY


def test_a_coroutine_tasks_plain_enqueue_is_refused_every_time_naming_aenqueue(host):
    """A coroutine task runs on asgiref's event-loop thread, whose Django connection is not
    the one the task's transaction is open on: once the queue was ready in the (shared)
    backend, a plain enqueue() there published at once on the queue's own connection, before
    the task committed, and each failed run left a copy (on a thread whose backend had not
    made sure of the queue yet, the same call raised SynchronousOnlyOperation: what happened
    depended on what ran before). It is refused every time now, naming ``aenqueue``."""
    assert finished(edge_warm_up.enqueue().id).status == TaskResultStatus.SUCCESSFUL

    result = edge_coroutine_enqueues_then_fails_first.enqueue()
    done = finished(result.id)

    assert done.status == TaskResultStatus.FAILED
    assert all("aenqueue" in error.traceback for error in done.errors), done.errors
    assert not [m for m in follow_ups() if m.payload["args"] == ["follow-up from a coroutine"]]


def test_a_coroutine_tasks_aenqueue_is_published_with_the_run_that_commits(host):
    result = edge_coroutine_aenqueues_then_fails_first.enqueue()
    done = finished(result.id)

    assert (done.status, done.attempts) == (TaskResultStatus.SUCCESSFUL, 2)
    assert len([m for m in follow_ups() if m.payload["args"] == ["aenqueued"]]) == 1


def follow_ups() -> list[Message]:
    return [
        m
        for m in Message.objects.filter(topic__name=QUEUE)
        if m.payload["task"] == edge_noop.module_path
    ]
