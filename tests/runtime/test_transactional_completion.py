"""``context.complete(enlist=True)`` in one process against PostgreSQL: the handler's writes
and the completion commit or roll back together, the runtime settles nothing after a committed
completion, a stale or cancelled holder is refused, the row lock fences the delivery until the
handler's transaction ends (heartbeats, the lease horizon, the sweeper and other claimers leave
it alone meanwhile), the errors that name a misuse, the EXECUTE-only runtime role, and test mode.
The same guarantees across SIGKILL and SIGSTOP: tests/processes/test_exactly_once_effects.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import OperationalError, connection, connections, transaction

from tests.factories import SubscriptionFactory, TopicFactory
from tests.support import txn_handlers
from tests.support.database import lock_waits, psycopg_params
from tests.support.executions import ExecutionRig
from tests.support.roles import database_role
from tests.support.txn_handlers import EffectHandler, effects
from workqueue import publish, transport
from workqueue.driver import get_driver
from workqueue.exceptions import Cancelled, DeliveryBusyError, EnlistError, LeaseLost
from workqueue.models import Delivery, Message, Subscription
from workqueue.operators import operations
from workqueue.runtime.context import AbortReason, WorkContext, WorkMessage
from workqueue.runtime.enlisted import OWN_HOOK_START_SECONDS, EnlistedCompletion
from workqueue.runtime.executor import ExecutionResult
from workqueue.runtime.handlers import BaseWorkHandler, HandlerRegistry
from workqueue.runtime.outcome import Outcome
from workqueue.testing import run_until_idle, use_test_connection
from workqueue.transport import Receiver
from workqueue.types import ClaimedDelivery

SETTLES = ("wq_complete", "wq_retry", "wq_dead_letter", "wq_release", "wq_acknowledge_cancel")

Body = Callable[[WorkMessage, WorkContext], Any]
registry = HandlerRegistry()
registry.register("tests.txn.effect", EffectHandler)
_bodies: dict[str, Body] = {}


class BodyHandler(BaseWorkHandler):
    """Runs the function the test registered under the payload's ``body``."""

    def handle(self, message: WorkMessage, context: WorkContext) -> Any:
        return _bodies[message.payload["body"]](message, context)


registry.register("tests.txn.body", BodyHandler)


def write_effect(message: WorkMessage, context: WorkContext) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {txn_handlers.EFFECT_TABLE} (message_id, delivery_id, attempt, pid) "
            "VALUES (%s, %s, %s, 0)",
            [message.message_id, context.delivery_id, context.attempt],
        )


class Rig(ExecutionRig):
    """Publishes, claims and runs deliveries with test-chosen timings."""

    def __init__(self, user: Any) -> None:
        super().__init__(registry, user)

    def subscription(self, handler_key: str = "tests.txn.effect", **fields: Any) -> Subscription:
        fields.setdefault("backoff_base_seconds", 0)
        fields.setdefault("backoff_max_seconds", 0)
        return SubscriptionFactory(handler_key=handler_key, **fields)

    def run(self, sub: Subscription, payload: dict[str, Any], **kw: Any) -> ExecutionResult:
        receiver, delivery = self.claim(sub, payload)
        return self.execution(sub, receiver, delivery, **kw).run()


@pytest.fixture
def effect_table(transactional_db: None) -> Iterator[None]:
    txn_handlers.create_effect_table()
    txn_handlers.events.clear()
    yield
    txn_handlers.drop_effect_table()


@pytest.fixture
def rig(queue_db: None, effect_table: None) -> Iterator[Rig]:
    rig = Rig(get_user_model().objects.create_user("workqueue-system"))
    yield rig
    rig.close()
    _bodies.clear()


def body(function: Body) -> dict[str, str]:
    """Register ``function`` as a handler body; the payload that runs it."""
    _bodies[function.__name__] = function
    return {"body": function.__name__}


def status(delivery: ClaimedDelivery) -> tuple[str, int]:
    row = Delivery.objects.get(pk=delivery.delivery_id)
    return row.status, row.attempt_count


def complete_then_undo(context: WorkContext) -> None:
    """Complete inside a savepoint that then rolls back, undoing the completion only."""
    try:
        with transaction.atomic():
            context.complete(enlist=True)
            raise RuntimeError("undo the completion only")
    except RuntimeError:
        pass


def phases(message_id: str) -> list[str]:
    return [e["event"] for e in txn_handlers.events if e["message"] == message_id]


