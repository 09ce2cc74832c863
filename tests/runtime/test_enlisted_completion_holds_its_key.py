"""A handler that completes its delivery inside its own transaction (``context.complete(
enlist=True)``) runs on after the commit: the README's own example mails the invoice after the
block. Its partition key was free from the commit on, so the key's next delivery started beside
the rest of the handler, on the same host or another, and for an Ordered key the second
message's handler could finish before the first one's returned (attack review helper-193;
every case failed before the fix). The completion now holds the key until the handler returns
or its lease ends."""

from __future__ import annotations

import dataclasses
import sys
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
from workqueue.runtime.executor import AbortReason, DeliveryExecution
from workqueue.runtime.handlers import BaseWorkHandler, register_handler
from workqueue.runtime.outcome import Outcome
from workqueue.testing import run_until_idle, use_test_connection
from workqueue.transport import Receiver
from workqueue.types import LeaseState


def renewals_fail_while(monkeypatch: pytest.MonkeyPatch, outage: threading.Event) -> None:
    """This host's lease renewals fail (the database out of its reach) while ``outage`` is set;
    the test's other host, ``host-b``, is not cut off."""
    extend = Receiver.extend_lease

    def cut_off(self: Receiver, delivery: Any, progress: Any = None) -> Any:
        if outage.is_set() and self.lease_owner != "host-b":
            raise TransientDriverError("connection refused (renewal outage)")
        return extend(self, delivery, progress)

    monkeypatch.setattr(Receiver, "extend_lease", cut_off)


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
    # Let go once each handler returned (the span is written just before the return, the
    # release just after it): no completed row holds a lease any more.
    wait_until(
        lambda: not Delivery.objects.filter(
            status="Completed", lease_expires_at__isnull=False
        ).exists(),
        timeout=10,
    )


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
    """Completes, then goes on in the same block past a lease's length (the row stays locked
    until the commit), then looks at its signal after the commit."""

    def handle(self, message: Any, context: Any) -> Outcome:
        with transaction.atomic():
            context.complete(enlist=True)
            time.sleep(message.payload["blockMs"] / 1000)
        told = context.signal.wait(3)  # the hold's renewal is refused: it has lapsed
        _spans[message.payload["n"]] = [float(told), time.monotonic()]
        return Outcome.complete()


registry.register("tests.enlisted.complete_early", CompleteEarlyInALongBlock)


@pytest.mark.usefixtures("queue_db")
def test_a_block_that_went_on_past_the_lease_after_the_call_tells_its_handler_the_hold_lapsed(
    make_host,
):
    """The hold counts a whole lease from the complete call (keep the call last in the block):
    a block that went on for longer commits with the hold run out, and the key may be claimed
    from then on. The handler is told, as one whose lease ran out (it read "all well" before,
    or its lapsed hold was renewed beside the key's next holder: review helper-196)."""
    _spans.clear()
    s = sub(handler_key="tests.enlisted.complete_early", partition_mode="Ordered", lease_seconds=5)
    make_host(one(s, concurrency=1)).start()
    first = publish(s.topic.name, {"n": "first", "blockMs": 6_000}, partition_key="k")

    wait_until(lambda: "first" in _spans, timeout=20)

    assert _spans["first"][0] == 1.0, "the handler was not told its hold had lapsed"
    assert status_of(first.message_id) == "Completed"


