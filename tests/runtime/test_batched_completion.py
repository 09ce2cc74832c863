"""Completions handed to the consumer's batcher (``DeliveryExecution.run_then`` with
``complete_later``): the handler's thread is freed at once, and the batch still fences every row
by its own lease token, so a stale holder's completion is refused and reported as a lost lease
while the rows it does hold complete."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import pytest
from django.contrib.auth import get_user_model

from tests.factories import SubscriptionFactory
from workqueue import publish
from workqueue.driver import get_driver
from workqueue.models import Delivery
from workqueue.runtime.consumer import CompletionBatcher
from workqueue.runtime.executor import DeliveryExecution, ExecutionResult, ExecutionServices
from workqueue.runtime.handlers import BaseWorkHandler, HandlerRegistry
from workqueue.runtime.outcome import Outcome
from workqueue.runtime.plan import SubscriptionPlan
from workqueue.runtime.timers import TimerQueue
from workqueue.runtime.workers import WorkerPool
from workqueue.transport import Receiver
from workqueue.types import ClaimedDelivery

pytestmark = pytest.mark.django_db(transaction=True)


class CompleteHandler(BaseWorkHandler):
    def handle(self, message: Any, context: Any) -> Outcome:
        return Outcome.complete()


registry = HandlerRegistry()
registry.register("tests.batched.complete", CompleteHandler)


@pytest.fixture
def services() -> Any:
    timers = TimerQueue("test-timers")
    background = WorkerPool(2, "test-background")
    made: list[CompletionBatcher] = []

    def make(receiver: Receiver) -> ExecutionServices:
        batcher = CompletionBatcher(receiver, "test")
        made.append(batcher)
        return ExecutionServices(
            receiver=receiver,
            complete=batcher.complete,
            complete_later=batcher.complete_later,
            timers=timers,
            background=background,
            handlers=registry,
            user=get_user_model().objects.create(username="batched-completion"),
        )

    yield make
    for batcher in made:
        batcher.stop()
    background.shutdown()
    timers.stop()


def _run_then(
    delivery: ClaimedDelivery, plan: SubscriptionPlan, services: ExecutionServices
) -> Future[ExecutionResult]:
    """Run the execution on a thread of its own; the future gets what ``finish`` was given."""
    finished: Future[ExecutionResult] = Future()
    returned = threading.Event()

    def target() -> None:
        DeliveryExecution(delivery, plan, services).run_then(finished.set_result)
        returned.set()

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(10)
    assert returned.is_set(), "run_then did not return"
    return finished


def _batches_wait_at_a_gate(receiver: Receiver) -> threading.Event:
    """Make ``receiver``'s batched completions wait (up to 10 s) until the returned event is
    set, so that more completions queue behind the first batch meanwhile."""
    gate = threading.Event()
    real = receiver.complete_many

    def held_at_the_gate(deliveries: Any) -> Any:
        gate.wait(10)
        return real(deliveries)

    receiver.complete_many = held_at_the_gate  # type: ignore[method-assign]
    return gate


def test_a_batched_completion_by_a_stale_holder_is_refused_and_reported_as_a_lost_lease(
    services,
):
    sub = SubscriptionFactory(
        handler_key="tests.batched.complete",
        lease_seconds=30,
        backoff_base_seconds=0,
        backoff_max_seconds=0,
    )
    plan = SubscriptionPlan.from_subscription(sub)
    old_holder, new_holder = Receiver(sub.id, "old-holder"), Receiver(sub.id, "new-holder")
    publish(sub.topic.name, {"n": 1})
    (stale,) = old_holder.receive(1).deliveries
    get_driver().shift_time(31, subscription_id=str(sub.id))
    (taken_over,) = new_holder.receive(1).deliveries
    assert taken_over.delivery_id == stale.delivery_id
    publish(sub.topic.name, {"n": 2})
    (held,) = old_holder.receive(1).deliveries

    old_services = services(old_holder)
    # The stale holder's clock: its lease horizon has not passed yet, so only the database's
    # fence can tell that the delivery is no longer its own.
    stale_result = _run_then(stale, plan, old_services)
    held_result = _run_then(held, plan, old_services)

    assert stale_result.result(10) == ExecutionResult(ExecutionResult.LEASE_LOST)
    assert held_result.result(10) == ExecutionResult(ExecutionResult.SETTLED, "Completed")
    rows = {str(d.id): d for d in Delivery.objects.filter(subscription=sub)}
    assert (rows[stale.delivery_id].status, rows[stale.delivery_id].lease_owner) == (
        "InFlight",
        "new-holder",
    )
    assert str(rows[stale.delivery_id].lease_token) == taken_over.lease_token
    assert rows[held.delivery_id].status == "Completed"


def test_a_batched_completion_frees_the_handlers_thread_before_the_batch_settles(services):
    sub = SubscriptionFactory(handler_key="tests.batched.complete")
    plan = SubscriptionPlan.from_subscription(sub)
    receiver = Receiver(sub.id, "holder")
    publish(sub.topic.name, {"n": 1})
    (delivery,) = receiver.receive(1).deliveries
    gate = _batches_wait_at_a_gate(receiver)
    finished = _run_then(delivery, plan, services(receiver))

    assert not finished.done(), "the handler's thread waited for the batch"
    gate.set()
    assert finished.result(10) == ExecutionResult(ExecutionResult.SETTLED, "Completed")
    assert Delivery.objects.get(pk=delivery.delivery_id).status == "Completed"


def test_a_failed_batch_settles_its_completions_alone(services):
    sub = SubscriptionFactory(handler_key="tests.batched.complete")
    plan = SubscriptionPlan.from_subscription(sub)
    receiver = Receiver(sub.id, "holder")
    publish(sub.topic.name, {"n": 1})
    (delivery,) = receiver.receive(1).deliveries
    calls = []
    real = receiver.complete_many

    def failing_once(deliveries: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the batch failed")
        return real(deliveries)

    receiver.complete_many = failing_once  # type: ignore[method-assign]
    finished = _run_then(delivery, plan, services(receiver))

    assert finished.result(10) == ExecutionResult(ExecutionResult.SETTLED, "Completed")
    assert Delivery.objects.get(pk=delivery.delivery_id).status == "Completed"


def test_two_holders_of_one_delivery_in_one_batch_are_each_told_their_own_result():
    """Audit helper-94: a batch's results are keyed by delivery id, so a stale holder's
    completion batched with the re-claimer's (the same delivery id; on AWS two copies of one
    message) was told the other's result: here the refused one read Completed. A second
    completion of an id already in the batch now goes in the next batch."""
    sub = SubscriptionFactory(handler_key="tests.batched.complete", lease_seconds=30)
    receiver = Receiver(sub.id, "holder")
    publish(sub.topic.name, {"n": 1})
    publish(sub.topic.name, {"n": 2})
    (first, stale) = receiver.receive(2).deliveries
    get_driver().shift_time(31, subscription_id=str(sub.id))
    (current,) = [d for d in receiver.receive(2).deliveries if d.delivery_id == stale.delivery_id]
    gate = _batches_wait_at_a_gate(receiver)
    batcher = CompletionBatcher(receiver, "test")
    told: dict[str, Future[Any]] = {"stale": Future(), "current": Future()}
    try:
        # The first batch waits at the gate while the two holders' completions queue behind it.
        assert batcher.complete_later(first, lambda outcome: None)
        assert batcher.complete_later(stale, told["stale"].set_result)
        assert batcher.complete_later(current, told["current"].set_result)
        gate.set()
        results = {who: future.result(10) for who, future in told.items()}
    finally:
        gate.set()
        batcher.stop()

    assert (results["stale"].outcome, results["current"].outcome) == ("LeaseLost", "Settled")
    assert Delivery.objects.get(pk=stale.delivery_id).status == "Completed"
