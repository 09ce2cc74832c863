"""What a project's own tests get from ``workqueue.testing``: publishing and handlers inside a
test's transaction (``use_test_connection``, ``run_until_idle``), and queue connections that
never keep Django from dropping the test database.

The fresh-project runs (``manage.py test`` and pytest) are in
``tests/processes/test_packaging.py``.
"""

from __future__ import annotations

import threading
import time
import warnings

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.db import connection, transaction
from django.test import SimpleTestCase, TestCase

from tests.factories import SubscriptionFactory
from workqueue import publish
from workqueue.driver import get_driver
from workqueue.exceptions import (
    DeliveriesNotRunWarning,
    DriverError,
    OutsideTestTransactionWarning,
    PublishInsideAtomicInTestWarning,
    WorkQueueConfigurationError,
)
from workqueue.models import Delivery, Message, Subscription
from workqueue.runtime.handlers import BaseWorkHandler, register_handler
from workqueue.runtime.outcome import FatalWorkError, Outcome, TransientWorkError
from workqueue.testing import run_until_idle, use_test_connection

SEEN: list[dict] = []


@register_handler("testing.record")
class Record(BaseWorkHandler):
    """Records what it saw; can fail or publish a follow-up, as the payload says."""

    def handle(self, message, context):
        SEEN.append({"payload": message.payload, "user": self.user.get_username()})
        if message.payload.get("fail"):
            raise FatalWorkError(message.payload["fail"])
        if message.payload.get("dead_letter"):
            return Outcome.dead_letter(message.payload["dead_letter"])
        if message.payload.get("busy"):
            # A delay of its own, so the test says when the retry is due.
            raise TransientWorkError(message.payload["busy"], retry_after_seconds=60)
        if message.payload.get("duplicate_user"):
            # A failed save let out (the system user exists): an IntegrityError.
            get_user_model().objects.create(username=self.user.get_username())
        if message.payload.get("complete_then_fail"):
            with transaction.atomic():
                get_user_model().objects.create(username=f"seen-{message.payload['n']}")
                context.complete(enlist=True)
        if message.payload.get("divide_by_zero") or message.payload.get("complete_then_fail"):
            with connection.cursor() as cursor:  # a failed statement of its own
                cursor.execute("SELECT 1 / 0")
        if message.payload.get("then"):
            publish(message.topic, message.payload["then"])
        # A handler's ORM work lands in the test's transaction, like the queue's own rows.
        get_user_model().objects.get_or_create(username=f"seen-{message.payload['n']}")
        return Outcome.complete()


@pytest.fixture
def topology():
    SEEN.clear()
    get_user_model().objects.create_user("workqueue-system")
    return SubscriptionFactory(handler_key="testing.record")


def _pids_connected(pg_conn, pids: list[int]) -> list[int]:
    """Those of ``pids`` still connected, in the order given (pg_stat_activity has none)."""
    rows = pg_conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE pid = ANY(%s)", [pids]
    ).fetchall()
    connected = {pid for (pid,) in rows}
    return [pid for pid in pids if pid in connected]


@pytest.mark.django_db
def test_without_test_mode_publish_cannot_see_topology_created_inside_a_testcase(topology):
    # The queue's own connection cannot see the test's uncommitted topic: the reason for test
    # mode.
    result = publish(topology.topic.name, {"n": 1})
    assert result.status == "Rejected"
    assert result.error.code == "TopicNotFound"