# -- commit and rollback together ---------------------------------------------------------------


def test_the_handlers_write_and_the_completion_commit_together_and_nothing_is_settled_again(
    rig, statements
):
    sub = rig.subscription()
    receiver, delivery = rig.claim(sub, {"n": 1})

    result = rig.execution(sub, receiver, delivery).run()

    assert result == ExecutionResult(ExecutionResult.SETTLED, "Completed")
    assert status(delivery) == ("Completed", 1)
    assert effects() == [(delivery.message_id, 1)]
    # The one fenced completion, run once in the handler's transaction; no settle after it.
    [settle] = [s for s in statements if any(name in s for name in SETTLES)]
    assert "wq_complete_holding_key(" in settle


def test_a_commit_callback_of_the_handler_that_raises_leaves_the_completion_committed(
    rig, statements
):
    """Django runs the transaction's callbacks in order and stops at one that raises: the
    completion's own mark, registered after the handler's callback, never ran, and once the
    handler opened another transaction the committed completion read as rolled back, so the
    executor settled it again (refused, reported as a lost lease)."""

    def callback_raises_then_goes_on(message: WorkMessage, context: WorkContext) -> Any:
        try:
            with transaction.atomic():
                write_effect(message, context)
                transaction.on_commit(lambda: 1 / 0)  # registered before the completion
                context.complete(enlist=True)
        except ZeroDivisionError:
            pass  # the commit happened; the callback failed after it
        with transaction.atomic():  # more work of its own (an audit row, say)
            pass
        return Outcome.complete()

    sub = rig.subscription(handler_key="tests.txn.body")
    receiver, delivery = rig.claim(sub, body(callback_raises_then_goes_on))

    result = rig.execution(sub, receiver, delivery).run()

    assert result == ExecutionResult(ExecutionResult.SETTLED, "Completed")
    assert [s for s in statements if any(name in s for name in SETTLES)] == [
        s for s in statements if "wq_complete_holding_key(" in s
    ]
    assert len([s for s in statements if "wq_complete_holding_key(" in s]) == 1


def test_an_outcome_returned_after_a_committed_completion_changes_nothing(rig, statements, caplog):
    sub = rig.subscription()

    with caplog.at_level(logging.WARNING, "workqueue.deliveries"):
        result = rig.run(sub, {"thenReturn": "retry"})

    assert result == ExecutionResult(ExecutionResult.SETTLED, "Completed")
    [row] = Delivery.objects.filter(subscription=sub)
    assert (row.status, row.attempt_count, row.last_error) == ("Completed", 1, None)
    assert not any("wq_retry" in s for s in statements)
    assert "completed the delivery in its transaction, then returned Retry" in caplog.text


def test_an_exception_after_the_completion_rolls_back_both_and_the_delivery_is_retried(rig):
    sub = rig.subscription(max_attempts=3)
    receiver, delivery = rig.claim(sub, {"raiseAfterComplete": {"1": True}})

    first = rig.execution(sub, receiver, delivery).run()

    assert first == ExecutionResult(ExecutionResult.SETTLED, "Pending")
    assert status(delivery) == ("Pending", 1)
    assert effects() == []
    assert phases(delivery.message_id) == ["inside", "completed", "rolled_back"]

    receiver, again = rig.claim(sub)
    assert rig.execution(sub, receiver, again).run().status == "Completed"
    assert status(again) == ("Completed", 2)
    assert effects() == [(delivery.message_id, 2)]


def test_a_savepoint_rolled_back_around_the_completion_undoes_it_and_the_outcome_decides(rig):
    def completes_in_a_savepoint_that_rolls_back(message, context):
        with transaction.atomic():
            write_effect(message, context)
            complete_then_undo(context)
        return Outcome.retry("the completion was undone", 0)

    sub = rig.subscription("tests.txn.body")
    receiver, delivery = rig.claim(sub, body(completes_in_a_savepoint_that_rolls_back))

    assert rig.execution(sub, receiver, delivery).run().status == "Pending"
    row = Delivery.objects.get(pk=delivery.delivery_id)
    assert (row.status, row.last_error) == ("Pending", "the completion was undone")
    assert effects() == [(delivery.message_id, 1)]  # the outer block committed its own write


