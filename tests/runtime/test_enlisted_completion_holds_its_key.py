"""A handler that completes its delivery inside its own transaction (``context.complete(
enlist=True)``) runs on after the commit: the README's own example mails the invoice after the
block. Its partition key was free from the commit on, so the key's next delivery started beside
the rest of the handler, on the same host or another, and for an Ordered key the second
message's handler could finish before the first one's returned (attack review helper-193;
every case failed before the fix). The completion now holds the key until the handler returns
or its lease ends."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import transaction

from tests.factories import SubscriptionFactory
from tests.support.handlers import registry
from tests.support.hosts import one, status_of, sub
from tests.support.waiting import wait_until
from workqueue import publish, transport
from workqueue.driver import get_driver
from workqueue.exceptions import TransientDriverError
from workqueue.models import Delivery
from workqueue.operators import operations
from workqueue.runtime.executor import AbortReason
from workqueue.runtime.handlers import BaseWorkHandler, register_handler
from workqueue.runtime.outcome import Outcome
from workqueue.testing import run_until_idle, use_test_connection
from workqueue.transport import Receiver

_spans: dict[str, list[float]] = {}
_lock = threading.Lock()


class CompleteThenMail(BaseWorkHandler):
    """The README's InvoiceHandler: writes and completes in one block, then mails."""

    def handle(self, message: Any, context: Any) -> Outcome:
        started = time.monotonic()
        with transaction.atomic():
            context.complete(enlist=True)  # last in the block
        time.sleep(message.payload.get("mailMs", 0) / 1000)  # mail_invoice(invoice)
        with _lock:
            _spans[message.payload["n"]] = [started, time.monotonic()]
        return Outcome.complete()


registry.register("tests.enlisted.complete_then_mail", CompleteThenMail)


@pytest.mark.usefixtures("queue_db")
@pytest.mark.parametrize("mode", ["Ordered", "Exclusive"])
@pytest.mark.parametrize("hosts", [1, 2], ids=["one host", "two hosts"])
def test_the_keys_next_delivery_waits_for_the_handler_that_completed_in_its_transaction(
    make_host, mode, hosts
):
    _spans.clear()
    s = sub(handler_key="tests.enlisted.complete_then_mail", partition_mode=mode, lease_seconds=30)
    for _ in range(hosts):
        make_host(one(s, concurrency=2)).start()
    first = publish(s.topic.name, {"n": "first", "mailMs": 1_500}, partition_key="k")
    second = publish(s.topic.name, {"n": "second", "mailMs": 0}, partition_key="k")

    wait_until(lambda: len(_spans) == 2, timeout=20)
    assert status_of(first.message_id) == status_of(second.message_id) == "Completed"
    (a_start, a_end), (b_start, _) = _spans["first"], _spans["second"]
    assert b_start >= a_end, (
        f"{mode}, {hosts} host(s): the second handler of key 'k' started "
        f"{b_start - a_start:.3f} s after the first started and "
        f"{a_end - b_start:.3f} s before the first returned"
    )
    # Let go when the handler returned: no completed row holds a lease any more.
    assert not Delivery.objects.filter(status="Completed", lease_expires_at__isnull=False).exists()


def _claim_and_complete_holding_the_key(subscription: Any) -> tuple[Receiver, Any]:
    receiver = Receiver(str(subscription.id), "host-a")
    (delivery,) = receiver.receive(1).deliveries
    with transaction.atomic():
        assert receiver.complete(
            delivery, connection=transaction.get_connection(), holding_key=True
        )
    return receiver, delivery


@pytest.mark.usefixtures("queue_db")
def test_a_key_held_by_a_host_that_died_is_free_when_its_lease_ends():
    """No release comes from a host killed after the commit: the key is held until the lease
    it had ends, then the next delivery is claimed (and the completed one never runs again)."""
    subscription = SubscriptionFactory(partition_mode="Exclusive", lease_seconds=30)
    done = publish(subscription.topic.name, {}, partition_key="k").message_id
    waiting = publish(subscription.topic.name, {}, partition_key="k").message_id
    _claim_and_complete_holding_the_key(subscription)
    other_host = Receiver(str(subscription.id), "host-b")

    held = other_host.receive(5).deliveries
    get_driver().shift_time(31, subscription_id=str(subscription.id))
    after_the_lease = [d.message_id for d in other_host.receive(5).deliveries]

    assert held == []
    assert after_the_lease == [waiting]
    assert status_of(done) == "Completed"


