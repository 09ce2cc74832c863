"""The Tasks API backend in this process against PostgreSQL: what enqueue refuses, the queues it
creates, the API's signals around a host running in this process, and results purged with
their messages."""

from __future__ import annotations

import datetime as dt
import enum
import logging
import math
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction
from django.db.backends.signals import connection_created
from django.db.models import F
from django.test import TestCase, override_settings
from django.utils import timezone

from tests import task_functions
from tests.factories import SubscriptionFactory, TopicFactory
from tests.support.queue import answers_lost_once
from tests.support.roles import acting_as_granted_role
from tests.support.routers import QUEUE_ALIAS
from tests.support.waiting import wait_until
from tests.task_functions import (
    add,
    always_fails,
    commits_durably,
    creates_a_user_then_a_commit_callback_raises,
    echo,
    fails_on_first_attempt,
    fails_with_unstorable_text,
    first_run_fails_when_released,
    renamed_after_enqueue,
    returns_a_set,
    returns_a_tuple,
    returns_itself,
    returns_more_than_jsonb_holds,
    returns_unstorable_text,
)
from workqueue.driver import get_driver
from workqueue.exceptions import OutsideTestTransactionWarning
from workqueue.models import Delivery, Message, Subscription, TaskResult, Topic, Transport
from workqueue.operators import operations
from workqueue.runtime.executor import MAX_ERROR_LENGTH
from workqueue.runtime.host import Host, HostConfig
from workqueue.runtime.sweeper import Sweeper
from workqueue.tasks import TaskEnqueueError, WorkQueueBackend
from workqueue.tasks.api import (
    InvalidTaskError,
    TaskResultDoesNotExist,
    TaskResultStatus,
    default_task_backend,
    task_backends,
    task_enqueued,
    task_finished,
    task_started,
)
from workqueue.tasks.results import record_start
from workqueue.testing import use_test_connection

pytestmark = pytest.mark.usefixtures("queue_db")

QUEUE = "tasks.default"
DAY = 86_400


@pytest.fixture
def run_host() -> Iterator[Callable[[], Host]]:
    """Start a host in this process running tasks.default (created here, 2 quick attempts)."""
    get_user_model().objects.create_user("workqueue-system")
    default_task_backend.ensure_queue("default")
    Subscription.objects.filter(name=QUEUE).update(
        max_attempts=2, backoff_base_seconds=0, backoff_max_seconds=1
    )
    hosts: list[Host] = []

    def start() -> Host:
        host = Host(
            HostConfig(
                subscriptions=[{"name": QUEUE, "concurrency": 2}],
                idle_poll_min_ms=50,
                idle_poll_max_ms=200,
                shutdown_drain_ms=300,
                sweeper_interval_ms=0,
                reconcile_interval_ms=0,
            )
        )
        hosts.append(host)
        host.start()
        return host

    yield start
    for host in hosts:
        host.shutdown()
    get_driver().close()


@pytest.fixture
def queue_on_its_own_alias() -> Iterator[str]:
    """The work queue on an alias other than ``default`` (a router sends the app's models
    there); both aliases reach the test database."""
    with override_settings(
        DATABASE_ROUTERS=["tests.support.routers.WorkQueueAliasRouter"],
        WORKQUEUE={**settings.WORKQUEUE, "DATABASE_ALIAS": QUEUE_ALIAS},
    ):
        yield QUEUE_ALIAS


def finished(result_id: str, timeout: float = 15.0) -> Any:
    return wait_until(
        lambda: (r := default_task_backend.get_result(result_id)).is_finished and r, timeout
    )


@contextmanager
def finished_statuses() -> Iterator[list[str]]:
    """The statuses ``task_finished`` is sent with while the block runs, as they come."""
    seen: list[str] = []

    def receive(sender: Any, task_result: Any, **kwargs: Any) -> None:
        seen.append(str(task_result.status))

    task_finished.connect(receive)
    try:
        yield seen
    finally:
        task_finished.disconnect(receive)


def published_tasks() -> int:
    return Message.objects.filter(topic__name=QUEUE).count()


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "names"),
    [
        ((dt.datetime(2026, 1, 1),), {}, TypeError, r"args\[0\] is a datetime"),
        ((), {"y": {1: "one"}}, TypeError, r"kwargs\['y'\] has the key 1 \(int\)"),
        ((), {"y": [b"bytes"]}, TypeError, r"kwargs\['y'\]\[0\] is a bytes"),
        ((math.nan,), {}, ValueError, r"args\[0\] is nan"),
        (({1, 2},), {}, TypeError, r"args\[0\] is a set"),
    ],
)
def test_enqueue_refuses_arguments_that_do_not_round_trip_through_json(args, kwargs, error, names):
    with pytest.raises(error, match=names):
        add.enqueue(*args, **kwargs)
    assert published_tasks() == 0


def test_tuples_are_lists_in_arguments_and_return_values_as_the_apis_own_backends_make_them(
    run_host,
):
    """They were refused ("args[0] is a tuple") and a task returning one failed for good, its
    work rolled back, where Django's reference backends store a list (helper-120)."""
    run_host()
    positional = finished(echo.enqueue((1, (2, 3), {"pair": ("a", "b")})).id)
    keyword = finished(echo.enqueue(value=("k",)).id)
    returned = finished(returns_a_tuple.enqueue().id)

    assert (positional.status, positional.return_value) == (
        "SUCCESSFUL",
        [1, [2, 3], {"pair": ["a", "b"]}],
    )
    assert (keyword.status, keyword.return_value) == ("SUCCESSFUL", ["k"])
    assert (returned.status, returned.return_value) == ("SUCCESSFUL", [1, 2])


def test_float_arguments_reach_the_task_as_the_floats_enqueued(run_host):
    # 1e16 and 1e23 pass the JSON round trip Django checks, and came back as ints (10**23
    # being another number than the float 1e23).
    run_host()
    result = finished(echo.enqueue([1e16, 1e23, -2.5e-300]).id)

    assert result.status == "SUCCESSFUL"
    assert result.return_value == [1e16, 1e23, -2.5e-300]
    assert all(type(value) is float for value in result.return_value)