def test_a_completion_undone_by_its_savepoint_does_not_read_as_committed_by_a_later_commit(
    transactional_db,
):
    """While a commit's callbacks run, Django's list of pending callbacks is already empty and
    its commit flag set. A completion whose savepoint rolled back read as committed all the
    while a later commit's callbacks ran (an e-mail sent on commit, say), and a committed
    completion stops the lease's renewals for good."""
    reads: dict[str, list[str]] = {"undone": [], "committed": []}

    def read_during_callbacks(completion: EnlistedCompletion, into: list[str]) -> None:
        into.append(completion.state())
        # A slow callback: longer than it may take a completion's own mark to run.
        time.sleep(OWN_HOOK_START_SECONDS + 0.25)
        into.append(completion.state())

    with transaction.atomic():
        try:
            with transaction.atomic():
                undone = EnlistedCompletion(connection)
                raise RuntimeError("undo the completion only")
        except RuntimeError:
            pass
        transaction.on_commit(lambda: read_during_callbacks(undone, reads["undone"]))
        assert undone.state() == EnlistedCompletion.ROLLED_BACK
    assert undone.state() == EnlistedCompletion.ROLLED_BACK
    with transaction.atomic():
        transaction.on_commit(lambda: read_during_callbacks(done, reads["committed"]))
        done = EnlistedCompletion(connection)
        assert done.state() == EnlistedCompletion.PENDING

    assert reads["undone"][-1] == EnlistedCompletion.ROLLED_BACK
    assert reads["committed"] == [EnlistedCompletion.COMMITTED] * 2
    assert done.state() == EnlistedCompletion.COMMITTED


def test_an_undone_completion_whose_later_commit_callback_raised_is_settled_by_the_outcome(rig):
    """A commit callback that raises leaves Django's commit flag set until the next
    transaction: read at settle time, the undone completion passed for one still committing,
    and the delivery was reported Completed while its row stayed InFlight (review helper-85)."""

    def undone_then_a_callback_raises(message: WorkMessage, context: WorkContext) -> Any:
        with transaction.atomic():
            write_effect(message, context)
            complete_then_undo(context)
            transaction.on_commit(lambda: 1 / 0)
        return Outcome.complete()  # not reached: the callback's error leaves the block

    sub = rig.subscription("tests.txn.body", max_attempts=3)
    receiver, delivery = rig.claim(sub, body(undone_then_a_callback_raises))

    result = rig.execution(sub, receiver, delivery).run()

    assert result.status == "Pending"
    row = Delivery.objects.get(pk=delivery.delivery_id)
    assert (row.status, row.attempt_count) == ("Pending", 1)
    assert "ZeroDivisionError" in row.last_error


def test_a_slow_commit_callback_after_an_undone_completion_leaves_the_lease_renewed(rig):
    """The same, end to end: the renewals stopped at the first one that fell inside the slow
    callback, and another host took the delivery over while its handler still ran."""

    def undone_then_slow_callback(message: WorkMessage, context: WorkContext) -> Any:
        with transaction.atomic():
            write_effect(message, context)
            complete_then_undo(context)
            transaction.on_commit(lambda: time.sleep(2.5))  # e-mails sent on commit
        time.sleep(8)  # the handler works on, well past its lease of 5 s
        return Outcome.complete()

    sub = rig.subscription("tests.txn.body", lease_seconds=5)
    receiver, delivery = rig.claim(sub, body(undone_then_slow_callback))
    future = rig.start(rig.execution(sub, receiver, delivery))

    time.sleep(8)
    assert transport.expire_leases_all() == []
    assert Receiver(sub.id, "host-b").receive(1).deliveries == []
    assert future.result(timeout=30) == ExecutionResult(ExecutionResult.SETTLED, "Completed")
    assert status(delivery) == ("Completed", 1)


@pytest.mark.parametrize("handler", ["lets the error out", "retries"])
def test_a_commit_whose_answer_was_lost_is_recorded_as_completed_not_as_a_lost_lease(
    rig, caplog, handler
):
    """The server committed the handler's block, completion included, and the connection
    failed before it said so: Django raised, the handler's error (or the retry it asked for,
    having caught that error) was settled, refused (the row was Completed), and the delivery
    was logged at ERROR as a lost lease that "may run again", which it never would."""

    def answer_lost_after_commit(message: WorkMessage, context: WorkContext) -> Any:
        real_commit = connection._commit

        def commits_then_fails() -> None:
            real_commit()
            raise OperationalError("server closed the connection unexpectedly")

        connection._commit = commits_then_fails
        try:
            with transaction.atomic():
                write_effect(message, context)
                context.complete(enlist=True)
        except OperationalError:
            if handler == "lets the error out":
                raise
            return Outcome.retry("the database went away", 0)
        finally:
            connection._commit = real_commit
        return Outcome.complete()

    sub = rig.subscription("tests.txn.body", max_attempts=3)
    receiver, delivery = rig.claim(sub, body(answer_lost_after_commit))

    with caplog.at_level(logging.WARNING):
        result = rig.execution(sub, receiver, delivery).run()

    assert result == ExecutionResult(ExecutionResult.SETTLED, "Completed")
    assert status(delivery) == ("Completed", 1)
    assert effects() == [(delivery.message_id, 1)]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