@pytest.mark.usefixtures("queue_db")
def test_letting_go_of_a_key_is_fenced_by_the_lease_token():
    subscription = SubscriptionFactory(partition_mode="Ordered", lease_seconds=30)
    publish(subscription.topic.name, {}, partition_key="k")
    waiting = publish(subscription.topic.name, {}, partition_key="k").message_id
    receiver, delivery = _claim_and_complete_holding_the_key(subscription)
    forged = dataclasses.replace(delivery, lease_token=str(uuid.uuid4()))

    refused = receiver.release_key(forged)
    still_held = Receiver(str(subscription.id), "host-b").receive(5).deliveries
    released = receiver.release_key(delivery)
    claimed = [d.message_id for d in Receiver(str(subscription.id), "host-b").receive(5).deliveries]

    assert (refused.settled, still_held, released.settled) == (False, [], True)
    assert claimed == [waiting]


@pytest.mark.usefixtures("queue_db")
def test_a_keyless_delivery_completed_in_its_transaction_holds_no_lease():
    """Only a partition key is held: a delivery of a subscription without partitions is
    completed as before, its lease cleared."""
    subscription = SubscriptionFactory()
    publish(subscription.topic.name, {}, partition_key="k")
    _, delivery = _claim_and_complete_holding_the_key(subscription)

    row = Delivery.objects.get(pk=delivery.delivery_id)
    assert (row.status, row.lease_token, row.lease_expires_at) == ("Completed", None, None)


class CompleteEarlyInALongBlock(BaseWorkHandler):
    """Completes, then goes on in the same block (the row stays locked until the commit, even
    past the lease), then runs a tail after it."""

    def handle(self, message: Any, context: Any) -> Outcome:
        started = time.monotonic()
        with transaction.atomic():
            context.complete(enlist=True)
            time.sleep(message.payload.get("blockMs", 0) / 1000)
        time.sleep(message.payload.get("mailMs", 0) / 1000)
        with _lock:
            _spans[message.payload["n"]] = [started, time.monotonic()]
        return Outcome.complete()


registry.register("tests.enlisted.complete_early", CompleteEarlyInALongBlock)


@pytest.mark.usefixtures("queue_db")
@pytest.mark.parametrize(
    ("handler_key", "first"),
    [
        ("tests.enlisted.complete_then_mail", {"mailMs": 9_000}),
        ("tests.enlisted.complete_early", {"blockMs": 6_000, "mailMs": 1_500}),
    ],
    ids=["a tail longer than the lease", "a block that outlasted the lease"],
)
def test_the_key_stays_held_past_the_lease_the_handler_had_at_its_commit(
    make_host, handler_key, first
):
    """Review helper-194: renewals stopped at the commit, so the hold lasted what was left of
    the lease: a tail longer than that, or any tail after a block that had outlasted its
    lease, ran beside the key's next delivery. The hold starts with a whole lease and is
    renewed until the handler returns."""
    _spans.clear()
    s = sub(handler_key=handler_key, partition_mode="Ordered", lease_seconds=5)
    make_host(one(s, concurrency=2)).start()
    publish(s.topic.name, {"n": "first", **first}, partition_key="k")
    publish(s.topic.name, {"n": "second"}, partition_key="k")

    wait_until(lambda: len(_spans) == 2, timeout=30)
    (_, a_end), (b_start, _) = _spans["first"], _spans["second"]
    assert b_start >= a_end, (
        f"the second handler of key 'k' started {a_end - b_start:.3f} s before the first returned"
    )


@register_handler("tests.enlisted.creates_a_user")
class CreatesAUserAndCompletes(BaseWorkHandler):
    def handle(self, message: Any, context: Any) -> Outcome:
        with transaction.atomic():
            get_user_model().objects.create(username=f"seen-{message.payload['n']}")
            context.complete(enlist=True)
        return Outcome.complete()