class Urgency(enum.IntEnum):
    HIGH = 50


def test_a_priority_given_as_an_int_enum_is_that_priority(run_host):
    """Refused as not an int by this round's first check of the type (review helper-87)."""
    run_host()
    result = finished(add.using(priority=Urgency.HIGH).enqueue(1, 2).id)

    assert (result.status, result.return_value) == ("SUCCESSFUL", 3)
    assert Delivery.objects.get(message_id=result.id).priority == 50


@pytest.mark.parametrize("priority", [5.0, True])
def test_a_priority_that_is_not_an_int_is_an_invalid_task(priority):
    """5.0 passes the API's own check (a whole number); enqueue then failed with the queue's
    TaskEnqueueError (InvalidPriority) rather than the API's error for a task it refuses."""
    with pytest.raises(InvalidTaskError, match="priority"):
        add.using(priority=priority)
    assert published_tasks() == 0


def test_run_after_is_the_deliverys_due_time_and_priority_its_priority(run_host):
    backend = default_task_backend
    assert (backend.supports_defer, backend.supports_priority) == (True, True)
    assert (backend.supports_get_result, backend.supports_async_task) == (True, True)
    run_after = (timezone.now() + dt.timedelta(hours=1)).replace(microsecond=0)

    later = add.using(run_after=run_after, priority=-20).enqueue(1, 2)
    urgent = add.using(priority=90).enqueue(3, 4)

    rows = {str(d.message_id): d for d in Delivery.objects.filter(subscription__name=QUEUE)}
    assert (rows[later.id].visible_at, rows[later.id].priority) == (run_after, -20)
    assert rows[urgent.id].priority == 90
    # Read back in any process from what was published, not from this process's objects.
    read = default_task_backend.get_result(later.id)
    assert (read.task.run_after, read.task.priority) == (run_after, -20)

    run_host()
    assert finished(urgent.id).return_value == 7
    assert default_task_backend.get_result(later.id).status == TaskResultStatus.READY
    get_driver().shift_time(3600, subscription_id=str(rows[later.id].subscription_id))
    assert finished(later.id).return_value == 3


def test_run_after_past_the_queues_retention_is_refused_at_enqueue():
    default_task_backend.ensure_queue("default")
    Topic.objects.filter(name=QUEUE).update(retention_days=1)

    with pytest.raises(TaskEnqueueError, match=r"InvalidSchedule: .*retention_days") as refused:
        add.using(run_after=timezone.now() + dt.timedelta(days=2)).enqueue(1, 1)
    assert published_tasks() == 0
    # The limit and how to raise it, which the refusal left to be found (helper-120).
    assert "at most 1 day ahead on this queue: raise retention_days of topic tasks.default" in (
        str(refused.value)
    )


def test_a_naive_run_after_is_refused_naming_run_after_even_without_use_tz(settings):
    """With USE_TZ = False the API lets a naive run_after through; enqueue then failed with a
    message about not_before, a name the caller never used."""
    settings.USE_TZ = False
    naive = dt.datetime(2030, 1, 1, 12, 0)

    with pytest.raises(InvalidTaskError, match="run_after must be an aware datetime"):
        add.using(run_after=naive).enqueue(1, 1)
    assert published_tasks() == 0


def test_a_run_after_that_is_a_delay_is_refused_saying_how_to_make_it_a_time():
    """A timedelta ("in five minutes") failed inside the API's own check with "AttributeError:
    'datetime.timedelta' object has no attribute 'utcoffset'" (helper-120)."""
    with pytest.raises(InvalidTaskError, match=r"not a timedelta: for a delay, timezone\.now\(\)"):
        add.using(run_after=dt.timedelta(minutes=5))
    assert published_tasks() == 0


def test_queue_names_must_make_topic_names():
    with override_settings(
        TASKS={"default": {"BACKEND": "workqueue.tasks.WorkQueueBackend", "QUEUES": []}}
    ):
        with pytest.raises(InvalidTaskError, match=r"Queue name 'Bulk Mail' cannot name"):
            add.using(queue_name="Bulk Mail")
        add.using(queue_name="bulk-mail")  # accepted
    bad = WorkQueueBackend("other", {"QUEUES": ["default", "Bulk Mail"]})
    (error,) = list(bad.check())
    assert error.id == "workqueue.E004" and "'Bulk Mail'" in error.msg


@pytest.mark.parametrize(("queues", "named"), [(["default", 7], "7 is not text"), ([None], "None")])
def test_a_queue_name_that_is_not_text_is_a_check_error_not_a_crash(queues, named):
    """QUEUES read from the environment, JSON or YAML can hold a number or null: the check
    died on a bare TypeError instead of naming the entry (helper-157)."""
    (error,) = list(WorkQueueBackend("other", {"QUEUES": queues}).check())
    assert error.id == "workqueue.E004" and named in error.msg and "is not text" in error.msg


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"max_attempts": 0}, "['max_attempts'] is 0"),
        ({"lease_seconds": "soon"}, "['lease_seconds'] is 'soon'"),
        ({"backoff_base_seconds": 60, "backoff_max_seconds": 10}, "backoff_max_seconds (10)"),
    ],
)
def test_check_reports_subscription_options_a_queue_could_not_be_made_with(options, named):
    # Only the keys were checked: the first enqueue to each queue failed with a
    # TopologyValidationError instead.
    backend = WorkQueueBackend("other", {"OPTIONS": {"SUBSCRIPTION": options}})

    errors = [e for e in backend.check() if e.id == "workqueue.E007"]

    assert len(errors) == 1 and named in errors[0].msg, [e.msg for e in errors]
    assert not [
        e
        for e in WorkQueueBackend(
            "fine", {"OPTIONS": {"SUBSCRIPTION": {"max_attempts": 3}}}
        ).check()
    ]