# -- refused: stale holder, cancel --------------------------------------------------------------


def test_a_stale_holder_is_refused_its_block_rolls_back_and_the_new_holders_write_stands(rig):
    sub = rig.subscription("tests.txn.body", lease_seconds=30)
    taken_over: list[ClaimedDelivery] = []

    def lease_taken_over_before_completing(message, context):
        with transaction.atomic():
            write_effect(message, context)
            # Meanwhile the lease expires and another host claims and completes the delivery.
            get_driver().shift_time(60, subscription_id=str(sub.id))
            transport.expire_leases_all()
            other = Receiver(sub.id, "host-b")
            (claimed,) = other.receive(1).deliveries
            taken_over.append(claimed)
            context.complete(enlist=True)  # the stale holder's: refused

    receiver, delivery = rig.claim(sub, body(lease_taken_over_before_completing))
    execution = rig.execution(sub, receiver, delivery)

    result = execution.run()

    assert result.kind == ExecutionResult.LEASE_LOST
    assert execution.signal.reason == AbortReason.LEASE_LOST
    assert effects() == []  # neither write of the stale holder's block
    (claimed,) = taken_over
    assert status(delivery) == ("InFlight", 2)
    assert Receiver(sub.id, "host-b").complete(claimed).settled


def test_a_cancel_before_the_completion_is_refused_as_cancelled_and_then_acknowledged(rig):
    sub = rig.subscription("tests.txn.body")
    raised: list[BaseException] = []

    def cancelled_while_running(message, context):
        transport.discard_or_cancel(str(sub.id), context.delivery_id, "operator", "stop")
        try:
            with transaction.atomic():
                write_effect(message, context)
                context.complete(enlist=True)
        except LeaseLost as exc:
            raised.append(exc)
            raise

    receiver, delivery = rig.claim(sub, body(cancelled_while_running))
    result = rig.execution(sub, receiver, delivery).run()

    [error] = raised
    assert isinstance(error, Cancelled) and "cancelled by an operator" in str(error)
    assert result == ExecutionResult(ExecutionResult.SETTLED, "Discarded")
    assert status(delivery) == ("Discarded", 1)
    assert effects() == []


# -- the row lock fences the delivery until the handler's transaction ends ----------------------


def test_heartbeats_while_the_completion_is_pending_do_not_wait_for_the_handlers_transaction(rig):
    # Lease 6 s: automatic renewals every 2 s, so several fall inside the 4.5 s hold.
    sub = rig.subscription(lease_seconds=6)
    payload = {"holdAfterCompleteMs": 4500, "heartbeatAfterComplete": True}
    receiver, delivery = rig.claim(sub, payload)
    future = rig.start(rig.execution(sub, receiver, delivery))

    samples = []
    deadline = time.monotonic() + 15
    while not future.done():
        if time.monotonic() > deadline:
            # Deadlocked: end the waiting sessions so the handler's transaction can end too.
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE wait_event_type = 'Lock' AND datname = current_database()"
                )
            future.exception(timeout=30)
            pytest.fail("a renewal waited for the row lock held by the handler's transaction")
        samples.append(lock_waits())
        time.sleep(0.05)

    assert future.result(timeout=30) == ExecutionResult(ExecutionResult.SETTLED, "Completed")
    assert len(samples) > 50 and max(samples) == 0, "a renewal waited for the row lock"
    [beat] = [e for e in txn_handlers.events if e["event"] == "heartbeat"]
    assert beat["held"] is True
    committed = [e for e in txn_handlers.events if e["event"] == "committed"]
    assert [e["signal"] for e in committed] == [None]
    assert status(delivery) == ("Completed", 1)