@pytest.mark.django_db
@use_test_connection()
@pytest.mark.parametrize("mode", ["Exclusive", "Ordered"])
def test_run_until_idle_runs_every_message_of_a_key_whose_handler_completes_in_its_block(mode):
    """Review helper-194: in a test's transaction the handler's completion is still open when
    it returns, so the key was never let go, and with the test's clock standing still the
    key's second message never ran (no warning said so)."""
    get_user_model().objects.create_user("workqueue-system")
    s = SubscriptionFactory(handler_key="tests.enlisted.creates_a_user", partition_mode=mode)
    publish(s.topic.name, {"n": 1}, partition_key="k")
    publish(s.topic.name, {"n": 2}, partition_key="k")

    runs = run_until_idle()

    assert [r.status for r in runs] == ["Completed", "Completed"], runs


@pytest.mark.usefixtures("queue_db")
@pytest.mark.parametrize("mode", ["Exclusive", "Ordered"])
def test_the_autoscaler_backlog_counts_a_held_key_in_flight_not_claimable(mode):
    """Review helper-194: wq_backlog counted the held key's next delivery claimable while every
    claim returned nothing, and its running handler as nothing in flight."""
    s = SubscriptionFactory(partition_mode=mode, lease_seconds=60)
    publish(s.topic.name, {}, partition_key="k")
    publish(s.topic.name, {}, partition_key="k")
    _claim_and_complete_holding_the_key(s)

    found = transport.backlog(str(s.id))

    assert Receiver(str(s.id), "host-b").receive(5).deliveries == []
    assert (found.claimable, found.in_flight) == (0, 1)


@pytest.mark.usefixtures("queue_db")
def test_the_partition_listing_shows_a_key_held_by_its_running_handler_in_flight():
    s = SubscriptionFactory(partition_mode="Exclusive", lease_seconds=60)
    publish(s.topic.name, {}, partition_key="k")
    publish(s.topic.name, {}, partition_key="k")
    _claim_and_complete_holding_the_key(s)

    items, _ = transport.list_partitions(str(s.id), None, None, 100)
    (listed,) = operations.list_partitions(s.name, condition="InFlight").items

    assert [(i.partition_key, i.condition) for i in items] == [("k", "InFlight")], items
    # With its holder and the hold's end, as a key in flight is listed.
    assert (listed.lease_owner, listed.lease_expires_at is not None) == ("host-a", True)


@pytest.mark.usefixtures("queue_db")
def test_the_sweeper_clears_a_hold_nobody_let_go_of_once_it_has_passed():
    """Review helper-194: a host that died after the commit (or whose release failed) left the
    completed row naming a lease holder for good (the admin and the REST API showed it leased,
    and it stayed in the holds' index); the key itself was free once the lease passed."""
    from workqueue.runtime.sweeper import Sweeper

    subscription = SubscriptionFactory(partition_mode="Exclusive", lease_seconds=30)
    publish(subscription.topic.name, {}, partition_key="k")
    _, held = _claim_and_complete_holding_the_key(subscription)
    Sweeper().run_once()
    still_held = Delivery.objects.get(pk=held.delivery_id).lease_token
    get_driver().shift_time(31, subscription_id=str(subscription.id))

    Sweeper().run_once()

    row = Delivery.objects.get(pk=held.delivery_id)
    assert still_held is not None  # a live hold is left alone
    assert (row.status, row.lease_owner, row.lease_token, row.lease_expires_at) == (
        "Completed",
        None,
        None,
        None,
    )


_events: dict[str, float] = {}
_renewals_down = threading.Event()