def test_a_queue_the_role_may_not_create_is_refused_saying_how_to_create_it(pg_conn):
    # A web process on the runtime grant (no writes to topology) met a queue nobody had made
    # yet: a raw "permission denied for table workqueue_topic" from its first enqueue.
    backend = WorkQueueBackend("limited", {"QUEUES": ["fresh"]})

    with (
        acting_as_granted_role(pg_conn, "wq_web", "grant-runtime"),
        pytest.raises(TaskEnqueueError, match=r"permission denied.*ensure_queue\('fresh'\)"),
    ):
        backend.ensure_queue("fresh")

    assert not Topic.objects.filter(name="tasks.fresh").exists()


def test_the_backend_creates_its_topic_and_subscription_once_with_the_configured_policy():
    options = {"SUBSCRIPTION": {"max_attempts": 7, "lease_seconds": 120}}
    backend = {"BACKEND": "workqueue.tasks.WorkQueueBackend", "QUEUES": ["mail"]}
    with override_settings(TASKS={"default": {**backend, "OPTIONS": options}}):
        add.using(queue_name="mail").enqueue(1, 2)
        add.using(queue_name="mail").enqueue(3, 4)
        assert task_backends["default"].subscription_options == options["SUBSCRIPTION"]
    sub = Subscription.objects.get(name="tasks.mail")
    assert (sub.topic.name, sub.handler_key, sub.max_attempts, sub.lease_seconds) == (
        "tasks.mail",
        "workqueue.tasks",
        7,
        120,
    )
    assert Delivery.objects.filter(subscription=sub).count() == 2

    with pytest.raises(ImproperlyConfigured, match=r"unknown key.*partition_mode"):
        WorkQueueBackend("x", {"OPTIONS": {"SUBSCRIPTION": {"partition_mode": "Ordered"}}})


def test_check_warns_of_a_queue_made_before_its_subscription_options_changed():
    """The options apply when the backend makes a queue, once: raising max_attempts after the
    first enqueue changed nothing, and `check --database` said nothing (helper-120)."""
    from django.core import checks, mail

    backend = {"BACKEND": "workqueue.tasks.WorkQueueBackend", "QUEUES": ["mail"]}

    def drift(options: dict[str, Any]) -> list[str]:
        outbox = mail.outbox  # Django's test environment: the check skips its new database
        del mail.outbox
        try:
            with override_settings(TASKS={"default": {**backend, "OPTIONS": options}}):
                found = checks.run_checks(databases=["default"], tags=[checks.Tags.database])
        finally:
            mail.outbox = outbox
        return [m.msg for m in found if m.id == "workqueue.W008"]

    made_with = {"SUBSCRIPTION": {"max_attempts": 3, "lease_seconds": 120}}
    with override_settings(TASKS={"default": {**backend, "OPTIONS": made_with}}):
        add.using(queue_name="mail").enqueue(1, 2)

    assert drift(made_with) == []
    (changed,) = drift({"SUBSCRIPTION": {"max_attempts": 7, "lease_seconds": 120}})
    assert changed.startswith(
        "Subscription tasks.mail differs from TASKS['default']['OPTIONS']['SUBSCRIPTION']: "
        "max_attempts 3 (the option: 7)."
    )
    assert Subscription.objects.get(name="tasks.mail").max_attempts == 3  # nothing written


def test_the_first_task_of_a_queue_enqueued_in_a_transaction_creates_the_queue_outside_it():
    with pytest.raises(RuntimeError), transaction.atomic():
        result = add.enqueue(1, 1)
        raise RuntimeError("roll back")
    # The topology and the message were committed on their own connections.
    assert Topic.objects.filter(name=QUEUE).exists()
    assert default_task_backend.get_result(result.id).status == TaskResultStatus.READY


def test_a_task_the_queue_refuses_raises_an_error_naming_the_reason():
    default_task_backend.ensure_queue("default")
    Topic.objects.filter(name=QUEUE).update(max_payload_bytes=100)
    with pytest.raises(
        TaskEnqueueError,
        match=r"task_functions\.add was not enqueued on topic tasks\.default: PayloadTooLarge",
    ):
        add.enqueue(1, y="x" * 200)
    Topic.objects.filter(name=QUEUE).update(status="Disabled")
    with pytest.raises(TaskEnqueueError, match="TopicDisabled"):
        add.enqueue(1, 2)
    assert published_tasks() == 0


def test_a_queue_whose_topic_went_away_is_made_again_without_a_warning_that_it_was_not_found(
    caplog,
):
    """Review helper-175: a topic deleted since the process made it (a flush between
    transactional tests, an operator) is made again and the task enqueued, but the first
    try's rejection was logged at WARNING telling to create the topic, which the backend had
    just done."""
    default_task_backend.ensure_queue("default")
    Subscription.objects.filter(name=QUEUE).delete()
    Topic.objects.filter(name=QUEUE).delete()

    with caplog.at_level(logging.INFO, logger="workqueue"):
        result = add.enqueue(1, 2)

    assert str(Message.objects.get().id) == result.id
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_a_task_whose_publish_answer_was_lost_is_enqueued_once_not_refused(monkeypatch):
    """The publish committed and its connection dropped before the answer came back; sent
    again, it found its message stored. ``enqueue`` raised "not enqueued: Duplicate" for a task
    that was queued, and a caller retrying the enqueue ran the task twice."""
    default_task_backend.ensure_queue("default")
    sent = answers_lost_once(monkeypatch)

    result = add.enqueue(1, 2)

    assert len(sent) == 2 and published_tasks() == 1
    assert str(Message.objects.get().id) == result.id
    assert default_task_backend.get_result(result.id).status == TaskResultStatus.READY


def test_a_task_no_subscription_receives_is_refused_not_silently_lost():
    """A queue whose subscription was Disabled (instead of Paused) or deleted: ``enqueue``
    returned READY for a task that got no delivery, never ran, and whose result never
    existed."""
    default_task_backend.ensure_queue("default")
    Subscription.objects.filter(name=QUEUE).update(status="Disabled")

    with pytest.raises(TaskEnqueueError, match=r"is Disabled.*set it Paused"):
        add.enqueue(1, 2)
    Subscription.objects.filter(name=QUEUE).delete()
    default_task_backend.ensure_queue("default")  # made again, and this process knows it
    Subscription.objects.filter(name=QUEUE).delete()
    with pytest.raises(TaskEnqueueError, match="was deleted; it is created again"):
        add.enqueue(3, 4)
    again = add.enqueue(3, 4)
    Subscription.objects.filter(name=QUEUE).update(status="Paused")
    waiting = add.enqueue(5, 6)

    assert default_task_backend.get_result(again.id).status == TaskResultStatus.READY
    assert default_task_backend.get_result(waiting.id).status == TaskResultStatus.READY
    assert published_tasks() == 4  # the two refused were stored without a delivery