def test_past_the_lease_the_held_row_is_skipped_by_the_sweeper_and_claimers_until_commit(
    rig, caplog
):
    # The local horizon (lease 5 s + 0.5 s grace) passes while the handler's transaction
    # holds the row: it aborts nothing, and nobody can take the delivery over meanwhile.
    sub = rig.subscription(lease_seconds=5)
    receiver, delivery = rig.claim(sub, {"holdAfterCompleteMs": 7000})
    execution = rig.execution(sub, receiver, delivery, grace=0.5, heartbeat_mode="Manual")
    future = rig.start(execution)
    wait_for_phase(delivery.message_id, "completed")

    with caplog.at_level(logging.WARNING, logger="workqueue"):
        time.sleep(6)  # past the lease in the database and past the local horizon
    assert not future.done()
    assert transport.expire_leases_all() == []
    assert Receiver(sub.id, "host-b").receive(1).deliveries == []
    assert status(delivery) == ("InFlight", 1)
    # Said once, naming the delivery: a handler stuck there would hold it (and its key) for
    # as long as its transaction stays open, with nothing else in the logs to say so.
    [held] = [r.getMessage() for r in caplog.records if "past its lease" in r.getMessage()]
    assert delivery.delivery_id in held and "idle_in_transaction_session_timeout" in held

    assert future.result(timeout=30) == ExecutionResult(ExecutionResult.SETTLED, "Completed")
    assert execution.signal.reason is None
    assert status(delivery) == ("Completed", 1)
    assert effects() == [(delivery.message_id, 1)]


def test_a_block_rolled_back_after_the_lease_passed_is_retried_while_nobody_took_it_back(rig):
    """The handler's transaction held the row past the lease, then rolled back: the passed
    lease counts as lost (the handler is told), but nobody has taken the delivery back, so the
    failure is settled as any failure is, fenced by the token: retried now, where it was left
    to lease expiry to retry (review helper-180)."""
    sub = rig.subscription(lease_seconds=5)
    payload = {"holdAfterCompleteMs": 6500, "raiseAfterComplete": True}
    receiver, delivery = rig.claim(sub, payload)
    execution = rig.execution(sub, receiver, delivery, grace=0.5, heartbeat_mode="Manual")

    result = execution.run()

    assert (result.kind, result.status) == (ExecutionResult.SETTLED, "Pending")
    assert execution.signal.reason == AbortReason.LEASE_LOST
    assert effects() == []
    assert status(delivery) == ("Pending", 1)
    assert transport.expire_leases_all() == []


def wait_for_phase(message_id: str, phase: str) -> None:
    deadline = time.monotonic() + 15
    while phase not in phases(message_id):
        assert time.monotonic() < deadline, f"{phase} never reached: {phases(message_id)}"
        time.sleep(0.02)


# -- chaining the next step -----------------------------------------------------------------------


def test_a_publish_enlisted_in_the_block_exists_exactly_when_the_completion_committed(rig):
    sub = rig.subscription(max_attempts=3)
    next_topic = TopicFactory()
    SubscriptionFactory(topic=next_topic)
    receiver, delivery = rig.claim(
        sub, {"chainTopic": next_topic.name, "raiseAfterComplete": {"1": True}}
    )

    assert rig.execution(sub, receiver, delivery).run().status == "Pending"
    assert not Message.objects.filter(topic=next_topic).exists()

    receiver, again = rig.claim(sub)
    assert rig.execution(sub, receiver, again).run().status == "Completed"
    [chained] = Message.objects.filter(topic=next_topic)
    assert chained.payload == {"after": delivery.message_id}
    assert Delivery.objects.get(message=chained).status == "Pending"


# -- misuse is named ------------------------------------------------------------------------------


def test_completing_without_a_transaction_names_the_block_to_open(rig):
    raised: list[BaseException] = []

    def no_transaction(message, context):
        try:
            context.complete(enlist=True)
        except EnlistError as exc:
            raised.append(exc)
        return Outcome.complete()

    sub = rig.subscription("tests.txn.body")
    result = rig.run(sub, body(no_transaction))

    [error] = raised
    assert "needs an open transaction on database 'default'" in str(error)
    assert "transaction.atomic(using='default')" in str(error)
    assert result.status == "Completed"  # the returned outcome, settled as usual


def test_complete_without_enlist_says_how_to_complete(rig):
    def not_enlisted(message, context):
        with transaction.atomic():
            context.complete()

    sub = rig.subscription("tests.txn.body")
    receiver, delivery = rig.claim(sub, body(not_enlisted))
    assert rig.execution(sub, receiver, delivery).run().status == "Pending"
    error = Delivery.objects.get(pk=delivery.delivery_id).last_error
    assert "EnlistError" in error and "context.complete(enlist=True)" in error


