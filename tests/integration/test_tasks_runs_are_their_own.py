"""Review helper-192's attack on the Tasks API backend: a task that catches a database error
inside the transaction the queue runs it in, a run from before a replay failing into the
replay's run, and a queue's subscription renamed and made again beside it (each test failed
on the code before its fix)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from tests.factories import SubscriptionFactory
from tests.support.hosts import running_tasks_queue
from tests.support.waiting import wait_until
from workqueue import transport
from workqueue.driver import get_driver
from workqueue.models import Delivery, Subscription
from workqueue.operators import operations
from workqueue.runtime.host import Host, HostConfig
from workqueue.tasks.api import TaskResultStatus, default_task_backend, task
from workqueue.tasks.messages import HANDLER_KEY
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")


def finished(result_id: str, timeout: float = 20.0):
    return wait_until(
        lambda: (r := default_task_backend.get_result(result_id)).is_finished and r, timeout
    )


@task()
def creates_a_user_unless_it_exists(username: str) -> str:
    """ "Insert, and take a duplicate for done", as written for a backend that runs tasks in
    autocommit."""
    try:
        get_user_model().objects.create(username=username)
    except IntegrityError:
        return "already there"
    return "created"


@task()
def creates_a_user_unless_it_exists_in_a_savepoint(username: str) -> str:
    try:
        with transaction.atomic():
            get_user_model().objects.create(username=username)
    except IntegrityError:
        return "already there"
    return "created"


@pytest.fixture
def tasks_host() -> Iterator[None]:
    with running_tasks_queue():
        yield


def test_a_task_that_catches_a_database_error_inside_its_transaction_is_told_how_to_fix_it(
    tasks_host,
):
    """The error recorded was Django's "You can't execute queries until the end of the
    'atomic' block", raised by the queue's own update of the result: it named neither the
    task's caught IntegrityError nor the fix. The same statement in a savepoint of its own
    succeeds, its duplicate taken for done."""
    get_user_model().objects.create(username="dup")

    caught = finished(creates_a_user_unless_it_exists.enqueue("dup").id)
    in_a_savepoint = finished(creates_a_user_unless_it_exists_in_a_savepoint.enqueue("dup").id)

    assert caught.status == TaskResultStatus.FAILED
    paths = {e.exception_class_path for e in caught.errors}
    assert paths == {"workqueue.tasks.handler._DatabaseErrorCaughtInside"}, paths
    assert "transaction.atomic() block of its own" in caught.errors[-1].traceback
    assert (in_a_savepoint.status, in_a_savepoint.return_value) == (
        TaskResultStatus.SUCCESSFUL,
        "already there",
    )


STALE_RUN_STARTED = threading.Event()
RELEASE_STALE_RUN = threading.Event()
STALE_RUNS: list[str] = []


@task()
def first_run_fails_late() -> str:
    STALE_RUNS.append("run")
    if len(STALE_RUNS) == 1:
        STALE_RUN_STARTED.set()
        RELEASE_STALE_RUN.wait(20)
        raise ValueError("the stale run, from before the replay, failed")
    return "ok"


def test_a_run_from_before_a_replay_records_no_error_on_the_run_after_it(tasks_host, caplog):
    """A replay counts attempts from 1 again, and a run was told its own by (InFlight,
    attempt): a run whose lease expired into a dead letter, replayed and claimed by another
    host, wrote its late error into the new run's result."""
    STALE_RUNS.clear()
    STALE_RUN_STARTED.clear()
    RELEASE_STALE_RUN.clear()
    queue = Subscription.objects.get(name="tasks.default")
    Subscription.objects.filter(pk=queue.pk).update(
        max_attempts=1, lease_seconds=5, heartbeat_mode="Manual"
    )
    caplog.set_level(logging.ERROR, "workqueue.deliveries")
    result = first_run_fails_late.enqueue()
    try:
        assert STALE_RUN_STARTED.wait(15)
        get_driver().shift_time(60, subscription_id=str(queue.pk))  # its lease ran out
        transport.expire_leases_all()  # its last attempt: dead-lettered LeaseExpired
        delivery = Delivery.objects.get(message_id=result.id)
        assert delivery.status == "DeadLettered"
        assert operations.replay("tasks.default", delivery.pk).replayed
        # Another host claims the replayed delivery (attempt 1 again) and is running it.
        assert Receiver(str(queue.pk), "host-b").receive(1).deliveries
        assert Delivery.objects.get(pk=delivery.pk).attempt_count == 1
    finally:
        RELEASE_STALE_RUN.set()  # the stale run now fails
    wait_until(lambda: "Lease lost" in caplog.text)  # its settle refused: it has finished

    now = default_task_backend.get_result(result.id)
    assert now.status == TaskResultStatus.RUNNING  # host-b's run
    assert [e.exception_class_path for e in now.errors] == []


TASK_RUNS: list[str] = []


@task()
def counts_its_runs(label: str) -> str:
    TASK_RUNS.append(label)
    return label


def test_a_queue_whose_subscription_was_renamed_runs_each_task_once(caplog):
    """An operator renames the queue's subscription (to have the backend make it again with
    changed OPTIONS, which W008 says apply only when a queue is made, say). The next process's
    first enqueue made ``tasks.default`` again beside it, on the same topic with the same
    handler: every task ran twice, its database work too."""
    TASK_RUNS.clear()
    get_user_model().objects.create_user("workqueue-system")
    default_task_backend.ensure_queue("default")
    Subscription.objects.filter(name="tasks.default").update(name="tasks.default-old")
    default_task_backend._ready_queues.clear()  # a new process (a deploy, a restart)

    with caplog.at_level(logging.WARNING, logger="workqueue.tasks.backend"):
        result = counts_its_runs.enqueue("once")
    host = Host(
        HostConfig(
            subscriptions=[{"name": "*", "concurrency": 1}],
            idle_poll_min_ms=50,
            idle_poll_max_ms=200,
            shutdown_drain_ms=300,
            sweeper_interval_ms=0,
            reconcile_interval_ms=0,
        )
    )
    host.start()
    try:
        assert finished(result.id).return_value == "once"
        wait_until(
            lambda: not Delivery.objects.filter(
                message_id=result.id, status__in=["Pending", "InFlight"]
            ).exists()
        )
    finally:
        host.shutdown()
        get_driver().close()

    assert TASK_RUNS == ["once"]
    assert not Subscription.objects.filter(name="tasks.default").exists()
    assert "is run by subscription 'tasks.default-old'" in caplog.text


def test_a_second_subscription_running_a_topics_tasks_is_refused():
    """Made in the admin or by sync-topology, it would run every task of the topic twice; a
    Disabled one may stand beside it (the old one kept aside)."""
    runner = SubscriptionFactory(handler_key=HANDLER_KEY)

    with pytest.raises(ValidationError, match="would run twice"):
        SubscriptionFactory(topic=runner.topic, handler_key=HANDLER_KEY)
    SubscriptionFactory(topic=runner.topic, handler_key=HANDLER_KEY, status="Disabled")
    Subscription.objects.filter(pk=runner.pk).update(status="Disabled")
    SubscriptionFactory(topic=runner.topic, handler_key=HANDLER_KEY)