def test_a_task_only_another_subscription_of_its_topic_receives_is_refused():
    """A second subscription on the queue's topic (an audit one) took the message while the
    task subscription was Disabled: "some subscription got it" is not "the task will run"."""
    default_task_backend.ensure_queue("default")
    SubscriptionFactory(topic=Topic.objects.get(name=QUEUE), name="audit.tasks")
    Subscription.objects.filter(name=QUEUE).update(status="Disabled")

    with pytest.raises(TaskEnqueueError, match="is Disabled"):
        add.enqueue(1, 2)
    Subscription.objects.filter(name=QUEUE).update(status="Active")
    assert default_task_backend.get_result(add.enqueue(1, 2).id).status == TaskResultStatus.READY


@pytest.mark.django_db
@use_test_connection()
def test_in_test_mode_a_task_no_subscription_receives_is_refused_too():
    """In a TestCase the publish runs on the test's connection, which tells nothing of its
    deliveries: the backend asks."""
    default_task_backend.ensure_queue("default")
    Subscription.objects.filter(name=QUEUE).update(status="Disabled")

    with pytest.raises(TaskEnqueueError, match="is Disabled"):
        add.enqueue(1, 2)
    Subscription.objects.filter(name=QUEUE).update(status="Active")
    assert default_task_backend.get_result(add.enqueue(1, 2).id).status == TaskResultStatus.READY


@pytest.mark.django_db
@use_test_connection()
def test_a_task_that_enqueues_another_runs_in_test_mode_without_a_warning():
    """A task runs inside its own transaction, so its enqueue took that block for the code
    under test's and warned (PublishInsideAtomicInTestWarning), an error under the usual
    filterwarnings, so the task failed (review helper-119); an enqueue has no enlist=True to
    offer anyway."""
    from tests.task_functions import enqueues_a_follow_up
    from workqueue.testing import run_until_idle

    get_user_model().objects.create_user("workqueue-system")
    default_task_backend.ensure_queue("default")
    enqueues_a_follow_up.enqueue(1)

    runs = run_until_idle()

    assert [run.status for run in runs] == ["Completed", "Completed"], runs


def test_a_task_enqueued_in_a_testcase_without_test_mode_warns_that_it_outlives_the_test():
    """The queue (made at a first enqueue, outside any transaction) exists, so the enqueue
    commits on the queue's own connection, which a TestCase's rollback does not undo: it
    stayed in the test database for every later test, and nothing said so."""
    default_task_backend.ensure_queue("default")
    atomics = TestCase._enter_atomics()  # what a TestCase (pytest-django's db) opens
    try:
        with pytest.warns(OutsideTestTransactionWarning, match="use_test_connection") as seen:
            add.enqueue(1, 2)
        with use_test_connection():
            add.enqueue(1, 2)  # test mode: inside the test, no warning
    finally:
        TestCase._rollback_atomics(atomics)

    assert [w.filename for w in seen] == [__file__]  # points at the test's line
    assert Message.objects.count() == 1  # the first one outlived the "test"


def test_a_task_whose_waiting_delivery_is_discarded_reads_failed():
    """The Tasks API reads FAILED once a task's delivery is dead-lettered or discarded, but no
    test discarded one: a discarded task could have read READY, waiting for ever (helper-103)."""
    enqueued = add.enqueue(1, 2)
    delivery = Delivery.objects.get(message_id=enqueued.id)

    operations.discard(delivery.subscription.name, str(delivery.id), reason="not needed")

    assert Delivery.objects.get(pk=delivery.pk).status == "Discarded"
    assert default_task_backend.get_result(enqueued.id).status == TaskResultStatus.FAILED


def test_a_task_enqueued_in_a_repeatable_read_transaction_is_not_refused():
    """The check that the task got a delivery read from the caller's snapshot, taken before
    the publish committed on the queue's own connection: the task was queued, yet refused."""
    default_task_backend.ensure_queue("default")
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        cursor.execute("SELECT count(*) FROM workqueue_delivery")  # the snapshot is taken

        result = add.enqueue(1, 2)

    assert default_task_backend.get_result(result.id).status == TaskResultStatus.READY


def test_get_result_of_an_unknown_or_malformed_id_does_not_exist():
    for result_id in ["00000000-0000-0000-0000-000000000000", "not-a-uuid"]:
        with pytest.raises(TaskResultDoesNotExist):
            default_task_backend.get_result(result_id)


def test_the_api_signals_fire_on_enqueue_start_and_finish_failed_only_at_the_dead_letter(
    run_host,
):
    received: list[tuple[str, str, str]] = []

    def receiver(name: str) -> Callable[..., None]:
        def receive(sender: Any, task_result: Any, **kwargs: Any) -> None:
            assert sender is WorkQueueBackend
            received.append((name, task_result.task.name, task_result.status))

        return receive

    receivers = {
        signal: receiver(name)
        for signal, name in [
            (task_enqueued, "enqueued"),
            (task_started, "started"),
            (task_finished, "finished"),
        ]
    }
    for signal, receive in receivers.items():
        signal.connect(receive)
    try:
        ok, failing = add.enqueue(1, 2), always_fails.enqueue("no")
        run_host()
        finished(ok.id), finished(failing.id)
        wait_until(lambda: ("finished", "always_fails", "FAILED") in received)
    finally:
        for signal, receive in receivers.items():
            signal.disconnect(receive)

    assert [r for r in received if r[1] == "add"] == [
        ("enqueued", "add", "READY"),
        ("started", "add", "RUNNING"),
        ("finished", "add", "SUCCESSFUL"),
    ]
    # Two attempts (the subscription's max_attempts), one FAILED: after the dead letter.
    assert [r for r in received if r[1] == "always_fails"] == [
        ("enqueued", "always_fails", "READY"),
        ("started", "always_fails", "RUNNING"),
        ("started", "always_fails", "RUNNING"),
        ("finished", "always_fails", "FAILED"),
    ]