@pytest.fixture
def second_alias() -> Iterator[str]:
    """A second database alias on the same test database (a project with two databases)."""
    alias = "elsewhere"
    connections.settings[alias] = {**connections.settings["default"]}
    # Connected here, past pytest-django's guard on aliases the test did not declare (this
    # one did not exist when the guard was set up); the handler runs on this thread.
    connections[alias].connect()
    try:
        yield alias
    finally:
        connections[alias].close()
        del connections[alias]
        del connections.settings[alias]


def test_a_transaction_on_another_alias_is_named_with_the_queues_alias(rig, second_alias):
    raised: list[BaseException] = []

    def other_alias(message, context):
        with transaction.atomic(using=second_alias):
            try:
                context.complete(enlist=True)
            except EnlistError as exc:
                raised.append(exc)
        return Outcome.complete()

    sub = rig.subscription("tests.txn.body")
    receiver, delivery = rig.claim(sub, body(other_alias))
    execution = rig.execution(sub, receiver, delivery)
    # Keep the connection opened above (a host closes aged connections around each handler).
    execution.services.refresh_connections = lambda: None
    execution.run()

    [error] = raised
    assert "found a transaction on database 'elsewhere'" in str(error)
    assert "the work queue uses 'default'" in str(error)


def test_completing_after_the_handler_returned_is_refused(rig):
    kept: list[WorkContext] = []

    def keeps_its_context(message, context):
        kept.append(context)
        return Outcome.retry("later", 0)

    sub = rig.subscription("tests.txn.body")
    receiver, delivery = rig.claim(sub, body(keeps_its_context))
    rig.execution(sub, receiver, delivery).run()

    with transaction.atomic(), pytest.raises(EnlistError, match="after its handler returned"):
        kept[0].complete(enlist=True)
    assert status(delivery) == ("Pending", 1)


def test_completing_twice_in_one_transaction_is_one_completion_and_again_after_commit_refused(
    rig,
):
    raised: list[BaseException] = []

    def completes_twice(message, context):
        with transaction.atomic():
            write_effect(message, context)
            context.complete(enlist=True)
            context.complete(enlist=True)
        try:
            with transaction.atomic():
                context.complete(enlist=True)
        except EnlistError as exc:
            raised.append(exc)
        return Outcome.complete()

    sub = rig.subscription("tests.txn.body")
    receiver, delivery = rig.claim(sub, body(completes_twice))

    assert rig.execution(sub, receiver, delivery).run().status == "Completed"
    [error] = raised
    assert "already completed in a transaction that has committed" in str(error)
    assert effects() == [(delivery.message_id, 1)]


# -- the runtime role and test mode -------------------------------------------------------------


def test_the_execute_only_runtime_role_completes_in_the_handlers_transaction(rig, pg_conn):
    sub = rig.subscription()
    publish(sub.topic.name, {"n": 1})
    with database_role(pg_conn, "wq_runtime") as role:
        call_command("workqueue", "grant-runtime", role)
        # The handler's own table, and the system user lookup: what the project grants.
        pg_conn.execute(f'GRANT INSERT, SELECT ON {txn_handlers.EFFECT_TABLE} TO "{role}"')
        pg_conn.execute(f'GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO "{role}"')
        owner = connection.settings_dict["USER"]
        connection.close()
        get_driver().close()
        connection.settings_dict["USER"] = role
        try:
            receiver, delivery = rig.claim(sub)
            result = rig.execution(sub, receiver, delivery).run()
            with connection.cursor() as cursor:
                cursor.execute("SELECT current_user")
                assert cursor.fetchone() == (role,)
        finally:
            connection.close()
            get_driver().close()
            connection.settings_dict["USER"] = owner
    assert result == ExecutionResult(ExecutionResult.SETTLED, "Completed")
    assert status(delivery) == ("Completed", 1)
    assert effects() == [(delivery.message_id, 1)]


@pytest.mark.django_db
@use_test_connection()
def test_run_until_idle_completes_inside_the_tests_own_transaction():
    txn_handlers.create_effect_table()  # rolled back with the test
    get_user_model().objects.create_user("workqueue-system")
    sub = SubscriptionFactory(handler_key="tests.txn.effect")
    message = publish(sub.topic.name, {"n": 1}).message_id

    [run] = run_until_idle(sub.name)

    assert run.status == "Completed"
    assert Delivery.objects.get(message_id=message).status == "Completed"
    assert effects() == [(message, 1)]