class CompletesAfterTheHorizonThenMails(BaseWorkHandler):
    """Ignores a LeaseLost from the local horizon (a slow API call), then completes in its
    transaction (accepted: nobody took the delivery over) and mails for longer than a lease."""

    def handle(self, message: Any, context: Any) -> Outcome:
        if message.payload.get("n") == "first":
            deadline = time.monotonic() + 15
            while not context.signal.has(AbortReason.LEASE_LOST) and time.monotonic() < deadline:
                time.sleep(0.05)
            _events["told_lost"] = time.monotonic()
            _renewals_down.clear()  # the renewal outage is over
            with transaction.atomic():
                context.complete(enlist=True)
            _events["committed"] = time.monotonic()
            time.sleep(message.payload["mailMs"] / 1000)  # mail_invoice(invoice)
            _events["first_returned"] = time.monotonic()
        else:
            _events["second_started"] = time.monotonic()
        return Outcome.complete()


registry.register("tests.enlisted.after_horizon", CompletesAfterTheHorizonThenMails)


@pytest.mark.usefixtures("queue_db")
def test_a_completion_accepted_after_the_horizon_said_lease_lost_holds_the_key_until_return(
    make_host, monkeypatch
):
    """Review helper-195: renewals failed until the local horizon told the handler LeaseLost;
    nobody had taken the delivery, so its completion was accepted, but renewing had stopped
    for good (the stale local lease): the hold lapsed after one lease, and the key's next
    delivery was claimed while the handler's tail still ran."""
    _events.clear()
    extend = Receiver.extend_lease

    def down_for_a_while(self: Receiver, delivery: Any, progress: Any = None) -> Any:
        if _renewals_down.is_set():
            raise TransientDriverError("connection refused (renewal outage)")
        return extend(self, delivery, progress)

    monkeypatch.setattr(Receiver, "extend_lease", down_for_a_while)
    _renewals_down.set()
    s = sub(handler_key="tests.enlisted.after_horizon", partition_mode="Exclusive", lease_seconds=5)
    make_host(one(s, concurrency=1)).start()
    first = publish(s.topic.name, {"n": "first", "mailMs": 12_000}, partition_key="k")
    wait_until(lambda: "committed" in _events, timeout=25)
    assert Delivery.objects.get(message_id=first.message_id).status == "Completed"
    publish(s.topic.name, {"n": "second"}, partition_key="k")
    other_host = Receiver(str(s.id), "host-b")
    claimed: list[float] = []
    while "first_returned" not in _events and not claimed:
        if other_host.receive(1).deliveries:
            claimed.append(time.monotonic())
        time.sleep(0.2)
    assert not claimed, (
        f"the key's next delivery was claimed {claimed[0] - _events['committed']:.1f} s after the "
        "commit, while the first handler still ran (its hold was never renewed)"
    )


class CompleteThenTail(BaseWorkHandler):
    def handle(self, message: Any, context: Any) -> Outcome:
        started = time.monotonic()
        with transaction.atomic():
            context.complete(enlist=True)
        _spans.setdefault("committed:" + message.payload["n"], [time.monotonic()])
        time.sleep(message.payload.get("mailMs", 0) / 1000)
        _spans[message.payload["n"]] = [started, time.monotonic()]
        return Outcome.complete()


registry.register("tests.enlisted.complete_then_tail", CompleteThenTail)


@pytest.mark.usefixtures("queue_db")
def test_a_release_that_fails_once_does_not_stall_the_key_for_a_whole_lease(make_host, monkeypatch):
    """Review helper-195: every other settle is tried again while its lease lasts (fenced by
    the token); the release was sent once, and one dropped connection left the Ordered key idle
    a whole lease."""
    _spans.clear()
    release = Receiver.release_key
    failed: list[int] = []

    def drops_once(self: Receiver, delivery: Any) -> Any:
        if not failed:
            failed.append(1)
            raise TransientDriverError("server closed the connection unexpectedly")
        return release(self, delivery)

    monkeypatch.setattr(Receiver, "release_key", drops_once)
    s = sub(
        handler_key="tests.enlisted.complete_then_tail", partition_mode="Ordered", lease_seconds=20
    )
    make_host(one(s, concurrency=2)).start()
    publish(s.topic.name, {"n": "first", "mailMs": 500}, partition_key="k")
    publish(s.topic.name, {"n": "second"}, partition_key="k")

    wait_until(lambda: "second" in _spans, timeout=40)
    gap = _spans["second"][0] - _spans["first"][1]
    assert failed and gap < 5, (
        f"the key's next message started {gap:.1f} s after the first returned"
    )