def test_the_failed_task_log_line_carries_the_tasks_own_traceback(run_host, caplog):
    """django_tasks logs a FAILED task_finished with logger.exception; sent outside any
    exception, its line ended in "NoneType: None" instead of why the task failed."""
    failing = always_fails.enqueue("no")
    with caplog.at_level(logging.ERROR):
        run_host()
        finished(failing.id)
        wait_until(lambda: any("state=FAILED" in r.getMessage() for r in caplog.records))

    (line,) = [r for r in caplog.records if "state=FAILED" in r.getMessage()]
    logged = caplog.text
    assert line.exc_info is not None and "NoneType: None" not in logged
    assert "always_fails" in logged and "Traceback (most recent call last)" in logged
    # Once: the host's dead-letter line names the failure without a second traceback (an
    # error tracker would report the task twice).
    (dead_letter,) = [r for r in caplog.records if "dead-lettered" in r.getMessage()]
    assert dead_letter.exc_info is None and "ValueError" in dead_letter.getMessage()
    assert [r for r in caplog.records if r.exc_info] == [line]


@pytest.fixture
def task_errors_refused() -> Iterator[None]:
    """The database refuses to add a run's error to a task result, and nothing else (a
    trigger: a run's recording failing as it would with the database in trouble)."""
    table = TaskResult._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION wq_test_refuse_task_errors() RETURNS trigger LANGUAGE plpgsql "
            "AS $$ BEGIN RAISE EXCEPTION 'task errors refused by this test'; END $$"
        )
        cursor.execute(
            f"CREATE TRIGGER wq_test_refuse_task_errors BEFORE UPDATE ON {table} FOR EACH ROW "
            "WHEN (NEW.errors IS DISTINCT FROM OLD.errors) "
            "EXECUTE FUNCTION wq_test_refuse_task_errors()"
        )
    yield
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TRIGGER wq_test_refuse_task_errors ON {table}")
        cursor.execute("DROP FUNCTION wq_test_refuse_task_errors()")


def test_a_task_error_that_could_not_be_recorded_is_logged_and_settles_the_run(
    run_host, task_errors_refused, caplog
):
    """The recording's own error took the task's place: the delivery was dead-lettered with
    the database's refusal as its last error, and, the host leaving a task's traceback to
    django_tasks (which reads the result's errors, empty here), the task's traceback reached
    no log."""
    failing = always_fails.enqueue("why it failed")
    with caplog.at_level(logging.ERROR):
        run_host()
        failed = finished(failing.id)

    assert failed.status == TaskResultStatus.FAILED and failed.errors == []
    delivery = Delivery.objects.get(message_id=failing.id)
    assert delivery.last_error.splitlines()[-1] == "ValueError: why it failed"
    unrecorded = [r for r in caplog.records if "could not be added to its result" in r.getMessage()]
    assert len(unrecorded) == failed.attempts == 2
    assert "task errors refused by this test" in unrecorded[-1].getMessage()
    assert isinstance(unrecorded[-1].exc_info[1], ValueError)


def test_a_return_value_that_is_not_json_fails_at_once_even_when_its_error_is_not_recorded(
    run_host, task_errors_refused
):
    """The recording's error was raised instead of the dead-letter-now decision: the task ran
    again, its side effects with it."""
    result = returns_a_set.enqueue()
    run_host()
    failed = finished(result.id)
    assert failed.status == TaskResultStatus.FAILED and failed.attempts == 1
    assert "return value is a set" in Delivery.objects.get(message_id=result.id).last_error


def test_a_task_enqueued_by_a_running_task_is_published_with_its_result_or_not_at_all(run_host):
    """A task's enqueue was published at once, while the task's own transaction was still
    open: its follow-up ran before the task's rows were committed (a user it had just made was
    not there: retried, or dead-lettered), and a task that then failed left one copy of the
    follow-up per run (helper-120). Now the follow-up commits with the task's result."""
    from tests.task_functions import makes_a_user_then_enqueues_its_check, user_exists

    done = makes_a_user_then_enqueues_its_check.enqueue("made-by-the-task")
    failed = makes_a_user_then_enqueues_its_check.enqueue("rolled-back", then_fail=True)
    run_host()

    assert finished(done.id).status == TaskResultStatus.SUCCESSFUL
    assert finished(failed.id, timeout=30).status == TaskResultStatus.FAILED
    follow_ups = [
        m
        for m in Message.objects.filter(topic__name=QUEUE)
        if m.payload["task"] == user_exists.module_path
    ]
    assert len(follow_ups) == 1  # none from the two failed runs
    check = finished(str(follow_ups[0].id))
    assert (check.status, check.return_value, check.attempts) == (
        TaskResultStatus.SUCCESSFUL,
        True,  # it saw the user: run after the commit, not beside the task
        1,
    )


def test_an_enqueue_the_database_refuses_inside_a_task_fails_alone(run_host, pg_conn):
    """The enlisted enqueue's error (a lock timeout) left the task's whole transaction aborted:
    a task that caught it, as a best-effort enqueue does, then failed on its next query, and
    it was a LockTimeoutError rather than the TaskEnqueueError enqueue promises (review
    helper-121). Its savepoint takes only the enqueue."""
    from tests import task_functions

    default_task_backend.ensure_queue("default")
    topic_id = str(Topic.objects.get(name=QUEUE).id)
    for flag in (task_functions.WAITING_TO_ENQUEUE, task_functions.ENQUEUE_NOW):
        flag.clear()
    task_functions.ENQUEUE_REFUSALS.clear()
    result = task_functions.enqueues_when_told.enqueue("kept")
    run_host()
    assert task_functions.WAITING_TO_ENQUEUE.wait(20)
    # Any role that may connect can hold a topic's topology lock; a publish waits 5 s for it.
    pg_conn.execute(
        "SELECT pg_advisory_lock(hashtextextended('wq-topology:' || %s, 0))", [topic_id]
    )
    try:
        task_functions.ENQUEUE_NOW.set()
        done = finished(result.id, timeout=30)
    finally:
        pg_conn.execute(
            "SELECT pg_advisory_unlock(hashtextextended('wq-topology:' || %s, 0))", [topic_id]
        )

    assert (done.status, done.attempts, done.return_value) == ("SUCCESSFUL", 1, "kept")
    [refusal] = task_functions.ENQUEUE_REFUSALS
    assert refusal.startswith("TaskEnqueueError: The task tests.task_functions.user_exists")
    assert "lock timeout" in refusal and "tried again" in refusal
    assert get_user_model().objects.filter(username="kept").exists()