def test_a_raw_connection_sees_the_work_and_the_completion_appear_at_the_same_commit(rig):
    sub = rig.subscription()
    receiver, delivery = rig.claim(sub, {"holdAfterCompleteMs": 1500})
    future = rig.start(rig.execution(sub, receiver, delivery))
    wait_for_phase(delivery.message_id, "completed")

    with psycopg.connect(autocommit=True, **psycopg_params()) as other:

        def seen() -> tuple[int, str]:
            return other.execute(
                f"SELECT (SELECT count(*) FROM {txn_handlers.EFFECT_TABLE}), "
                "(SELECT status FROM workqueue_delivery WHERE id = %s)",
                [delivery.delivery_id],
            ).fetchone()

        assert seen() == (0, "InFlight")
        future.result(timeout=30)
        assert seen() == (1, "Completed")


# -- an operator meets the held row ---------------------------------------------------------------


def test_an_operator_discard_of_a_delivery_held_in_its_handlers_transaction_answers_at_once(rig):
    # The handler completed in its transaction and keeps it open for 8 s: its row is locked
    # until then. An operator (admin action, REST call, CLI) asking to discard the delivery
    # must not hang on that lock for as long as the handler keeps its transaction open.
    sub = rig.subscription(lease_seconds=30)
    receiver, delivery = rig.claim(sub, {"holdAfterCompleteMs": 8000})
    future = rig.start(rig.execution(sub, receiver, delivery))
    wait_for_phase(delivery.message_id, "completed")

    began = time.monotonic()
    with pytest.raises(DeliveryBusyError) as raised:
        operations.discard(sub.name, delivery.delivery_id, reason="stuck?")
    waited = time.monotonic() - began

    assert waited < 4, f"the operator waited {waited:.1f} s for the handler's transaction"
    assert delivery.delivery_id in str(raised.value)
    assert "try again" in str(raised.value).lower()
    assert future.result(timeout=30) == ExecutionResult(ExecutionResult.SETTLED, "Completed")
    assert status(delivery) == ("Completed", 1)
    # Once the transaction has ended the same request gets its ordinary answer.
    again = operations.discard(sub.name, delivery.delivery_id, reason="stuck?")
    assert (again.discarded, again.cancel_requested) == (False, False)


# -- isolation above READ COMMITTED -----------------------------------------------------------


@pytest.fixture
def repeatable_read(rig: Rig) -> Iterator[None]:
    """The project's connection at REPEATABLE READ, as Django's
    ``DATABASES[...]['OPTIONS']['isolation_level']`` sets it."""
    options = connection.settings_dict.setdefault("OPTIONS", {})
    before = dict(options)
    options["isolation_level"] = psycopg.IsolationLevel.REPEATABLE_READ
    connection.close()
    yield
    options.clear()
    options.update(before)
    connection.close()


def heartbeat_then_complete(message: WorkMessage, context: WorkContext) -> Outcome:
    with transaction.atomic():
        write_effect(message, context)  # the transaction's snapshot is taken here
        assert context.heartbeat({"message": "halfway"})  # the delivery's row changes
        context.complete(enlist=True)
    return Outcome.complete()


def read_committed_then_complete(message: WorkMessage, context: WorkContext) -> Outcome:
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
        return heartbeat_then_complete(message, context)


def test_a_completion_refused_above_read_committed_says_why_and_how_to_fix_it(rig, repeatable_read):
    """At REPEATABLE READ a renewal after the transaction's snapshot (the host's, every third
    of the lease, or the handler's heartbeat) made the completion fail as "could not serialize
    access due to concurrent update", retried to a dead letter with nothing naming the
    isolation level: every handler outlasting a third of its lease, every such Tasks API task
    (helper-124)."""
    sub = rig.subscription("tests.txn.body", max_attempts=1, heartbeat_mode="Manual")
    receiver, delivery = rig.claim(sub, body(heartbeat_then_complete))

    rig.execution(sub, receiver, delivery).run()

    row = Delivery.objects.get(pk=delivery.delivery_id)
    assert row.status == "DeadLettered"
    assert "above READ COMMITTED" in row.last_error
    assert "SET TRANSACTION ISOLATION LEVEL READ COMMITTED" in row.last_error
    assert effects() == []


