"""Cancels of running handlers at the edges (stops, re-plans, announcements), and a delivery claimed
ahead that must not start on a lease that ran out (audit helper-128)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.db import connections

from tests.support.handlers import probe
from tests.support.hosts import listener_pid, one, status_of, sub
from tests.support.waiting import wait_until
from workqueue import publish, transport
from workqueue.models import Subscription
from workqueue.runtime import wakeup
from workqueue.runtime.context import AbortReason
from workqueue.runtime.executor import CANCEL_CHECK_SECONDS

pytestmark = pytest.mark.usefixtures("queue_db")


def _on_a_thread(call: Any) -> None:
    try:
        call()
    finally:
        connections.close_all()


def _exclusive_retried_a_minute_later() -> Any:
    """An Exclusive subscription of 5 s leases whose retries wait a minute."""
    return sub(
        partition_mode="Exclusive",
        lease_seconds=5,
        max_attempts=5,
        backoff_base_seconds=60,
        backoff_max_seconds=60,
    )


@pytest.mark.parametrize("edge", ["shutdown drain", "re-plan drain"])
def test_a_cancel_made_while_the_host_drains_reaches_the_handler_at_once(
    make_host, monkeypatch, edge
):
    """README: the holder hears of a cancel at once (NOTIFY). The host's cancel callback looks
    only at ``Host._consumers``; a shutdown empties it before its drain and a re-plan pops the
    consumers it retires before theirs. A handler still running in the drain (told
    ``stopping``, which is a request, not an order) heard the operator's cancel only at its
    next heartbeat (here 20 s after the claim), and its side effects went on meanwhile."""
    monkeypatch.setattr(wakeup, "POLL_SECONDS", 0.05)
    s = sub(partition_mode="Exclusive", lease_seconds=60, max_attempts=5)  # heartbeat every 20 s
    host = make_host(one(s, concurrency=1), shutdown_drain_ms=15_000)
    host.start()
    wait_until(listener_pid, timeout=5)
    message = publish(s.topic.name, {"sleepMs": 30_000}, partition_key="k").message_id
    (running,) = probe.wait_for(1)

    if edge == "shutdown drain":
        stop = host.shutdown
    else:
        Subscription.objects.filter(pk=s.pk).update(max_attempts=6)  # an operator's edit
        stop = host.reconcile
    stopper = threading.Thread(target=_on_a_thread, args=(stop,))
    stopper.start()
    time.sleep(0.5)  # the drain has begun: the handler was told the host is stopping

    assert transport.discard_or_cancel(
        str(s.id), running.delivery_id, "ops", "stop"
    ).cancel_requested
    cancelled_at = time.monotonic()

    try:
        wait_until(lambda: running.finished.is_set(), timeout=6)
    finally:
        heard_after = time.monotonic() - cancelled_at
        stopper.join(30)
    assert running.signal_reason == AbortReason.CANCELLED, (running.signal_reason, heard_after)
    wait_until(lambda: status_of(message) == "Discarded", timeout=5)


@pytest.mark.parametrize(
    "checks", ["nothing (control)", "announcements naming it", "listener reconnects"]
)
def test_a_manual_heartbeat_handler_that_stopped_beating_loses_its_lease_whatever_is_announced(
    make_host, monkeypatch, pg_conn, checks
):
    """``heartbeat_mode = Manual``: the handler must call ``context.heartbeat()`` within every
    lease, else it is told LeaseLost and the delivery goes to another host (README "Leases").
    A cancel check is made as a renewal (``check_lease_soon`` -> ``extend_lease``): every
    announcement naming the delivery on ``wq_cancel`` (any role that may connect can send one)
    and every catch-up after a listener reconnect (a proxy's idle timeout cutting the LISTEN
    connection) renewed the lease of a handler that had stopped beating, so a hung handler kept
    its delivery, and its Exclusive key, for as long as they came."""
    monkeypatch.setattr(wakeup, "POLL_SECONDS", 0.05)
    monkeypatch.setattr(wakeup, "MAX_RECONNECT_DELAY", 0.2)
    s = sub(partition_mode="Exclusive", lease_seconds=5, heartbeat_mode="Manual")
    host = make_host(one(s, concurrency=1))
    host.start()
    wait_until(listener_pid, timeout=5)
    message = publish(s.topic.name, {"sleepMs": 14_000}, partition_key="k").message_id
    (running,) = probe.wait_for(1)  # it never calls context.heartbeat(): a hung handler

    began = time.monotonic()
    while not running.finished.is_set() and time.monotonic() - began < 12:
        if checks == "announcements naming it":
            pg_conn.execute("SELECT pg_notify('wq_cancel', %s)", [running.delivery_id])
        elif checks == "listener reconnects":
            backend = listener_pid()
            if backend is not None:
                pg_conn.execute("SELECT pg_terminate_backend(%s)", [backend])
        running.finished.wait(1.0)

    assert running.finished.wait(5)
    told_after = time.monotonic() - running.started_at
    assert running.signal_reason == AbortReason.LEASE_LOST, (
        f"a Manual handler that never beat was told {running.signal_reason!r} after "
        f"{told_after:.1f} s (lease 5 s); its delivery is {status_of(message)}"
    )


def test_a_cancelled_delivery_claimed_ahead_frees_its_exclusive_key_without_waiting_for_a_slot(
    make_host, monkeypatch
):
    """A delivery claimed ahead (prefetch) and cancelled while it waits for a slot never runs,
    so nothing has to return before its key is free. The host hears the cancel at once (the
    renewal answers Cancelled) yet keeps the delivery InFlight in its ready queue until a slot
    frees or half its lease has passed (re-counted from the cancel check's renewal): behind a
    long handler, the Exclusive key stays held from every other host for up to half a lease
    after the cancel."""
    from workqueue.runtime import consumer as consumer_module

    monkeypatch.setattr(wakeup, "POLL_SECONDS", 0.05)
    monkeypatch.setattr(consumer_module, "PREFETCH_HANDLER_SECONDS", 60.0)
    monkeypatch.setattr(consumer_module, "PREFETCH_WINDOW_SECONDS", 60.0)
    s = sub(partition_mode="Exclusive", lease_seconds=60)
    host = make_host([{"name": s.name, "concurrency": 1, "prefetch": 2}])
    host.start()
    wait_until(listener_pid, timeout=5)
    first = publish(s.topic.name, {"then": "complete"}, partition_key="warm").message_id
    wait_until(lambda: status_of(first) == "Completed")  # a handler returned: claiming ahead on
    blocker = publish(s.topic.name, {"sleepMs": 20_000}, partition_key="slow").message_id
    probe.wait_for(1, message_id=blocker)
    victim = publish(s.topic.name, {"then": "complete"}, partition_key="acct").message_id
    wait_until(lambda: status_of(victim) == "InFlight")  # claimed ahead, waiting for the slot
    from workqueue.models import Delivery

    waiting = Delivery.objects.get(message_id=victim)

    assert transport.discard_or_cancel(str(s.id), str(waiting.id), "ops", "no").cancel_requested
    cancelled_at = time.monotonic()

    try:
        wait_until(lambda: status_of(victim) == "Discarded", timeout=5)
    except AssertionError:
        raise AssertionError(
            f"{time.monotonic() - cancelled_at:.1f} s after the cancel the delivery claimed "
            f"ahead is still {status_of(victim)} (its key 'acct' held) while the blocker runs"
        ) from None
    assert victim not in {r.message_id for r in probe.runs}


#: How long the flood of announcements below lasts.
FLOOD_SECONDS = 8


def test_announcements_naming_a_running_delivery_do_not_starve_the_other_deliveries_renewals(
    make_host, monkeypatch, pg_conn
):
    """Any role that may connect can NOTIFY ``wq_cancel``. A notification naming a running
    delivery queues a renewal of it on the consumer's two background threads, however many
    are queued already (only a delivery known to be cancelled is skipped); the queue is
    unbounded, and the same threads carry the other deliveries' heartbeats and the off-worker
    settles. A burst of announcements naming one delivery (each its own commit, which one DO
    block sends by the thousand a second) buried the heartbeats of another delivery behind
    them: its handler, healthy and renewing, was told LeaseLost and its outcome dropped,
    and its delivery became claimable by any other host while it still ran."""
    monkeypatch.setattr(wakeup, "POLL_SECONDS", 0.05)
    renewals: list[str] = []
    from workqueue.transport import Receiver

    extend_lease = Receiver.extend_lease

    def counted(self: Receiver, delivery: Any, *args: Any, **kwargs: Any) -> Any:
        renewals.append(delivery.delivery_id)
        return extend_lease(self, delivery, *args, **kwargs)

    monkeypatch.setattr(Receiver, "extend_lease", counted)
    checks: list[str] = []
    cancel_requested = Receiver.cancel_requested

    def checked(self: Receiver, delivery: Any) -> bool:
        checks.append(delivery.delivery_id)
        return cancel_requested(self, delivery)

    monkeypatch.setattr(Receiver, "cancel_requested", checked)
    s = sub(lease_seconds=6)  # automatic heartbeats every 2 s
    host = make_host(one(s, concurrency=2))
    host.start()
    wait_until(listener_pid, timeout=5)
    publish(s.topic.name, {"sleepMs": 14_000})
    (target,) = probe.wait_for(1)
    other = publish(s.topic.name, {"sleepMs": 14_000}).message_id
    bystander = next(r for r in probe.wait_for(2) if r.message_id == other)

    flood_error: list[BaseException] = []

    def flood() -> None:
        try:
            pg_conn.execute(
                "DO $$ DECLARE t timestamptz := clock_timestamp(); BEGIN "
                f"WHILE clock_timestamp() < t + interval '{FLOOD_SECONDS} seconds' LOOP "
                f"PERFORM pg_notify('wq_cancel', '{target.delivery_id}'); COMMIT; "
                "END LOOP; END $$"
            )
        except BaseException as exc:  # pragma: no cover - reported below
            flood_error.append(exc)

    flooding = threading.Thread(target=flood)
    flood_began = time.monotonic()
    flooding.start()
    flooding.join(20)
    assert not flood_error, flood_error

    assert bystander.finished.wait(15)
    assert target.finished.wait(15)
    named_renewals = sum(1 for r in renewals if r == target.delivery_id)
    assert bystander.signal_reason is None, (
        f"a healthy handler whose heartbeats ran every 2 s was told {bystander.signal_reason} "
        f"({named_renewals} renewals of the announced delivery were made meanwhile)"
    )
    wait_until(lambda: status_of(other) != "InFlight", timeout=10)
    assert status_of(other) == "Completed"
    # However many announcements (tens of thousands), one check waits at a time, one a second
    # at most while they keep coming (the listener hands on the last of them after the flood):
    # how loaded the machine is decides whether so many checks starve the heartbeats above.
    most = (time.monotonic() - flood_began) / CANCEL_CHECK_SECONDS + 3
    assert checks.count(target.delivery_id) <= most, (len(checks), most)


def test_a_delivery_next_in_a_slot_never_starts_on_a_lease_that_ran_out_while_the_slot_settled(
    make_host, monkeypatch
):
    """A delivery claimed ahead is checked for lease left when a handler returns and hands it
    its slot (``_free_slot``), but it starts only after that handler's settle, made on the
    same worker thread, has returned; a settle may take up to the previous lease plus 5 s (it is
    retried while a database is away) and nothing looks at the lease again
    (``_take_for_this_thread``). It then starts on a lease that ran out meanwhile: another host
    has taken the delivery back and runs it, and this host runs it too, on the stale token,
    until its first heartbeat a third of a lease later says the lease is lost: two executions
    of one Exclusive key at once."""
    from workqueue.runtime import consumer as consumer_module
    from workqueue.transport import Receiver

    monkeypatch.setattr(consumer_module, "PREFETCH_HANDLER_SECONDS", 60.0)
    monkeypatch.setattr(consumer_module, "PREFETCH_WINDOW_SECONDS", 60.0)
    s = _exclusive_retried_a_minute_later()
    slow_for: set[str] = set()
    retry = Receiver.retry

    def slow_retry(self: Receiver, delivery: Any, *args: Any, **kwargs: Any) -> Any:
        if delivery.delivery_id in slow_for:
            slow_for.discard(delivery.delivery_id)
            time.sleep(7)  # a database that answers slowly, or a settle retried through a blip
        return retry(self, delivery, *args, **kwargs)

    monkeypatch.setattr(Receiver, "retry", slow_retry)
    first_host = make_host([{"name": s.name, "concurrency": 1, "prefetch": 2}])
    first_host.start()
    warm = publish(s.topic.name, {"then": "complete"}, partition_key="warm").message_id
    wait_until(lambda: status_of(warm) == "Completed")  # a handler returned: claiming ahead on
    from workqueue import publish_many
    from workqueue.models import Delivery

    blocker, victim = [
        r.message_id
        for r in publish_many(
            s.topic.name,
            [
                {"payload": {"sleepMs": 300, "then": "retry"}, "partition_key": "a"},
                {"payload": {"sleepMs": 4000}, "partition_key": "k"},
            ],
        )
    ]
    slow_for.add(str(Delivery.objects.get(message_id=blocker).pk))
    probe.wait_for(1, message_id=blocker)
    wait_until(lambda: status_of(victim) == "InFlight")  # claimed ahead, waiting for the slot
    second_host = make_host(one(s, concurrency=1))
    second_host.start()  # an idle host: it takes the victim back once its lease has run out

    wait_until(lambda: status_of(victim) == "Completed", timeout=25)

    runs = [r for r in probe.runs if r.message_id == victim]
    assert len(runs) == 1, "key 'k' ran twice: " + ", ".join(
        f"attempt {r.attempt} on {r.thread} at {r.started_at:.1f}" for r in runs
    )


def test_a_delivery_claimed_for_a_free_slot_never_starts_on_a_lease_another_consumer_took(
    make_host, monkeypatch
):
    """The lease check above covered deliveries claimed ahead only: one claimed for a free
    slot was taken to start at once, but it waits for a worker thread, and every worker may be
    busy settling (2 x concurrency threads, each on a slow retry), or the host frozen between
    the claim and the start. It then started after its lease ran out and another consumer
    had claimed it: one Exclusive key run in two places (review helper-161)."""
    from workqueue.models import Delivery
    from workqueue.transport import Receiver

    s = _exclusive_retried_a_minute_later()
    retry = Receiver.retry

    def slow_retry(self: Receiver, delivery: Any, *args: Any, **kwargs: Any) -> Any:
        time.sleep(7)  # a database that answers slowly
        return retry(self, delivery, *args, **kwargs)

    monkeypatch.setattr(Receiver, "retry", slow_retry)
    host = make_host([{"name": s.name, "concurrency": 1, "prefetch": 0}])
    # Claimed by priority: the two failing ones first (one at a time), the victim last.
    publish(s.topic.name, {"sleepMs": 200, "then": "retry"}, partition_key="a", priority=10)
    publish(s.topic.name, {"sleepMs": 200, "then": "retry"}, partition_key="b", priority=5)
    victim = publish(s.topic.name, {"sleepMs": 3000}, partition_key="k", priority=0).message_id
    host.start()
    wait_until(lambda: status_of(victim) == "InFlight", timeout=10)
    row = Delivery.objects.get(message_id=victim)
    assert row.lease_owner == host.instance_id
    assert not [r for r in probe.runs if r.message_id == victim]  # claimed, not started yet
    time.sleep(5.5)  # its lease runs out; another consumer (another host) claims it
    assert str(row.pk) in {d.delivery_id for d in Receiver(s.id).receive(3).deliveries}
    taken_at = time.monotonic()

    time.sleep(4)  # the first host's worker threads come back from their slow settles

    late = [r for r in probe.runs if r.message_id == victim]
    assert not late, (
        f"host 1 started the victim {late[0].started_at - taken_at:+.1f}s after another "
        f"consumer claimed it (key 'k' held by both; signal {late[0].signal_reason})"
    )


@pytest.mark.parametrize("settle_returns", ["after the hand-back", "during the hand-back"])
def test_a_cancelled_delivery_next_in_a_slot_frees_its_key_without_waiting_for_the_slots_settle(
    make_host, monkeypatch, settle_returns
):
    """A delivery claimed ahead is handed its slot when the handler before it returns, and starts
    on that handler's worker thread once its settle has returned. Cancelled in between, it was
    no longer waiting for a slot (``_hand_back_cancelled_ahead`` found it in no queue), so it
    kept its Exclusive key until that settle returned: through a database that answers slowly,
    up to the previous delivery's lease and a grace. It never runs after the cancel, so nothing
    has to return before the key is free. Nor may it start, or its slot be passed on a second
    time, when the settle returns while its hand-back is still on its way (a double pass is a
    slot counted free twice: a concurrency-1 subscription running two handlers)."""
    from workqueue import publish_many
    from workqueue.models import Delivery
    from workqueue.runtime import consumer as consumer_module
    from workqueue.transport import Receiver

    monkeypatch.setattr(wakeup, "POLL_SECONDS", 0.05)  # the cancel notification comes at once
    monkeypatch.setattr(consumer_module, "PREFETCH_HANDLER_SECONDS", 60.0)
    monkeypatch.setattr(consumer_module, "PREFETCH_WINDOW_SECONDS", 60.0)
    s = sub(partition_mode="Exclusive", lease_seconds=60, max_attempts=5)
    hanging, entered, answered = threading.Event(), threading.Event(), threading.Event()
    held_release, releasing, released = set(), threading.Event(), threading.Event()
    retry, release = Receiver.retry, Receiver.release

    def slow_retry(self: Receiver, *args: Any, **kwargs: Any) -> Any:
        if hanging.is_set():
            entered.set()
            answered.wait(30)  # a database that answers slowly (a settle retried through a blip)
        return retry(self, *args, **kwargs)

    def held(self: Receiver, delivery: Any) -> Any:
        if delivery.delivery_id in held_release:
            releasing.set()
            released.wait(30)
        return release(self, delivery)

    monkeypatch.setattr(Receiver, "retry", slow_retry)
    monkeypatch.setattr(Receiver, "release", held)
    host = make_host([{"name": s.name, "concurrency": 1, "prefetch": 2}])
    host.start()
    consumer = host._consumers[s.name]
    wait_until(listener_pid, timeout=5)
    warm = publish(s.topic.name, {"then": "complete"}, partition_key="warm").message_id
    wait_until(lambda: status_of(warm) == "Completed")  # a handler returned: claiming ahead on
    hanging.set()
    blocker, victim = [
        r.message_id
        for r in publish_many(
            s.topic.name,
            [
                {"payload": {"sleepMs": 1500, "then": "retry"}, "partition_key": "a"},
                {"payload": {"then": "complete"}, "partition_key": "k"},
            ],
        )
    ]
    (running,) = probe.wait_for(1, message_id=blocker)
    wait_until(lambda: status_of(victim) == "InFlight")  # claimed ahead, waiting for the slot
    assert not running.finished.is_set(), "the blocker returned before the victim was claimed"
    assert entered.wait(10)  # the blocker's retry hangs; the victim is next on its thread
    waiting = Delivery.objects.get(message_id=victim)
    if settle_returns == "during the hand-back":
        held_release.add(str(waiting.pk))

    try:
        assert transport.discard_or_cancel(str(s.id), str(waiting.id), "ops", "no").cancel_requested
        cancelled_at = time.monotonic()
        if settle_returns == "during the hand-back":
            assert releasing.wait(5), "the hand-back waited for the settle before it"
            answered.set()
            wait_until(lambda: status_of(blocker) == "Pending")  # its retry settled
            wait_until(lambda: consumer.in_flight == 1)  # the worker goes on to the victim
            time.sleep(0.3)  # and decides what to do with it before the release returns
            released.set()
        try:
            wait_until(lambda: status_of(victim) == "Discarded", timeout=5)
        except AssertionError:
            raise AssertionError(
                f"{time.monotonic() - cancelled_at:.1f} s after the cancel the delivery next in "
                f"the slot is still {status_of(victim)} (its key 'k' held) while the settle "
                "before it hangs"
            ) from None
        # The key is free for its next delivery, which takes the slot the victim gave up.
        after = publish(s.topic.name, {"then": "complete"}, partition_key="k").message_id
        wait_until(lambda: status_of(after) == "Completed", timeout=5)
    finally:
        answered.set()
        released.set()

    wait_until(lambda: status_of(blocker) == "Pending")  # its retry settled at last
    wait_until(lambda: consumer.in_flight == 0)
    assert victim not in {r.message_id for r in probe.runs}
    # The slot was given up once: nothing passed it on a second time.
    assert consumer._handlers_running == 0