def test_a_return_value_that_is_not_json_fails_the_task_at_once(run_host):
    result = returns_a_set.enqueue()
    run_host()
    failed = finished(result.id)
    assert failed.status == TaskResultStatus.FAILED and failed.attempts == 1
    (error,) = failed.errors
    assert error.exception_class is TypeError
    assert "return value is a set" in error.traceback


def test_a_task_that_opens_a_durable_block_fails_at_once_saying_why(run_host):
    """Tasks run inside the transaction that completes them, where Django refuses a durable
    block: the task failed on every attempt with "cannot be nested", naming neither cause
    nor fix."""
    result = commits_durably.enqueue("durable")
    run_host()
    failed = finished(result.id)
    assert failed.status == TaskResultStatus.FAILED and failed.attempts == 1
    (error,) = failed.errors
    assert "runs inside the transaction that records its result" in error.traceback
    assert "durable=True" in error.traceback
    assert not get_user_model().objects.filter(username="durable").exists()


def test_return_values_are_stored_as_they_were_returned_and_none_as_sql_null(run_host):
    """The handler writes the return value with a statement of its own (not the ORM's
    ``update``); the model's field still prepares each value, so every JSON shape comes back
    equal and a task that returns None leaves the column NULL, as ``update`` would."""
    values = [
        None,
        0,
        'it\'s "quoted" and ünïcode',
        [1, [2, {"three": None}]],
        {"nested": {"list": [True, False, 1.5]}, "empty": {}},
    ]
    results = [echo.enqueue(value) for value in values]
    run_host()

    assert [finished(result.id).return_value for result in results] == values
    null_columns = TaskResult.objects.filter(
        pk__in=[result.id for result in results], return_value__isnull=True
    )
    assert [str(pk) for pk in null_columns.values_list("pk", flat=True)] == [results[0].id]


def test_results_are_purged_with_their_messages_by_the_sweeper(run_host):
    old = add.enqueue(1, 1)
    run_host()
    finished(old.id)
    topic = Topic.objects.get(name=QUEUE)
    aged = topic.retention_days * DAY + 60
    get_driver().shift_time(aged, topic_id=str(topic.id))
    TaskResult.objects.update(started_at=F("started_at") - dt.timedelta(seconds=aged))
    recent = add.enqueue(2, 2)
    finished(recent.id)
    # A run that started as long ago, of a task waiting for its retry (not due for an hour,
    # so the host leaves it): its message is alive, and so is its result.
    kept = add.using(run_after=timezone.now() + dt.timedelta(hours=1)).enqueue(3, 3)
    TaskResult.objects.create(id=kept.id, started_at=timezone.now() - dt.timedelta(days=30))

    result = Sweeper().run_once()

    assert result.purged["task_results"] == 1
    assert {str(pk) for pk in TaskResult.objects.values_list("id", flat=True)} == {
        recent.id,
        kept.id,
    }
    with pytest.raises(TaskResultDoesNotExist):
        default_task_backend.get_result(old.id)
    assert default_task_backend.get_result(recent.id).return_value == 4


def test_results_naming_no_known_topic_are_reaped_from_the_longest_retention():
    """Results recorded before they named their topic (or whose topic was renamed) cannot be
    walked from their own topic's cutoff: they go once past every topic's retention, never
    while a longer-retention topic may still hold their message."""
    TopicFactory(retention_days=1)
    TopicFactory(retention_days=30)
    ids = {age: uuid.uuid4() for age in (2, 31)}
    for age, result_id in ids.items():
        started = timezone.now() - dt.timedelta(days=age)
        TaskResult.objects.create(id=result_id, topic=None, started_at=started)

    assert TaskResult.objects.purge_orphans(100) == 1
    assert list(TaskResult.objects.values_list("id", flat=True)) == [ids[2]]