@pytest.mark.usefixtures("queue_db")
def test_the_key_stays_held_past_the_lease_the_handler_had_at_its_commit(make_host):
    """Review helper-194: renewals stopped at the commit, so the hold lasted what was left of
    the lease: a tail longer than that ran beside the key's next delivery. The hold is renewed
    until the handler returns."""
    _spans.clear()
    s = sub(
        handler_key="tests.enlisted.complete_then_mail", partition_mode="Ordered", lease_seconds=5
    )
    make_host(one(s, concurrency=2)).start()
    publish(s.topic.name, {"n": "first", "mailMs": 9_000}, partition_key="k")
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
    renewals_fail_while(monkeypatch, _renewals_down)
    _renewals_down.set()
    s = sub(handler_key="tests.enlisted.after_horizon", partition_mode="Exclusive", lease_seconds=5)
    make_host(one(s, concurrency=1)).start()
    first = publish(s.topic.name, {"n": "first", "mailMs": 12_000}, partition_key="k")
    wait_until(lambda: "committed" in _events, timeout=25)
    assert Delivery.objects.get(message_id=first.message_id).status == "Completed"
    publish(s.topic.name, {"n": "second"}, partition_key="k")
    taken = claimed_before_the_first_returned(s)
    assert taken is None, (
        f"the key's next delivery was claimed {taken:.1f} s after the commit, while the first "
        "handler still ran (its hold was never renewed)"
    )


def claimed_before_the_first_returned(s: Any) -> float | None:
    """How long after the first handler's commit another host claimed the key's next delivery
    while the first handler still ran (asked every 0.2 s); None when it never could."""
    other_host = Receiver(str(s.id), "host-b")
    while "first_returned" not in _events:
        if other_host.receive(1).deliveries:
            return time.monotonic() - _events["committed"]
        time.sleep(0.2)
    return None


_tick_gave_up = threading.Event()
_committed = threading.Event()


class CompletesAsTheRenewalsGiveUp(BaseWorkHandler):
    """Completes in its transaction just as the automatic renewals, stopped by a lease that ran
    out in an outage, decide they are over; then mails for longer than a lease."""

    def handle(self, message: Any, context: Any) -> Outcome:
        if message.payload.get("n") == "first":
            _tick_gave_up.wait(15)
            _renewals_down.clear()
            with transaction.atomic():
                context.complete(enlist=True)
            _events["committed"] = time.monotonic()
            _committed.set()
            time.sleep(message.payload["mailMs"] / 1000)
            _events["first_returned"] = time.monotonic()
        return Outcome.complete()


registry.register("tests.enlisted.as_renewals_give_up", CompletesAsTheRenewalsGiveUp)