@pytest.mark.django_db(transaction=True)
def test_a_publish_a_testcase_cannot_roll_back_warns_and_test_mode_or_enlist_does_not(topology):
    """A topic committed outside the test (a session fixture's, a Tasks API queue) takes the
    publish on the queue's own connection, which a TestCase's rollback does not undo."""
    atomics = TestCase._enter_atomics()  # what a TestCase (pytest-django's db) opens
    try:
        with pytest.warns(OutsideTestTransactionWarning, match="use_test_connection") as seen:
            publish(topology.topic.name, {"n": 1})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            publish(topology.topic.name, {"n": 2}, enlist=True)
            with use_test_connection():
                publish(topology.topic.name, {"n": 3})
            publish("no-such-topic", {"n": 4})  # rejected: nothing committed
    finally:
        TestCase._rollback_atomics(atomics)

    assert [w.filename for w in seen] == [__file__]
    assert [m.payload["n"] for m in Message.objects.all()] == [1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        publish(topology.topic.name, {"n": 5})  # no TestCase transaction: nothing to warn of


# Review helper-175: written without parentheses (as @pytest.mark.django_db is), it failed
# with "__init__() takes 1 positional argument"; on a pytest class (no TestCase), with Django's
# "Can only decorate subclasses of unittest.TestCase".
@pytest.mark.django_db
@use_test_connection
def test_test_mode_decorates_without_parentheses_too(topology):
    assert publish(topology.topic.name, {"n": 1}).status == "Accepted"


@pytest.mark.django_db
@use_test_connection()
class TestTestModeOnAPytestClass:
    def test_each_test_method_runs_in_test_mode(self, topology):
        assert publish(topology.topic.name, {"n": 1}).status == "Accepted"
        assert [run.status for run in run_until_idle()] == ["Completed"]


@pytest.mark.django_db
@use_test_connection()
def test_in_test_mode_publish_and_run_until_idle_work_inside_the_test_transaction(topology):
    accepted = publish(topology.topic.name, {"n": 1, "then": {"n": 2}})
    assert accepted.status == "Accepted"

    runs = run_until_idle()

    assert [(r.subscription, r.status, r.attempt) for r in runs] == [
        (topology.name, "Completed", 1),
        (topology.name, "Completed", 1),
    ]
    assert runs[0].message_id == accepted.message_id
    assert repr(runs[0].status) == "'Completed'"  # not DeliveryStatus.COMPLETED in a diff
    assert [s["payload"]["n"] for s in SEEN] == [1, 2]
    assert {s["user"] for s in SEEN} == {"workqueue-system"}
    # The handler's ORM writes and the procedures' rows are in the test's transaction.
    assert get_user_model().objects.filter(username__in=["seen-1", "seen-2"]).count() == 2
    assert set(Delivery.objects.values_list("status", flat=True)) == {"Completed"}
    assert connection.in_atomic_block and connection.connection is not None
    assert run_until_idle() == []


@pytest.mark.django_db
def test_run_until_idle_reports_retries_and_dead_letters_and_stops_at_max_deliveries(topology):
    with use_test_connection():
        publish(topology.topic.name, {"n": 1, "fail": "no such customer"})
        [dead] = run_until_idle(topology.name)
        assert dead.status == "DeadLettered"
        assert "no such customer" in dead.error

        # Retried after its backoff, which never passes on a TestCase's frozen clock.
        publish(topology.topic.name, {"n": 1, "busy": "supplier timed out"})
        [retry] = run_until_idle()
        assert (retry.status, retry.attempt) == ("Pending", 1)
        assert "TransientWorkError: supplier timed out" in retry.error

        # A dead letter the handler asked for records its reason alone, and run.error said
        # None (helper-118).
        publish(topology.topic.name, {"n": 1, "dead_letter": "bad ledger entry"})
        [asked] = run_until_idle()
        assert (asked.status, asked.error) == ("DeadLettered", "bad ledger entry")

        publish(topology.topic.name, {"n": 1, "then": {"n": 2, "then": {"n": 3}}})
        # Stopping at the budget with work left said nothing (helper-118).
        with pytest.warns(DeliveriesNotRunWarning, match="stopped at max_deliveries=2") as seen:
            assert len(run_until_idle(max_deliveries=2)) == 2
        assert [w.filename for w in seen] == [__file__]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a budget spent on the last due delivery is silent
            assert [r.status for r in run_until_idle(max_deliveries=1)] == ["Completed"]
        assert run_until_idle() == []


@pytest.mark.django_db
@use_test_connection()
def test_a_publish_test_mode_puts_inside_the_code_under_tests_atomic_block_warns(topology):
    """In production a publish without enlist=True commits at once whatever the block around
    it does; in test mode it went with the block's rollback, so a test of "the order failed,
    nothing was published" passed while production published (helper-118)."""
    warned = pytest.warns(PublishInsideAtomicInTestWarning, match="enlist=True")
    with warned as seen, transaction.atomic():
        publish(topology.topic.name, {"n": 1})
    assert [w.filename for w in seen] == [__file__]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with transaction.atomic():
            publish(topology.topic.name, {"n": 2}, enlist=True)  # goes with the block: meant
        publish(topology.topic.name, {"n": 3})  # only the test's own transaction: as usual
        with transaction.atomic():
            publish("no-such-topic", {"n": 4})  # rejected: nothing to lose or keep


@pytest.mark.django_db
@use_test_connection()
def test_run_until_idle_without_the_system_user_says_how_to_make_it_in_the_test():
    """It said to run `manage.py workqueue create-system-user`, which makes the account in the
    development database, not the test's (helper-118)."""
    sub = SubscriptionFactory(handler_key="testing.record")
    publish(sub.topic.name, {"n": 1})

    with pytest.raises(WorkQueueConfigurationError) as refused:
        run_until_idle()

    assert "create_system_user(), in setUpTestData or a fixture" in str(refused.value)
    assert "run_until_idle(user=...)" in str(refused.value)
    assert "manage.py" not in str(refused.value)


@pytest.mark.django_db
def test_run_until_idle_names_why_a_subscription_cannot_run(topology):
    Subscription.objects.filter(pk=topology.pk).update(status="Paused")
    with pytest.raises(WorkQueueConfigurationError, match="Paused"):
        run_until_idle(topology.name)
    get_user_model().objects.filter(username="workqueue-system").delete()
    with pytest.raises(WorkQueueConfigurationError, match="SYSTEM_USER"):
        run_until_idle()


@pytest.mark.django_db
@use_test_connection()
def test_run_until_idle_warns_of_pending_work_it_could_not_run_and_names_the_key_meant(topology):
    """A mistyped handler key in a test's topology: run_until_idle() returned [] without a
    word, and the test failed on its assertion, far from the cause (helper-113)."""
    typo = SubscriptionFactory(handler_key="testing.recrod")
    idle = SubscriptionFactory(handler_key="testing.nobody")  # nothing pending: no warning
    publish(typo.topic.name, {"n": 1})

    with pytest.warns(DeliveriesNotRunWarning) as warned:
        assert run_until_idle() == []

    [warning] = warned
    text = str(warning.message)
    assert f"subscription {typo.name!r}" in text and "HandlerNotRegistered" in text
    assert "did you mean 'testing.record'?" in text and idle.name not in text
    assert warning.filename == __file__  # pointed at the test's own line


@pytest.mark.django_db
@use_test_connection()
def test_a_failing_queue_call_in_test_mode_leaves_the_test_transaction_usable(topology):
    with pytest.raises(DriverError):
        get_driver().execute("SELECT 1 / 0", [])
    # Only the call's savepoint was rolled back: the test goes on in its transaction.
    assert publish(topology.topic.name, {"n": 1}).status == "Accepted"
    assert Delivery.objects.count() == 1


@pytest.mark.django_db
@use_test_connection()
@pytest.mark.parametrize(
    ("failure", "error"),
    [
        ("duplicate_user", "IntegrityError"),
        ("divide_by_zero", "DataError"),
        # Its enlisted completion went with the savepoint, yet the run read as Completed.
        ("complete_then_fail", "DataError"),
    ],
)
def test_a_handler_whose_statement_failed_is_retried_and_the_test_transaction_stays_usable(
    topology, failure, error
):
    """The handler's failed statement aborted the test's transaction: recording the retry
    raised and every later query of the test failed."""
    publish(topology.topic.name, {"n": 1, failure: True})

    [run] = run_until_idle(topology.name, max_deliveries=1)

    assert (run.status, run.attempt) == ("Pending", 1)
    assert error in run.error
    assert Delivery.objects.get().status == "Pending"
    assert not get_user_model().objects.filter(username="seen-1").exists()
    publish(topology.topic.name, {"n": 2})
    assert get_user_model().objects.filter(username="workqueue-system").count() == 1


@pytest.mark.django_db
def test_a_host_refuses_to_run_inside_the_test_transaction_and_leaves_it_open(topology):
    with pytest.raises(CommandError, match="run_until_idle"):
        call_command("workqueue_work", "-s", topology.name, "--once")
    assert connection.in_atomic_block and connection.connection is not None
    assert Subscription.objects.filter(pk=topology.pk).exists()


@pytest.mark.django_db(transaction=True)
def test_run_until_idle_works_in_a_transactional_test_too(topology):
    publish(topology.topic.name, {"n": 1})  # committed on the queue's own connection
    assert [r.status for r in run_until_idle()] == ["Completed"]
    get_driver().close()


@pytest.mark.django_db(transaction=True)
def test_django_opening_its_no_database_connection_closes_every_queue_connection(pg_conn):
    """Django opens its no-database connection to create, clone or drop a database (the test
    runners drop the test database with it), and PostgreSQL refuses to drop a database that
    other sessions use: every thread's private queue connection must be closed first."""
    driver = get_driver()
    [(main_pid,)] = driver.execute("SELECT pg_backend_pid()", [])
    with driver.transaction() as own, own.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        [wrapper_pid] = cursor.fetchone()
    from_thread: list[int] = []
    called, release = threading.Event(), threading.Event()

    def other_thread() -> None:
        from_thread.append(driver.execute("SELECT pg_backend_pid()", [])[0][0])
        called.set()
        release.wait(30)  # alive: its connection is only closed if someone closes it
        from_thread.append(driver.execute("SELECT pg_backend_pid()", [])[0][0])
        driver.close()

    thread = threading.Thread(target=other_thread)
    thread.start()
    try:
        assert called.wait(30)
        pids = [main_pid, wrapper_pid, from_thread[0]]
        assert len(set(pids)) == 3 and _pids_connected(pg_conn, pids) == pids

        with connection.creation._nodb_cursor():  # what create/clone/destroy_test_db open
            pass

        deadline = time.monotonic() + 10
        while _pids_connected(pg_conn, pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _pids_connected(pg_conn, pids) == []
    finally:
        release.set()
        thread.join(30)
    # Each thread opens a new connection at its next call.
    assert from_thread[1] not in pids
    assert driver.execute("SELECT 1", []) == [(1,)]
    with driver.transaction() as own, own.cursor() as cursor:
        cursor.execute("SELECT 1")
    driver.close()


def test_test_mode_is_per_thread_and_nests():
    from workqueue.driver.base import routed_to_django_connection

    seen_elsewhere: list[bool] = []
    with use_test_connection():
        with use_test_connection():
            assert routed_to_django_connection("default")
        assert routed_to_django_connection("default")
        worker = threading.Thread(
            target=lambda: seen_elsewhere.append(routed_to_django_connection("default"))
        )
        worker.start()
        worker.join()
    assert not routed_to_django_connection("default")
    assert seen_elsewhere == [False]


def test_test_mode_as_a_class_decorator_covers_each_test_of_a_testcase():
    import unittest

    from workqueue.driver.base import routed_to_django_connection

    seen: list[bool] = []

    @use_test_connection()
    class Inner(unittest.TestCase):
        def test_one(self) -> None:
            seen.append(routed_to_django_connection("default"))

        def test_two(self) -> None:
            seen.append(routed_to_django_connection("default"))

    result = unittest.TestSuite([Inner("test_one"), Inner("test_two")]).run(unittest.TestResult())
    assert result.wasSuccessful()
    assert seen == [True, True]
    assert not routed_to_django_connection("default")


@pytest.mark.django_db
def test_test_mode_as_a_class_decorator_covers_set_up_test_data_too():
    """Django's decorator starts at setUp: a publish in setUpTestData went to the queue's own
    connection, which cannot see the class's topic (helper-118)."""
    import unittest

    statuses: list[str] = []

    @use_test_connection()
    class Inner(TestCase):
        @classmethod
        def setUpTestData(cls) -> None:
            cls.subscription = SubscriptionFactory(handler_key="testing.record")
            statuses.append(publish(cls.subscription.topic.name, {"n": 1}).status)

        def test_it_sees_what_set_up_test_data_published(self) -> None:
            statuses.append(Message.objects.get().payload["n"])

    result = unittest.TestSuite([Inner("test_it_sees_what_set_up_test_data_published")]).run(
        unittest.TestResult()
    )
    assert result.wasSuccessful(), result.errors + result.failures
    assert statuses == ["Accepted", 1]


@pytest.mark.django_db(transaction=True)
def test_a_publish_where_pytest_django_blocks_the_database_is_refused_as_the_orm_is(
    topology, django_db_blocker
):
    """A project's test without the ``django_db`` mark published for real (helper-158): the
    queue's calls run on connections of their own, past pytest-django's gate, and until a test
    has set the test database up the settings still name the development one."""
    publish(topology.topic.name, {"order": 13})  # the thread's queue connection is open
    messages = Message.objects.count()

    with (
        django_db_blocker.block(),
        pytest.raises(RuntimeError, match='use the "django_db" mark'),
    ):
        publish(topology.topic.name, {"order": 14})

    assert Message.objects.count() == messages


class TestAPublishInASimpleTestCase(SimpleTestCase):
    """Django's ``SimpleTestCase`` refuses queries; a publish went through all the same."""

    def test_is_refused_as_its_queries_are(self):
        with pytest.raises(AssertionError, match="SimpleTestCase") as refused:
            publish("orders.created", {"order": 14})
        # Refused before any call reached a database (not while explaining one that failed).
        assert refused.value.__context__ is None


@pytest.mark.django_db(transaction=True)
def test_a_wrapper_an_apm_puts_on_djangos_connections_is_not_taken_for_a_test_gate(
    topology, monkeypatch
):
    """Tracing tools wrap Django's connection methods with objects of their own: the queue's
    calls must not go through Django's connection for them (one opened per host thread)."""
    from django.db.backends.base.base import BaseDatabaseWrapper

    real = BaseDatabaseWrapper.ensure_connection
    calls: list[object] = []

    class Traced:
        def __get__(self, wrapper, owner=None):
            return lambda: calls.append(wrapper) or real(wrapper)

    monkeypatch.setattr(BaseDatabaseWrapper, "ensure_connection", Traced())

    assert publish(topology.topic.name, {"order": 15}).status == "Accepted"
    assert calls == []


RETRIED: list[int] = []


@register_handler("testing.retry-once")
class RetryOnce(BaseWorkHandler):
    def handle(self, message, context):
        RETRIED.append(context.attempt)
        if len(RETRIED) == 1:
            return Outcome.retry("again", delay_seconds=0)
        return Outcome.complete()


@pytest.mark.django_db
def test_in_test_mode_a_retry_with_no_delay_runs_again_in_the_same_test(topology):
    """Inside a TestCase the database clock stands still (now() is the test transaction's
    start), and claims take what is due by it: a retry dated by its call (statement_timestamp,
    as 0052 first made it) was never due again in the test (review helper-159)."""
    RETRIED.clear()
    subscription = SubscriptionFactory(topic=topology.topic, handler_key="testing.retry-once")

    with use_test_connection():
        publish(topology.topic.name, {"n": 1})
        runs = run_until_idle(subscription.name)

    assert [run.status for run in runs] == ["Pending", "Completed"]
    assert RETRIED == [1, 2]