def test_a_host_runs_tasks_on_kept_connections_in_three_statements_each(run_host):
    """The handler's worker threads keep their ORM connections between deliveries (the project
    sets CONN_MAX_AGE) and a first run costs one INSERT of its result, one UPDATE of the return
    value and the enlisted completion: not a connection, a locked read and two read-backs."""
    opened: list[str] = []
    statements: list[str] = []

    def count(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        statements.append(sql)
        return execute(sql, params, many, context)

    def on_connection(sender: Any, connection: Any, **kwargs: Any) -> None:
        opened.append(threading.current_thread().name)
        connection.execute_wrappers.append(count)

    results = [add.enqueue(n, n) for n in range(12)]
    connection_created.connect(on_connection)
    try:
        run_host()
        for result in results:
            assert finished(result.id).return_value == 2 * int(result.args[0])
    finally:
        connection_created.disconnect(on_connection)

    # One connection per worker thread, whatever the number of tasks.
    assert len(opened) == len(set(opened)) < len(results), opened
    ran = [s for s in statements if "workqueue_taskresult" in s or "wq_complete" in s]
    assert len(ran) == 3 * len(results), ran


@pytest.mark.parametrize("in_transaction", [False, True], ids=["autocommit", "in-transaction"])
def test_a_first_run_that_finds_an_earlier_runs_record_adds_to_it(in_transaction):
    """A lease can expire before its attempt is counted, so a "first" run may find the row an
    earlier run wrote: its insert clashes and it takes the locked path instead."""
    result_id = str(uuid.uuid4())
    first = record_start(result_id, "tasks.default", "host-a", first_run=True)
    with transaction.atomic() if in_transaction else nullcontext():
        again = record_start(result_id, "tasks.default", "host-b", first_run=True)
        if in_transaction:
            TaskResult.objects.count()  # the caller's transaction is still usable

    assert again.worker_ids == ["host-a", "host-b"]
    assert again.topic == "tasks.default"
    assert again.started_at == first.started_at <= again.last_attempted_at


def test_a_queue_whose_topic_was_bound_to_another_transport_is_refused_naming_the_fix():
    # An operator moved the queue's topic to the AWS transport: the tasks would run there, but
    # their results are read from this database's deliveries and would never be found.
    aws = Transport.objects.create(
        name="aws-tasks", driver_class="AWS", configuration={"region": "eu-west-1"}
    )
    Topic.objects.create(name="tasks.elsewhere", transport=aws)
    backend = WorkQueueBackend("elsewhere", {"QUEUES": ["elsewhere"]})

    with pytest.raises(TaskEnqueueError) as refused:
        backend.ensure_queue("elsewhere")

    assert "'aws-tasks'" in str(refused.value) and "Database transport" in str(refused.value)
    assert not Subscription.objects.filter(name="tasks.elsewhere").exists()
    assert not Message.objects.filter(topic__name="tasks.elsewhere").exists()


# -- unusable return values, commit callbacks, stale runs (audit helper-67) ---------------------


@pytest.mark.parametrize(
    ("task", "says"),
    [
        (returns_unstorable_text, "holds a NUL character"),
        (returns_itself, "is nested more than 64 levels"),
    ],
    ids=["text-the-database-cannot-store", "contains-itself"],
)
def test_a_return_value_that_cannot_be_stored_fails_at_once_and_runs_once(run_host, task, says):
    """A NUL round-trips through JSON but not into jsonb: storing it raised DataError, which
    was retried, running the task's side effects again on every attempt. A value that contains
    itself recursed until RecursionError, a RuntimeError, retried the same way."""
    task_functions.RUNS.clear()
    result = task.enqueue("label")
    run_host()
    failed = finished(result.id)

    assert (failed.status, failed.attempts, task_functions.RUNS) == (
        TaskResultStatus.FAILED,
        1,
        ["label"],
    )
    (error,) = failed.errors
    assert error.exception_class is ValueError and says in error.traceback


@pytest.mark.slow  # a quarter of a gigabyte, built, sent and refused: a minute on this machine
def test_a_return_value_too_large_for_the_database_fails_at_once_and_runs_once(run_host):
    """Refused by the server (jsonb holds strings up to 256 MiB - 1), not by the checks before
    it: the error was retried like any other, running the task's side effects again. (The
    refusal's class is checked quickly by tests/driver/test_driver.py.)"""
    task_functions.RUNS.clear()
    result = returns_more_than_jsonb_holds.enqueue("label")
    run_host()
    failed = finished(result.id, timeout=300)

    assert (failed.status, failed.attempts, task_functions.RUNS) == ("FAILED", 1, ["label"])
    assert "cannot exceed" in failed.errors[0].traceback


@pytest.mark.parametrize(
    "shape", ["contains itself", "contains itself twice", "a tuple containing itself", "deep"]
)
def test_enqueue_refuses_an_argument_nested_past_the_limit_naming_it(shape):
    # A raw RecursionError, a thousand frames long, instead of the promised error; and,
    # twice inside itself, 2**64 calls making its tuples lists (review helper-121).
    value: Any = []
    if shape == "contains itself":
        value.append(value)
    elif shape == "contains itself twice":
        value += [value, value]
    elif shape == "a tuple containing itself":
        value.append((value,))
    else:
        for _ in range(5000):
            value = [value]

    with pytest.raises(ValueError, match=r"args\[0\]\[0\].* is nested more than 64 levels"):
        echo.enqueue(value)
    assert published_tasks() == 0


def test_an_argument_is_refused_at_the_depth_its_message_would_be_refused_not_later():
    # The check counted from the argument list, the payload from the message: an argument 63
    # levels deep passed it and was refused by the publish as the payload of "message 0".
    def nested(levels: int) -> Any:
        value: Any = 1
        for _ in range(levels):
            value = [value]
        return value

    with pytest.raises(ValueError, match=r"args\[0\].* is nested more than 64 levels"):
        echo.enqueue(nested(63))
    assert echo.enqueue(nested(62)).status == TaskResultStatus.READY


def test_a_commit_callback_that_raises_leaves_a_successful_task_successful(run_host, caplog):
    """The callback runs after the task's work, result and completion committed; its error
    came out of the transaction block and was recorded as the task's failure, and
    task_finished never fired."""
    with finished_statuses() as seen:
        result = creates_a_user_then_a_commit_callback_raises.enqueue("hooked")
        run_host()
        done = finished(result.id)
        wait_until(lambda: seen)

    assert (done.status, done.return_value, done.errors) == (
        TaskResultStatus.SUCCESSFUL,
        "done",
        [],
    )
    assert seen == ["SUCCESSFUL"]
    assert get_user_model().objects.filter(username="hooked").exists()
    assert "the on_commit callback failed" in caplog.text


def test_a_run_that_fails_after_another_took_its_delivery_over_records_nothing(run_host):
    """The first run's lease ran out, a second run succeeded; the first then failed and wrote
    its error into the finished, successful result."""
    task_functions.RUNS.clear()
    task_functions.FIRST_RUN_STARTED.clear()
    task_functions.RELEASE_FIRST_RUN.clear()
    Subscription.objects.filter(name=QUEUE).update(lease_seconds=5, heartbeat_mode="Manual")
    result = first_run_fails_when_released.enqueue()
    host = run_host()
    try:
        assert task_functions.FIRST_RUN_STARTED.wait(15)
        queue = Subscription.objects.get(name=QUEUE)
        get_driver().shift_time(60, subscription_id=str(queue.pk))  # its lease ran out
        done = finished(result.id)
        assert (done.status, done.return_value) == (TaskResultStatus.SUCCESSFUL, "ok")
    finally:
        task_functions.RELEASE_FIRST_RUN.set()  # the first run now fails
    wait_until(lambda: host.health()["subscriptions"][0]["in_flight"] == 0)

    assert default_task_backend.get_result(result.id).errors == []
    assert task_functions.RUNS == ["run", "run"]


@pytest.mark.django_db(transaction=True, databases=["default", QUEUE_ALIAS])
def test_a_queue_on_another_alias_retries_a_failed_task_and_keeps_its_error(
    run_host, queue_on_its_own_alias
):
    """The result's row was written under transactions opened on ``default`` while its
    locking reads went to the queue's alias, in autocommit there: every failure's record
    raised in place of the task's error, and every later attempt raised before the task
    ran, so a task that failed once never ran again and its result kept no error."""
    run_host()

    result = finished(fails_on_first_attempt.enqueue().id)

    assert (result.status, result.return_value) == ("SUCCESSFUL", 2)
    assert [error.exception_class_path for error in result.errors] == ["builtins.RuntimeError"]
    assert "attempt 1 fails" in result.errors[0].traceback


@pytest.mark.django_db(transaction=True, databases=["default", QUEUE_ALIAS])
def test_a_queue_on_another_alias_reports_a_failed_task_and_replays_it(
    run_host, queue_on_its_own_alias
):
    with finished_statuses() as seen:
        failing = always_fails.enqueue("no")
        run_host()
        failed = finished(failing.id)
        wait_until(lambda: seen)
    assert (failed.status, len(failed.errors), seen) == ("FAILED", 2, ["FAILED"])

    delivery = Delivery.objects.get(message_id=failing.id)
    assert operations.replay(QUEUE, delivery.pk).replayed
    wait_until(lambda: default_task_backend.get_result(failing.id).attempts == 4)
    assert len(finished(failing.id).errors) == 4


@pytest.mark.parametrize("padding", [0, 1_000_000])
def test_a_failed_runs_error_is_kept_whatever_its_text(run_host, padding):
    """An error text PostgreSQL cannot store (NUL, a lone surrogate) made recording it fail,
    so the result kept no error at all; a long one was kept whole, once per attempt."""
    # The log lines carry the exception as raised, lone surrogate included, which pytest-xdist
    # cannot send from its worker: this test is about what is stored, not what is logged.
    logging.disable(logging.CRITICAL)
    try:
        _run_a_task_failing_with_unstorable_text(run_host, padding)
    finally:
        logging.disable(logging.NOTSET)


def _run_a_task_failing_with_unstorable_text(run_host: Callable[[], Host], padding: int) -> None:
    run_host()

    result = finished(fails_with_unstorable_text.enqueue(padding).id)

    assert result.status == "FAILED" and len(result.errors) == 2
    for error in result.errors:
        assert error.exception_class_path == "builtins.ValueError"
        assert "bad\\x00input caf\\udce9" in error.traceback
        assert len(error.traceback) <= MAX_ERROR_LENGTH
        assert error.traceback.endswith("x" if padding else "\\udce9")  # the end is kept


def test_a_task_renamed_after_enqueue_still_has_a_readable_result(run_host, monkeypatch):
    """Reading a result imported its task: once a deploy had renamed or removed it,
    get_result raised ImportError for the life of the result, and its dead letter sent no
    task_finished."""
    enqueued = renamed_after_enqueue.enqueue()
    monkeypatch.delattr(task_functions, "renamed_after_enqueue")

    waiting = default_task_backend.get_result(enqueued.id)
    assert (waiting.status, waiting.task.module_path) == (
        "READY",
        "tests.task_functions.renamed_after_enqueue",
    )
    with finished_statuses() as seen:
        run_host()
        failed = finished(enqueued.id)
        wait_until(lambda: seen)
    assert (failed.status, len(failed.errors), seen) == ("FAILED", 2, ["FAILED"])
    assert "renamed_after_enqueue" in failed.errors[0].traceback
    with pytest.raises(ImportError, match=r"tests\.task_functions\.renamed_after_enqueue"):
        failed.task.call()


def test_a_dead_letter_of_a_cloud_transport_is_no_task_and_logs_nothing(caplog):
    """The Tasks API's receiver hears every subscription's dead letters; a cloud transport's
    delivery id is read from its message body, whatever a sender wrote there. Looked up as a
    task's, one that is no UUID raised, and was logged at ERROR with its text as it came (a
    newline forging a line of its own: review helper-142)."""
    from workqueue.tasks.signals import send_task_finished_for_dead_letter

    with caplog.at_level(logging.DEBUG, logger="workqueue"):
        send_task_finished_for_dead_letter(
            None, subscription_id="s", delivery_id="x\n2026-12-06 ERROR forged"
        )

    assert caplog.records == []


def test_a_results_finished_at_is_when_the_task_finished_not_when_its_transaction_began(
    run_host,
):
    """A task completes inside its own transaction, and PostgreSQL's now() is that
    transaction's start (its first query): a task that queried, then worked on for a second,
    read as done in a millisecond, and the dashboard counted its completion back then too
    (helper-157)."""
    from tests.task_functions import makes_a_user_then_enqueues_its_check

    run_host()

    done = finished(makes_a_user_then_enqueues_its_check.enqueue("slow-to-finish").id)

    assert str(done.status) == "SUCCESSFUL"
    assert done.finished_at - done.started_at >= dt.timedelta(seconds=1)
    (delivery,) = Delivery.objects.filter(message_id=done.id)
    assert delivery.completed_at == done.finished_at


def test_task_finished_is_sent_with_the_time_the_task_finished(run_host):
    """Django's backends send ``task_finished`` with ``finished_at`` set; a receiver timing
    tasks read None here and failed on it (helper-157)."""
    seen: list[Any] = []

    def receive(sender: Any, task_result: Any, **kwargs: Any) -> None:
        seen.append(task_result)

    task_finished.connect(receive)
    try:
        run_host()
        done = finished(add.enqueue(2, 3).id)
        wait_until(lambda: seen)  # sent after the settle that made the result read finished
    finally:
        task_finished.disconnect(receive)

    assert [str(r.status) for r in seen] == ["SUCCESSFUL"]
    assert seen[0].finished_at is not None
    assert abs(seen[0].finished_at - done.finished_at) < dt.timedelta(seconds=1)