@pytest.mark.usefixtures("queue_db")
def test_renewals_that_give_up_as_the_completion_commits_go_on_for_the_hold(make_host, monkeypatch):
    """Review helper-196's race, made to happen: an automatic renewal decided renewing was over
    (the lease had run out in an outage), the completion's commit then found the renewals not
    yet stopped and did not restart them, and only then did the renewal say they had stopped.
    The hold was renewed once, at the commit, lapsed a lease later, and the key's next delivery
    was claimed while the handler still ran."""
    _events.clear()
    _tick_gave_up.clear()
    _committed.clear()
    renewals_fail_while(monkeypatch, _renewals_down)
    _renewals_down.set()
    decide = DeliveryExecution._stopped_renewing

    def deciding_as_the_commit_lands(execution: DeliveryExecution) -> bool:
        stopped = decide(execution)
        deciding_for_the_ticks = sys._getframe(1).f_code.co_name in (
            "_auto_heartbeat_tick",
            "_schedule_auto_heartbeat",
        )
        if stopped and deciding_for_the_ticks and not _tick_gave_up.is_set():
            _tick_gave_up.set()
            # The commit lands, and the renewal it sends is answered, between the decision
            # and its effect (a thread descheduled for one round trip on a loaded machine).
            _committed.wait(3)
            answered_by = time.monotonic() + 3
            while execution._beat_in_flight is not None and time.monotonic() < answered_by:
                time.sleep(0.01)
        return stopped

    monkeypatch.setattr(DeliveryExecution, "_stopped_renewing", deciding_as_the_commit_lands)
    s = sub(
        handler_key="tests.enlisted.as_renewals_give_up",
        partition_mode="Exclusive",
        lease_seconds=5,
    )
    make_host(one(s, concurrency=1)).start()
    publish(s.topic.name, {"n": "first", "mailMs": 9_000}, partition_key="k")
    wait_until(lambda: "committed" in _events, timeout=30)
    publish(s.topic.name, {"n": "second"}, partition_key="k")
    taken = claimed_before_the_first_returned(s)
    assert taken is None, (
        f"the key's next delivery was claimed {taken:.1f} s after the commit, while the first "
        "handler still ran (its renewals stopped at the commit)"
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


@pytest.mark.usefixtures("queue_db")
def test_a_lapsed_hold_is_not_renewed_once_the_keys_next_delivery_was_claimed():
    """Review helper-196: wq_extend_lease renewed any Completed row with a lease, passed or
    not. A hold that lapsed (renewals failed for a lease: an outage, a GC pause, a Manual
    handler that beat late) has let the key's next delivery be claimed; the late renewal then
    answered Held and put the hold
    back, so the tail runs beside the key's next delivery told that it holds the key, and the
    key counts twice in flight."""
    s = SubscriptionFactory(partition_mode="Exclusive", lease_seconds=30)
    publish(s.topic.name, {}, partition_key="k")
    publish(s.topic.name, {}, partition_key="k")
    receiver, held = _claim_and_complete_holding_the_key(s)
    get_driver().shift_time(31, subscription_id=str(s.id))  # the hold lapsed
    (next_one,) = Receiver(str(s.id), "host-b").receive(5).deliveries  # the key's next delivery

    late = receiver.extend_lease(held)

    stats = transport.subscription_stats(str(s.id))
    assert late.state != LeaseState.HELD, (
        f"the lapsed hold was renewed ({late.state}) while delivery {next_one.delivery_id} of "
        f"the same key runs; in_flight counts {stats['in_flight']} for one key"
    )


_waited_beats: list[bool] = []
_go_on = threading.Event()
_done = threading.Event()


class ManualCompleteWaitBeat(BaseWorkHandler):
    def handle(self, message: Any, context: Any) -> Outcome:
        with transaction.atomic():
            context.complete(enlist=True)
        _go_on.wait(30)  # the hold lapses meanwhile, and the key's next delivery is claimed
        _waited_beats.append(context.heartbeat())
        _done.set()
        return Outcome.complete()


registry.register("tests.enlisted.manual_wait_beat", ManualCompleteWaitBeat)


@pytest.mark.usefixtures("queue_db")
def test_a_manual_heartbeat_says_false_once_the_keys_next_delivery_runs(make_host):
    """Review helper-196: the heartbeat answered True after the commit whatever the database
    said. Here the hold lapsed, the sweeper cleared it and another
    host runs the key's next delivery: the handler's heartbeat answers True, so a Manual
    handler goes on with its tail beside the key's next delivery, told all is well."""
    from workqueue.runtime.sweeper import Sweeper

    _waited_beats.clear()
    _go_on.clear()
    _done.clear()
    s = sub(
        handler_key="tests.enlisted.manual_wait_beat",
        partition_mode="Exclusive",
        heartbeat_mode="Manual",
        lease_seconds=30,
    )
    make_host(one(s, concurrency=1)).start()
    first = publish(s.topic.name, {}, partition_key="k").message_id
    wait_until(
        lambda: Delivery.objects.filter(message_id=first, status="Completed").exists(), timeout=20
    )
    publish(s.topic.name, {}, partition_key="k")
    get_driver().shift_time(31, subscription_id=str(s.id))  # the hold lapsed (no beat)
    Sweeper().run_once()  # and was cleared
    taken = Receiver(str(s.id), "host-b").receive(5).deliveries
    assert len(taken) == 1  # the key's next delivery runs on host-b

    _go_on.set()
    assert _done.wait(20)
    assert _waited_beats == [False], (
        f"heartbeat answered {_waited_beats} while host-b runs the key's next one"
    )


_outage = threading.Event()
_claimed_elsewhere = threading.Event()
_told: list[bool] = []


class CompleteThenTailThroughAnOutage(BaseWorkHandler):
    def handle(self, message: Any, context: Any) -> Outcome:
        from workqueue.runtime.executor import AbortReason

        _outage.set()  # the database cannot be reached for renewals from the commit on
        with transaction.atomic():
            context.complete(enlist=True)
        _claimed_elsewhere.wait(20)
        time.sleep(1.0)  # a horizon's timer has had its time
        _told.append(context.signal.has(AbortReason.LEASE_LOST))
        _done.set()
        return Outcome.complete()


registry.register("tests.enlisted.tail_through_outage", CompleteThenTailThroughAnOutage)


@pytest.mark.usefixtures("queue_db")
def hold_runs_out_and_host_b_claims_the_key(
    make_host: Any, monkeypatch: pytest.MonkeyPatch, outage: threading.Event, **fields: Any
) -> None:
    """A host runs ``fields``' handler (Exclusive, a 5 s lease) on key k's first message,
    which completes in its transaction; the handler sets ``outage`` to cut this host's
    renewals, so the hold runs out, and host-b claims the key's next message beside the tail
    (then ``_claimed_elsewhere`` is set)."""
    _claimed_elsewhere.clear()
    renewals_fail_while(monkeypatch, outage)
    s = sub(partition_mode="Exclusive", lease_seconds=5, **fields)
    make_host(one(s, concurrency=1)).start()
    first = publish(s.topic.name, {}, partition_key="k").message_id
    wait_until(
        lambda: Delivery.objects.filter(message_id=first, status="Completed").exists(), timeout=20
    )
    publish(s.topic.name, {}, partition_key="k")
    other_host = Receiver(str(s.id), "host-b")
    deadline = time.monotonic() + 15
    taken: list[Any] = []
    while not taken and time.monotonic() < deadline:
        taken = other_host.receive(1).deliveries
        time.sleep(0.2)
    assert taken, "the key's next delivery was never claimed"
    _claimed_elsewhere.set()


def test_a_handler_whose_hold_ran_out_is_told_before_the_keys_next_delivery_runs_beside_it(
    make_host, monkeypatch
):
    """Renewals of the hold fail (an outage for this host only) until it runs out; another host
    claims the key's next delivery. An InFlight delivery's handler is told LeaseLost by the local
    horizon at that point; a holding handler's horizon was silenced once it had committed, so
    its tail ran on beside the key's next delivery, never told (review helper-196)."""
    _told.clear()
    _done.clear()
    _outage.clear()
    hold_runs_out_and_host_b_claims_the_key(
        make_host, monkeypatch, _outage, handler_key="tests.enlisted.tail_through_outage"
    )
    assert _done.wait(20)
    assert _told == [True], "the handler ran on beside the key's next delivery, never told"


_times: dict[str, float] = {}
_taken_back = threading.Event()


class CompletesThenRollsBackAndGoesOn(BaseWorkHandler):
    """Renewals fail (an outage of this host's renewals); late in its lease the handler
    completes in its transaction, then the block raises and rolls back; the handler catches it
    and goes on (a fallback path), watching its signal as the README says."""

    def handle(self, message: Any, context: Any) -> Outcome:
        from workqueue.runtime.executor import AbortReason

        if message.payload.get("n") != "first":
            return Outcome.complete()
        _outage.set()
        time.sleep(3.5)
        try:
            with transaction.atomic():
                context.complete(enlist=True)
                raise ValueError("writing the invoice failed after the complete call")
        except ValueError:
            _times["rolled_back"] = time.monotonic()
        deadline = time.monotonic() + 12
        while not context.signal.has(AbortReason.LEASE_LOST) and time.monotonic() < deadline:
            time.sleep(0.05)
        _times["told"] = time.monotonic()
        # Returned at once, its completion (the lease passed, nobody had taken the delivery)
        # would go through before the test's other host could take the delivery back.
        _taken_back.wait(20)
        _done.set()
        return Outcome.complete()


registry.register("tests.enlisted.rolls_back", CompletesThenRollsBackAndGoesOn)


@pytest.mark.usefixtures("queue_db")
def test_a_completion_rolled_back_leaves_the_local_horizon_where_the_database_lease_ends(
    make_host, monkeypatch
):
    """Review helper-196: the local lease was moved a whole lease past the complete call as
    soon as the call was accepted, before the commit. Rolled back, the database lease is where
    it was (renewals failed), but the horizon, seeing the local lease moved, re-armed a lease
    later: the sweeper and another host took the delivery back and ran it while this handler,
    never told LeaseLost, went on for up to a lease."""
    from workqueue.runtime.sweeper import Sweeper

    _times.clear()
    _done.clear()
    _outage.clear()
    _taken_back.clear()
    renewals_fail_while(monkeypatch, _outage)
    s = sub(handler_key="tests.enlisted.rolls_back", partition_mode="Exclusive", lease_seconds=5)
    # No claim ahead: the host's own consumer must not take the delivery back first.
    make_host([{"name": s.name, "concurrency": 1, "prefetch": 0}]).start()
    publish(s.topic.name, {"n": "first"}, partition_key="k")
    wait_until(lambda: "rolled_back" in _times, timeout=20)
    other_host = Receiver(str(s.id), "host-b")
    taken: list[Any] = []
    deadline = time.monotonic() + 15
    while not taken and time.monotonic() < deadline:
        Sweeper().run_once()
        taken = other_host.receive(1).deliveries
        if not taken:
            time.sleep(0.1)
    claimed_at = time.monotonic()
    _taken_back.set()
    assert taken, "never taken back"
    assert _done.wait(20)
    late = _times["told"] - claimed_at
    assert late <= 0.5, (
        f"host-b took the delivery back and the handler was told LeaseLost {late:.1f} s later"
    )


_h197_outage = threading.Event()
_seen: dict[str, Any] = {}
_h197_done = threading.Event()


class ManualCompleteThenBeatThroughAnOutage(BaseWorkHandler):
    """Manual heartbeats; this host's renewals fail from before the commit on. After the
    commit the handler waits to be told its hold ran out, then asks heartbeat()."""

    def handle(self, message: Any, context: Any) -> Outcome:
        _h197_outage.set()
        with transaction.atomic():
            context.complete(enlist=True)
        committed = time.monotonic()
        deadline = committed + 15
        while not context.signal.has(AbortReason.LEASE_LOST) and time.monotonic() < deadline:
            time.sleep(0.05)
        _seen["told"] = context.signal.has(AbortReason.LEASE_LOST)
        _seen["told_after"] = time.monotonic() - committed
        _seen["beat"] = context.heartbeat({"step": 1})
        _h197_done.set()
        return Outcome.complete()


registry.register("tests.enlisted.h197_manual_outage", ManualCompleteThenBeatThroughAnOutage)


@pytest.mark.usefixtures("queue_db")
@pytest.mark.parametrize("heartbeat_mode", ["Manual", "Auto"])
def test_heartbeat_answers_false_once_the_handler_was_told_its_hold_ran_out(
    make_host, monkeypatch, heartbeat_mode
):
    """README: a hold that runs out under a running handler is not renewed again, and the
    handler is told so (LeaseLost on its signal, heartbeat() False). Through an outage the
    signal says LeaseLost, but heartbeat() answers True (a failed renewal counts as held), so
    a handler that goes by heartbeat()'s answer, as the README tells a Manual one to, runs its
    tail on beside the key's next delivery."""
    _seen.clear()
    _h197_done.clear()
    _h197_outage.clear()
    renewals_fail_while(monkeypatch, _h197_outage)
    s = sub(
        handler_key="tests.enlisted.h197_manual_outage",
        partition_mode="Exclusive",
        heartbeat_mode=heartbeat_mode,
        lease_seconds=5,
    )
    make_host(one(s, concurrency=1)).start()
    publish(s.topic.name, {}, partition_key="k")
    assert _h197_done.wait(30)
    assert _seen["told"], _seen
    assert _seen["beat"] is False, (
        f"told LeaseLost {_seen['told_after']:.1f} s after the commit (the hold ran out), "
        f"yet heartbeat() answered {_seen['beat']}"
    )


_fail_once = threading.Event()
_checks: dict[str, Any] = {}


class BlockThenTail(BaseWorkHandler):
    """Completes, stays in the block blockMs, arms a one-off renewal failure at the commit,
    then runs a tail of tailMs (Manual: beating every second), recording whether it was told."""

    def handle(self, message: Any, context: Any) -> Outcome:
        p = message.payload
        time.sleep(p.get("beforeMs", 0) / 1000)
        with transaction.atomic():
            context.complete(enlist=True)
            time.sleep(p.get("blockMs", 0) / 1000)
            if p.get("failOnce"):
                _fail_once.set()
        answers = []
        end = time.monotonic() + p["tailMs"] / 1000
        while time.monotonic() < end:
            time.sleep(1.0)
            if p.get("beat"):
                answers.append(context.heartbeat())
        _checks[p["n"]] = (context.signal.has(AbortReason.LEASE_LOST), answers)
        return Outcome.complete()


registry.register("tests.enlisted.h197_block_then_tail", BlockThenTail)


@pytest.mark.usefixtures("queue_db")
@pytest.mark.parametrize(
    "heartbeat_mode,payload",
    [
        ("Auto", {"blockMs": 4_500, "tailMs": 7_000}),
        (
            "Manual",
            {"beforeMs": 3_500, "blockMs": 2_500, "failOnce": True, "tailMs": 7_000, "beat": True},
        ),
        ("Manual", {"blockMs": 0, "failOnce": True, "tailMs": 8_000, "beat": True}),
    ],
    ids=["a block of most of the lease", "a late call, a renewal failing once", "Manual"],
)
def test_no_lease_lost_after_a_normal_commit(make_host, monkeypatch, heartbeat_mode, payload):
    """Review helper-197: after the fixes to the hold, a commit within the lease is never told
    LeaseLost, whatever the block's length or a renewal failing once, and a Manual handler's
    heartbeats answer True."""
    _checks.clear()
    _fail_once.clear()
    extend = Receiver.extend_lease
    failed: list[int] = []

    def flaky(self: Receiver, delivery: Any, progress: Any = None) -> Any:
        if _fail_once.is_set() and not failed:
            failed.append(1)
            raise TransientDriverError("server closed the connection unexpectedly")
        return extend(self, delivery, progress)

    monkeypatch.setattr(Receiver, "extend_lease", flaky)
    s = sub(
        handler_key="tests.enlisted.h197_block_then_tail",
        partition_mode="Exclusive",
        heartbeat_mode=heartbeat_mode,
        lease_seconds=5,
    )
    make_host(one(s, concurrency=1)).start()
    publish(s.topic.name, {"n": "x", **payload}, partition_key="k")
    wait_until(lambda: "x" in _checks, timeout=30)
    assert _checks["x"][0] is False, (heartbeat_mode, payload, _checks["x"], failed)
    assert all(_checks["x"][1]), _checks["x"]


@pytest.mark.usefixtures("queue_db")
@pytest.mark.parametrize("heartbeat_mode", ["Auto", "Manual"])
def test_an_unpartitioned_tail_past_the_lease_is_not_told(make_host, heartbeat_mode):
    """No hold, nothing to run out: a tail past the lease after the commit is not told."""
    key = "k"
    _checks.clear()
    s = sub(
        handler_key="tests.enlisted.h197_block_then_tail",
        partition_mode="None",
        heartbeat_mode=heartbeat_mode,
        lease_seconds=5,
    )
    make_host(one(s, concurrency=1)).start()
    publish(
        s.topic.name,
        {"n": "x", "blockMs": 1_000, "tailMs": 7_000, "beat": heartbeat_mode == "Manual"},
        partition_key=key,
    )
    wait_until(lambda: "x" in _checks, timeout=30)
    assert _checks["x"][0] is False, _checks["x"]
    assert all(_checks["x"][1]), _checks["x"]


class ManualTailAskingHeartbeat(BaseWorkHandler):
    """A Manual handler that goes by heartbeat()'s answer, as the README tells it to."""

    def handle(self, message: Any, context: Any) -> Outcome:
        _h197_outage.set()  # this host's renewals fail from here on
        with transaction.atomic():
            context.complete(enlist=True)
        assert _claimed_elsewhere.wait(20)
        _seen["beat_while_next_runs_elsewhere"] = context.heartbeat()
        _seen["told"] = context.signal.has(AbortReason.LEASE_LOST)
        _h197_done.set()
        return Outcome.complete()


registry.register("tests.enlisted.h197_manual_tail", ManualTailAskingHeartbeat)


@pytest.mark.usefixtures("queue_db")
def test_a_hold_that_ran_out_under_its_handler_is_logged(make_host, monkeypatch, caplog):
    """Review helper-197: an InFlight delivery whose lease ran out under its handler is logged
    at ERROR ("Lease lost ... may run again"). A hold that ran out while the tail ran on, the
    key's next delivery running on another host beside it, left nothing but the first
    "Heartbeat failed" line."""
    import logging

    caplog.set_level(logging.INFO, logger="workqueue")
    _seen.clear()
    _h197_done.clear()
    _h197_outage.clear()
    hold_runs_out_and_host_b_claims_the_key(
        make_host,
        monkeypatch,
        _h197_outage,
        handler_key="tests.enlisted.h197_manual_tail",
        heartbeat_mode="Auto",
    )
    assert _h197_done.wait(20)
    time.sleep(1.0)  # the settle (the release) has run
    said = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and "Heartbeat failed" not in r.getMessage()
    ]
    assert _seen["told"] and said, (
        "the hold ran out and the key's next delivery was claimed by host-b while the tail "
        f"ran; WARNING+ lines besides 'Heartbeat failed': {said}"
    )