@pytest.mark.usefixtures("queue_db")
def test_a_replan_while_the_handler_runs_on_keeps_the_key_held(make_host, monkeypatch):
    """The consumer a re-plan stops lets its handler run on (process_lives_on), and the key
    stays held until it returns."""
    from workqueue.models import Subscription
    from workqueue.runtime.consumer import Consumer

    stops: list[bool] = []
    stop = Consumer.stop

    def watched(self: Any, *, process_lives_on: bool = False) -> None:
        stops.append(process_lives_on)
        stop(self, process_lives_on=process_lives_on)

    monkeypatch.setattr(Consumer, "stop", watched)

    _spans.clear()
    s = sub(
        handler_key="tests.enlisted.complete_then_tail", partition_mode="Exclusive", lease_seconds=5
    )
    host = make_host(one(s, concurrency=2), reconcile_interval_ms=100)
    host.start()
    publish(s.topic.name, {"n": "first", "mailMs": 9_000}, partition_key="k")
    wait_until(lambda: "committed:first" in _spans, timeout=10)
    Subscription.objects.filter(pk=s.pk).update(max_attempts=7)  # the host re-plans
    publish(s.topic.name, {"n": "second"}, partition_key="k")
    wait_until(lambda: "second" in _spans and "first" in _spans, timeout=40)
    (_, a_end), (b_start, _) = _spans["first"], _spans["second"]
    assert True in stops, stops  # a re-plan did stop the consumer
    assert b_start >= a_end, f"second started {a_end - b_start:.1f} s before the first returned"


_beats: dict[str, list[bool]] = {}


class ManualCompleteThenBeat(BaseWorkHandler):
    def handle(self, message: Any, context: Any) -> Outcome:
        with transaction.atomic():
            context.complete(enlist=True)
        answers = _beats.setdefault(message.payload["n"], [])
        for _ in range(3):
            time.sleep(0.5)
            answers.append(context.heartbeat({"step": len(answers)}))
        _spans[message.payload["n"]] = [0.0, time.monotonic()]
        return Outcome.complete()


registry.register("tests.enlisted.manual_beat", ManualCompleteThenBeat)


@pytest.mark.usefixtures("queue_db")
@pytest.mark.parametrize("mode", ["Exclusive", "None"])
def test_a_manual_handlers_heartbeat_after_its_commit_does_not_tell_it_to_stop(make_host, mode):
    """Review helper-195: context.heartbeat() 'returns False once the lease is lost, the
    delivery was cancelled or the time cap passed, and the handler should then stop'. After a
    commit it answered False (a keyed one True, once the hold was renewed): a handler that
    obeys dropped the rest of its work (the README's mail_invoice) though nothing went
    wrong."""
    _beats.clear()
    _spans.clear()
    s = sub(
        handler_key="tests.enlisted.manual_beat",
        partition_mode=mode,
        heartbeat_mode="Manual",
        lease_seconds=5,
    )
    make_host(one(s, concurrency=1)).start()
    publish(s.topic.name, {"n": "x"}, partition_key="k")
    wait_until(lambda: "x" in _spans, timeout=20)
    assert _beats["x"] == [True, True, True], (mode, _beats["x"])


@pytest.mark.usefixtures("queue_db")
def test_stats_and_metrics_count_a_held_keys_running_handler_in_flight_as_the_backlog_does():
    """Review helper-195: wq_backlog and the partition listing counted the handler in flight;
    the stats (`workqueue stats`, /metrics' workqueue_in_flight_deliveries, retire's wait for
    running deliveries) said nothing ran."""
    s = SubscriptionFactory(partition_mode="Exclusive", lease_seconds=60)
    publish(s.topic.name, {}, partition_key="k")
    publish(s.topic.name, {}, partition_key="k")
    _claim_and_complete_holding_the_key(s)

    stats = transport.subscription_stats(str(s.id))
    gauges = transport.queue_gauges(str(s.id), 1000)

    assert (stats["in_flight"], gauges["in_flight"]) == (1, 1), (stats, gauges)