def test_the_fix_the_refusal_names_completes_on_a_repeatable_read_connection(rig, repeatable_read):
    sub = rig.subscription("tests.txn.body", max_attempts=1, heartbeat_mode="Manual")
    receiver, delivery = rig.claim(sub, body(read_committed_then_complete))

    result = rig.execution(sub, receiver, delivery).run()

    assert result == ExecutionResult(ExecutionResult.SETTLED, "Completed")
    assert effects() == [(delivery.message_id, 1)]


@pytest.mark.parametrize(
    ("level", "warned"),
    [
        (psycopg.IsolationLevel.REPEATABLE_READ, True),
        (psycopg.IsolationLevel.SERIALIZABLE, True),
        (psycopg.IsolationLevel.READ_COMMITTED, False),
        (None, False),
    ],
)
def test_manage_py_check_warns_of_an_isolation_level_that_refuses_completions(
    monkeypatch, level, warned
):
    from workqueue.checks import check_settings

    options = {} if level is None else {"isolation_level": level}
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)

    found = [m.msg for m in check_settings() if m.id == "workqueue.W007"]

    if warned:
        [text] = found
        assert f"is {level.name.replace('_', ' ')}" in text and "READ COMMITTED" in text
    else:
        assert found == []


def _slot_freed_at(execution: Any, delivery: Any) -> list[tuple[str, int]]:
    """The row's (status, attempts) each time the execution passed its slot on."""
    seen: list[tuple[str, int]] = []
    execution._on_handler_done = lambda handled: seen.append(status(delivery)) or None
    return seen


def test_a_handler_past_its_horizon_but_never_told_keeps_its_slot_until_its_settle(rig):
    """Review helper-181: the slot was kept for the settle only when LeaseLost had been
    signalled. A handler that returns past its horizon before the timer gets there (a process
    resumed from a freeze) freed it at once, and its completion was batched: this consumer's
    own claim, woken by the freed slot, could take the delivery back first."""

    def body(message: Any, context: Any) -> Outcome:
        time.sleep(6.5)  # never reads its signal
        return Outcome.complete()

    _bodies["untold past the horizon"] = body
    sub = rig.subscription("tests.txn.body", lease_seconds=5)
    receiver, delivery = rig.claim(sub, {"body": "untold past the horizon"})
    execution = rig.execution(sub, receiver, delivery, grace=0.5, heartbeat_mode="Manual")
    execution._arm_horizon = lambda: None  # the timer thread late, as for a frozen process
    freed_at = _slot_freed_at(execution, delivery)

    result = execution.run()

    assert result == ExecutionResult(ExecutionResult.SETTLED, "Completed")
    assert freed_at == [("Completed", 1)], f"slot freed while the row was {freed_at}"


def test_a_block_rolled_back_past_the_lease_keeps_its_slot_until_its_settle(rig):
    """Review helper-181: the handler's transaction held the row past the lease and rolled
    back; the held-row watch (once a second) had told nothing by the handler's return, so the
    slot was freed before the settle recorded the retry."""

    def body(message: Any, context: Any) -> Outcome:
        try:
            with transaction.atomic():
                context.complete(enlist=True)
                time.sleep(6.5)
                raise RuntimeError("after completing")
        except RuntimeError:
            return Outcome.retry("rolled back")

    _bodies["rolled back past the lease"] = body
    sub = rig.subscription("tests.txn.body", lease_seconds=5)
    receiver, delivery = rig.claim(sub, {"body": "rolled back past the lease"})
    execution = rig.execution(sub, receiver, delivery, grace=0.5, heartbeat_mode="Manual")
    freed_at = _slot_freed_at(execution, delivery)

    result = execution.run()

    assert (result.kind, result.status) == (ExecutionResult.SETTLED, "Pending")
    assert freed_at == [("Pending", 1)], f"slot freed while the row was {freed_at}"


def test_an_unpartitioned_delivery_of_a_keyed_message_sends_no_key_release(rig, statements):
    """Review helper-194: the release went by the message's key, so a subscription without
    partitions sent a wq_release_key (answered with 0 rows) after each such completion."""
    sub = rig.subscription()  # partition mode None: its deliveries hold no key
    receiver, delivery = rig.claim(sub, {"n": 1}, key="customer-7")
    assert delivery.partition_key == "customer-7"  # the message's key, not the delivery's

    rig.execution(sub, receiver, delivery).run()

    assert [s for s in statements if "wq_release_key" in s] == []