class CompleteThenIgnoreTheStop(BaseWorkHandler):
    """Completes in its transaction, then runs on through a host's stop, its signal ignored."""

    def handle(self, message: Any, context: Any) -> Outcome:
        with transaction.atomic():
            context.complete(enlist=True)
        _spans["committed"] = [time.monotonic()]
        time.sleep(4)
        return Outcome.complete()


registry.register("tests.enlisted.ignores_the_stop", CompleteThenIgnoreTheStop)


@pytest.mark.usefixtures("queue_db")
def test_a_stop_that_gives_up_on_a_handler_that_completed_in_its_transaction_says_so(
    make_host, caplog
):
    """Review helper-195 (unproven then, shown here): the stop said such a handler's delivery
    "will be retried after lease expiry"; it is Completed and never runs again."""
    import logging

    _spans.clear()
    s = sub(handler_key="tests.enlisted.ignores_the_stop", partition_mode="Exclusive")
    host = make_host(one(s, concurrency=1), shutdown_drain_ms=300)
    host.start()
    done = publish(s.topic.name, {}, partition_key="k").message_id
    wait_until(lambda: "committed" in _spans, timeout=20)

    with caplog.at_level(logging.WARNING, logger="workqueue.runtime.consumer"):
        host.shutdown()

    assert "completed their delivery in their own transaction did not stop" in caplog.text
    assert "will be retried" not in caplog.text, caplog.text
    assert status_of(done) == "Completed"
