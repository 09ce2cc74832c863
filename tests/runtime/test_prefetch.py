"""Claiming ahead (``prefetch``): while a subscription's handlers are quick, its claim loop takes
deliveries past the free slots and starts them as slots free. The concurrency still bounds the
handlers running at once, slow handlers get no deliveries held for them, a delivery that waited
too long for a slot goes back to the queue instead of starting on a spent lease, and a shutdown
hands back what never started, attempts refunded. Against PostgreSQL, hosts in this process.
"""

from __future__ import annotations

import threading
import time
import tracemalloc
from typing import Any

import pytest

from tests.factories import TopicFactory
from tests.support.handlers import probe, registry
from tests.support.hosts import runtime_threads, status_of, sub
from tests.support.memory import SWOLLEN_PAYLOAD
from tests.support.waiting import wait_until
from workqueue import publish, publish_many, transport
from workqueue.exceptions import TransientDriverError, WorkQueueConfigurationError
from workqueue.models import Delivery
from workqueue.runtime import consumer, wakeup
from workqueue.runtime.handlers import BaseWorkHandler
from workqueue.runtime.host import HostConfig
from workqueue.runtime.outcome import Outcome
from workqueue.runtime.process import describe_left_behind
from workqueue.types import MAX_PAYLOAD_BYTES

pytestmark = pytest.mark.usefixtures("queue_db")


class OverlapHandler(BaseWorkHandler):
    """Sleeps ``sleepMs`` and records how many of its calls ran at once, and which ran."""

    lock = threading.Lock()
    running = 0
    most = 0
    ran: list[tuple[int, int]] = []  # (payload n, attempt)

    @classmethod
    def reset(cls) -> None:
        cls.running, cls.most, cls.ran = 0, 0, []

    def handle(self, message: Any, context: Any) -> Outcome:
        cls = type(self)
        with cls.lock:
            cls.running += 1
            cls.most = max(cls.most, cls.running)
            cls.ran.append((message.payload["n"], context.attempt))
        try:
            time.sleep(message.payload.get("sleepMs", 0) / 1000)
        finally:
            with cls.lock:
                cls.running -= 1
        return Outcome.complete()


registry.register("t.overlap", OverlapHandler)


class GatedHandler(BaseWorkHandler):
    """Completes at once, but a payload ``{"gated": true}`` first waits for ``gate``."""

    gate = threading.Event()

    def handle(self, message: Any, context: Any) -> Outcome:
        if message.payload.get("gated"):
            assert type(self).gate.wait(60), "the test never opened the gate"
        return Outcome.complete()


registry.register("t.gated", GatedHandler)


@pytest.fixture
def claims(monkeypatch) -> list[int]:
    """How many deliveries each claim asked for, in order."""
    asked: list[int] = []
    receive = transport.Receiver.receive

    def recording(self: transport.Receiver, max_rows: int) -> Any:
        asked.append(max_rows)
        return receive(self, max_rows)

    monkeypatch.setattr(transport.Receiver, "receive", recording)
    OverlapHandler.reset()
    return asked


@pytest.fixture
def releases(monkeypatch) -> list[str]:
    """The delivery ids handed back to the queue unrun (attempt refunded), in order."""
    released: list[str] = []
    release = transport.Receiver.release

    def recording(self: transport.Receiver, delivery: Any) -> Any:
        released.append(delivery.delivery_id)
        return release(self, delivery)

    monkeypatch.setattr(transport.Receiver, "release", recording)
    return released


@pytest.fixture
def handlers_count_as_quick(monkeypatch) -> None:
    """Claim ahead up to ``prefetch`` whatever the handlers' measured time. For tests about what
    happens to deliveries once claimed ahead: they learn the handlers' speed from one quick
    delivery, and on a loaded machine that one call alone can take over the 20 ms window a
    single slot gives (PREFETCH_WINDOW_SECONDS), which would turn claiming ahead off for the
    whole test. The thresholds themselves have their own tests above these."""
    monkeypatch.setattr(consumer, "PREFETCH_HANDLER_SECONDS", 60.0)
    monkeypatch.setattr(consumer, "PREFETCH_WINDOW_SECONDS", 60.0)


def _all_completed(subscription: Any, count: int) -> bool:
    return Delivery.objects.filter(subscription=subscription, status="Completed").count() == count


def test_quick_handlers_are_claimed_ahead_yet_never_more_run_at_once_than_the_concurrency(
    make_host, claims
):
    s = sub(handler_key="t.overlap")
    host = make_host([{"name": s.name, "concurrency": 3, "prefetch": 6}])
    host.start()

    publish_many(s.topic.name, [{"payload": {"n": n, "sleepMs": 2}} for n in range(90)])

    wait_until(lambda: _all_completed(s, 90), timeout=30)
    assert OverlapHandler.most <= 3, f"{OverlapHandler.most} handlers ran at once"
    assert sorted(OverlapHandler.ran) == [(n, 1) for n in range(90)]
    assert max(claims) > 3, f"no claim went past the free slots: {claims}"


def test_slow_handlers_get_no_deliveries_claimed_ahead_for_them(make_host, claims):
    s = sub(handler_key="t.overlap")
    host = make_host([{"name": s.name, "concurrency": 2, "prefetch": 4}])
    host.start()

    # Slower than PREFETCH_HANDLER_SECONDS: another host could be running what this one held.
    publish_many(s.topic.name, [{"payload": {"n": n, "sleepMs": 80}} for n in range(8)])

    wait_until(lambda: _all_completed(s, 8), timeout=30)
    assert max(claims) <= 2, f"claimed ahead for slow handlers: {claims}"
    assert OverlapHandler.most == 2


def test_no_more_is_claimed_ahead_than_the_handlers_get_through_in_the_window(make_host, claims):
    s = sub(handler_key="t.overlap")
    host = make_host([{"name": s.name, "concurrency": 2, "prefetch": 50}])
    host.start()

    # 10 ms handlers, quick enough to claim ahead for; two slots get through 4 of them in the
    # 20 ms window (PREFETCH_WINDOW_SECONDS), and sleeps run long, so at most 3 past the slots.
    publish_many(s.topic.name, [{"payload": {"n": n, "sleepMs": 10}} for n in range(60)])

    wait_until(lambda: _all_completed(s, 60), timeout=30)
    assert 2 < max(claims) <= 2 + 4, f"claims past the window's worth: {claims}"
    assert OverlapHandler.most == 2


def test_a_one_shot_run_claims_only_what_it_works_on(make_host, claims):
    s = sub(handler_key="t.overlap")
    publish_many(s.topic.name, [{"payload": {"n": n}} for n in range(12)])
    host = make_host([{"name": s.name, "concurrency": 2, "prefetch": 8}])

    result = host.run_once(max_deliveries=12, idle_exit_ms=2_000)

    assert result.processed == 12
    assert max(claims) <= 2, f"a one-shot run claimed ahead: {claims}"


@pytest.mark.usefixtures("handlers_count_as_quick")
def test_a_delivery_whose_lease_ran_down_while_it_waited_goes_back_unrun_attempt_refunded(
    make_host, claims, releases, monkeypatch
):
    # Every delivery claimed ahead counts as late: it must go back, not start.
    monkeypatch.setattr(consumer, "PREFETCH_MIN_LEASE_SHARE", 1.01)
    s = sub(handler_key="t.overlap")
    host = make_host([{"name": s.name, "concurrency": 1, "prefetch": 2}])
    host.start()

    publish_many(s.topic.name, [{"payload": {"n": n, "sleepMs": 5}} for n in range(6)])

    wait_until(lambda: _all_completed(s, 6), timeout=30)
    assert max(claims) > 1, f"nothing was claimed ahead: {claims}"
    assert releases, "a delivery claimed ahead started on a lease past the limit"
    # Each ran once, on its first attempt: the hand-backs refunded theirs.
    assert sorted(OverlapHandler.ran) == [(n, 1) for n in range(6)]


@pytest.mark.usefixtures("handlers_count_as_quick")
def test_a_delivery_claimed_ahead_behind_a_handler_that_outlives_its_lease_runs_on_attempt_1(
    make_host, releases
):
    """Audit helper-89: a delivery claimed ahead was checked only when a slot freed. Behind a
    handler running longer than a lease (renewing its own), nothing renewed it: its lease
    expired, the attempt counted unrun, and on its last attempt it was dead-lettered
    LeaseExpired without ever running. It goes back at half its lease now, attempt refunded."""
    s = sub(lease_seconds=5, max_attempts=1)
    host = make_host([{"name": s.name, "concurrency": 1, "prefetch": 2}], shutdown_drain_ms=1000)
    host.start()
    blocker, victim = _a_blocker_and_one_claimed_ahead(s, {"sleepMs": 12_000, "then": "complete"})

    wait_until(lambda: status_of(blocker) == "Completed", timeout=30)
    # Settled: not merely out of InFlight, which it also is while handed back (Pending) until
    # the freed slot claims it again (read between the two, a loaded machine failed the test).
    wait_until(lambda: status_of(victim) not in ("Pending", "InFlight"), timeout=30)

    row = Delivery.objects.get(message_id=victim)
    assert (row.status, row.dead_letter_reason) == ("Completed", None)
    assert [r.attempt for r in probe.runs if r.message_id == victim] == [1]
    # Handed back once, and not claimed ahead again while the slot stayed stalled (it was,
    # every half lease, keeping it from idle hosts).
    assert len(releases) == 1, releases


@pytest.mark.usefixtures("handlers_count_as_quick")
def test_a_hand_back_that_fails_on_a_lost_connection_is_made_again_while_the_lease_lasts(
    make_host, monkeypatch, caplog
):
    """Audit helper-95: a hand-back was one call; when it failed (a failover, a connection
    reset) the delivery was left to lease expiry, which counts the attempt as a run: on its last
    attempt it was dead-lettered LeaseExpired without ever running. It is made again now,
    backing off, while the lease lasts."""
    failed: list[str] = []
    release = transport.Receiver.release

    def drops_the_first(self: transport.Receiver, delivery: Any) -> Any:
        if not failed:
            failed.append(delivery.delivery_id)
            raise TransientDriverError("server closed the connection unexpectedly (test)")
        return release(self, delivery)

    monkeypatch.setattr(transport.Receiver, "release", drops_the_first)
    s = sub(lease_seconds=5, max_attempts=1)
    host = make_host([{"name": s.name, "concurrency": 1, "prefetch": 2}], shutdown_drain_ms=1000)
    host.start()
    blocker, victim = _a_blocker_and_one_claimed_ahead(s, {"sleepMs": 8_000, "then": "complete"})

    wait_until(lambda: status_of(blocker) == "Completed", timeout=30)
    wait_until(lambda: status_of(victim) not in ("InFlight", "Pending"), timeout=30)

    assert len(failed) == 1
    row = Delivery.objects.get(message_id=victim)
    assert (row.status, row.dead_letter_reason) == ("Completed", None)
    assert [r.attempt for r in probe.runs if r.message_id == victim] == [1]
    assert "trying again in 0.1 s while its lease lasts" in caplog.text


@pytest.mark.usefixtures("handlers_count_as_quick")
def test_shutdown_hands_back_deliveries_claimed_ahead_with_their_attempts_refunded(
    make_host, releases, caplog
):
    s = sub()
    # The blocker is aborted once the first drain period is over, and must then complete and
    # settle within the second: 300 ms was too short for that on a loaded 2-core machine.
    host = make_host([{"name": s.name, "concurrency": 1, "prefetch": 3}], shutdown_drain_ms=1000)
    host.start()
    blocker, waiting = _a_blocker_and_claimed_ahead(s, 3)

    host.shutdown()

    # Handed back at once: the drain did not wait for deliveries that can no longer start.
    assert "did not stop" not in caplog.text
    assert status_of(blocker) == "Completed"
    for message_id in waiting:
        row = Delivery.objects.get(message_id=message_id)
        assert (row.status, row.attempt_count) == ("Pending", 0)
    ran = {r.message_id for r in probe.runs}
    assert blocker in ran and not ran & set(waiting)  # and the one that turned prefetch on
    assert len(releases) == 3


@pytest.mark.usefixtures("handlers_count_as_quick")
def test_a_stop_with_the_database_away_makes_its_hand_backs_again_only_while_it_drains(
    make_host, monkeypatch
):
    """Review helper-97: failed hand-backs were made again while each lease lasted, so a
    shutdown with the database away waited the whole lease (60 s by default, hours for long
    ones) on top of its drain. While stopping, they are made again only while the drain
    lasts; lease expiry has them after that."""
    s = sub(lease_seconds=60)
    host = make_host([{"name": s.name, "concurrency": 1, "prefetch": 2}], shutdown_drain_ms=500)
    host.start()
    _a_blocker_and_one_claimed_ahead(s, {"sleepMs": 30_000, "thenOnAbort": "complete"})

    def away(self: transport.Receiver, delivery: Any) -> Any:
        raise TransientDriverError("server closed the connection unexpectedly (test)")

    monkeypatch.setattr(transport.Receiver, "release", away)
    began = time.monotonic()
    host.shutdown()

    assert time.monotonic() - began < 20  # the drain's two waits and a margin, not the lease


@pytest.mark.usefixtures("handlers_count_as_quick")
def test_a_stop_whose_hand_backs_meet_a_silent_database_ends_with_its_drain_not_after_each(
    make_host, monkeypatch
):
    """The deliveries claimed ahead were handed back one after another, each making at least
    one call: on a database that does not answer, each call waits its own timeout (about 30 s
    of TCP user timeout), so a stop with a hundred claimed ahead took an hour, however short
    its drain (helper-117). Once the drain's time is spent, the rest go to lease expiry."""
    s = sub(lease_seconds=60)
    host = make_host([{"name": s.name, "concurrency": 1, "prefetch": 8}], shutdown_drain_ms=500)
    host.start()
    _, waiting = _a_blocker_and_claimed_ahead(s, 6)
    calls: list[float] = []

    def silent(self: transport.Receiver, delivery: Any) -> Any:
        calls.append(time.monotonic())
        time.sleep(3)  # stands for the ~30 s a call to a silent database takes to fail
        raise TransientDriverError("timeout expired (test)")

    monkeypatch.setattr(transport.Receiver, "release", silent)
    began = time.monotonic()
    host.shutdown()

    # One call that outlived the drain, then none: not six times three seconds.
    assert len(calls) == 1
    assert time.monotonic() - began < 10
    assert all(status_of(m) == "InFlight" for m in waiting)  # left to lease expiry
    # And the stop's last line says so: it said every handler finished or was handed back.
    assert describe_left_behind(host) == (
        "6 delivery(ies) claimed ahead and never started could not be handed back; their "
        "deliveries are left to lease expiry."
    )


@pytest.mark.usefixtures("handlers_count_as_quick")
def test_a_stop_with_no_drain_time_still_hands_back_what_never_started(make_host, releases):
    """SHUTDOWN_DRAIN_MS may be 0: the bound on hand-backs (above) then left every delivery
    claimed ahead to lease expiry, its attempt spent without a run (review helper-119). Only a
    hand-back that failed past the drain's end stops the rest."""
    s = sub(lease_seconds=60)
    host = make_host([{"name": s.name, "concurrency": 1, "prefetch": 4}], shutdown_drain_ms=0)
    host.start()
    _, waiting = _a_blocker_and_claimed_ahead(s, 3)

    host.shutdown()

    for message_id in waiting:
        row = Delivery.objects.get(message_id=message_id)
        assert (row.status, row.attempt_count) == ("Pending", 0)
    assert len(releases) == 3


def _a_blocker_and_claimed_ahead(subscription: Any, count: int) -> tuple[str, list[str]]:
    """Publish, to a running host with one slot, a handler that holds it until aborted and
    ``count`` more; return their message ids once those ``count`` wait, claimed ahead."""
    first = publish(subscription.topic.name, {"then": "complete"}).message_id
    wait_until(lambda: status_of(first) == "Completed")  # a handler returned: claiming ahead is on
    blocker, *waiting = [
        r.message_id
        for r in publish_many(
            subscription.topic.name,
            [{"payload": {"sleepMs": 30_000, "thenOnAbort": "complete"}}]
            + [{"payload": {"then": "complete"}}] * count,
        )
    ]
    probe.wait_for(1, message_id=blocker)
    wait_until(lambda: all(status_of(m) == "InFlight" for m in waiting))
    return blocker, waiting


def _a_blocker_and_one_claimed_ahead(
    subscription: Any, blocker: dict[str, Any] | None = None
) -> tuple[str, str]:
    """Publish, to a running host with one slot, a handler that holds it (``blocker``, by
    default for 30 s unless aborted) and one more; return their message ids once the second
    waits, claimed ahead."""
    first = publish(subscription.topic.name, {"then": "complete"}).message_id
    wait_until(lambda: status_of(first) == "Completed")  # a handler returned: claiming ahead is on
    blocker_id, victim = [
        r.message_id
        for r in publish_many(
            subscription.topic.name,
            [
                {"payload": blocker or {"sleepMs": 30_000, "thenOnAbort": "complete"}},
                {"payload": {}},
            ],
        )
    ]
    probe.wait_for(1, message_id=blocker_id)
    wait_until(lambda: status_of(victim) == "InFlight")  # claimed ahead, waiting for the slot
    return blocker_id, victim


@pytest.mark.usefixtures("handlers_count_as_quick")
def test_a_delivery_cancelled_while_it_waited_for_a_slot_is_discarded_without_running(
    make_host, monkeypatch
):
    monkeypatch.setattr(wakeup, "POLL_SECONDS", 0.05)  # the cancel notification comes at once
    s = sub(lease_seconds=60)  # heartbeats only every 20 s: the notification tells the host
    host = make_host([{"name": s.name, "concurrency": 1, "prefetch": 2}])
    host.start()
    blocker, victim = _a_blocker_and_one_claimed_ahead(s)
    (running,) = [r for r in probe.runs if r.message_id == blocker]
    waiting = Delivery.objects.get(message_id=victim)

    transport.discard_or_cancel(str(s.id), str(waiting.id), "ops", "not wanted")

    # Discarded while the blocker still holds the only slot: it waits for none.
    wait_until(lambda: status_of(victim) == "Discarded")
    assert status_of(blocker) == "InFlight"
    transport.discard_or_cancel(str(s.id), running.delivery_id, "ops", "unblock")
    wait_until(lambda: status_of(blocker) == "Discarded")
    assert victim not in {r.message_id for r in probe.runs}


@pytest.mark.usefixtures("handlers_count_as_quick")
def test_a_delivery_cancelled_while_it_waited_is_discarded_when_the_host_stops(make_host):
    """A shutdown hands back what was claimed ahead; the hand-back of one cancelled meanwhile
    was refused (a cancelled delivery is not released), so it stayed InFlight until its lease
    expired, and an Exclusive or Ordered key with it. Its cancel is acknowledged instead."""
    s = sub(lease_seconds=60)
    host = make_host([{"name": s.name, "concurrency": 1, "prefetch": 2}], shutdown_drain_ms=1000)
    host.start()
    blocker, victim = _a_blocker_and_one_claimed_ahead(s)
    waiting = Delivery.objects.get(message_id=victim)
    transport.discard_or_cancel(str(s.id), str(waiting.id), "ops", "not wanted")

    host.shutdown()

    assert status_of(victim) == "Discarded"
    assert victim not in {r.message_id for r in probe.runs}
    assert status_of(blocker) == "Completed"


# -- the setting ----------------------------------------------------------------------------------


def test_prefetch_reads_the_named_entry_before_the_wildcard_whatever_the_message_size():
    config = HostConfig(
        subscriptions=[
            {"name": "*", "concurrency": 4, "prefetch": 7},
            {"name": "orders", "concurrency": 2, "prefetch": 0},
            {"name": "audit", "concurrency": 3, "prefetch": 300},
        ]
    )
    assert config.prefetch_for("payments", 1024) == 7
    assert config.prefetch_for("ORDERS ", 1024) == 0
    assert config.prefetch_for("audit", MAX_PAYLOAD_BYTES) == 300  # set: the operator's call


def test_by_default_what_is_claimed_ahead_holds_at_most_32_mib_of_the_topics_largest_messages():
    config = HostConfig(subscriptions=[], concurrency=6)
    assert config.prefetch_for("any", 1024) == 256
    assert config.prefetch_for("any", 131_072) == 256
    assert config.prefetch_for("any", MAX_PAYLOAD_BYTES) == 128  # the topics' default
    assert config.prefetch_for("any", 200_000) == 167


@pytest.mark.parametrize("value", [-1, "8", 2.5, True])
def test_a_bad_prefetch_names_the_setting_and_what_it_takes(value):
    config = HostConfig(subscriptions=[{"name": "orders", "prefetch": value}])
    with pytest.raises(WorkQueueConfigurationError, match=r"SUBSCRIPTIONS.*'orders' prefetch"):
        config.prefetch_for("orders", 1024)


@pytest.mark.usefixtures("handlers_count_as_quick")
def test_a_hand_back_still_queued_when_the_host_stops_is_not_dropped(
    make_host, releases, monkeypatch
):
    """A delivery claimed ahead that turned late goes back on one of the consumer's two
    settle threads. When both are busy as the host stops (a slow database, say), the
    hand-back was first dropped with the pool's plain tasks, then left queued past the host's
    stop, and lost if the process ended then: either way the delivery stayed leased until
    expiry counted the attempt it never used. The stop now hands it back itself."""
    monkeypatch.setattr(consumer, "PREFETCH_MIN_LEASE_SHARE", 1.01)  # every one ahead is late
    s = sub(handler_key="t.overlap")
    host = make_host([{"name": s.name, "concurrency": 1, "prefetch": 2}])
    host.start()
    first = publish(s.topic.name, {"n": 0}).message_id
    wait_until(lambda: status_of(first) == "Completed")  # a handler returned: claiming ahead is on
    busy = threading.Event()
    background = host._consumers[s.name]._settles
    for _ in range(2):
        background.run(busy.wait, 30)
    try:
        batch = publish_many(
            s.topic.name, [{"payload": {"n": n, "sleepMs": 50}} for n in (1, 2, 3)]
        )
        ids = [r.message_id for r in batch]
        # One runs; the two claimed with it turn late when it returns, before it is settled.
        wait_until(lambda: any(status_of(m) == "Completed" for m in ids))

        host.shutdown()
        # Before the settle threads are free again: the process may end as soon as the
        # host has stopped, and a hand-back still queued would end with it.
        left_leased = Delivery.objects.filter(message_id__in=ids, status="InFlight").count()
    finally:
        busy.set()

    assert left_leased == 0, "a hand-back was still queued when the host had stopped"
    assert releases, "nothing claimed ahead went back: the test proves nothing"
    for row in Delivery.objects.filter(message_id__in=ids):
        assert (row.status, row.attempt_count) in {("Completed", 1), ("Pending", 0)}


@pytest.mark.usefixtures("handlers_count_as_quick")
@pytest.mark.parametrize("settle_returns", ["after the drain", "during the drain"])
def test_a_delivery_next_in_a_slot_is_handed_back_at_shutdown_and_never_run(
    make_host, releases, monkeypatch, settle_returns
):
    """A handler returned a retry whose settle hangs (a database that does not answer), and the
    delivery claimed ahead of it waits on the same worker thread to run next. The host stops.
    Once the drain had given up, the waiting one was handed back, attempt refunded, and then ran
    anyway when the hung settle returned: a handler on a lease it no longer held, while another
    host may have claimed the delivery (or, in an Exclusive subscription, its key). A settle
    that returned during the drain let it start then, though the host was stopping."""
    hanging, entered, answered = threading.Event(), threading.Event(), threading.Event()
    retry = transport.Receiver.retry

    def slow_retry(self: transport.Receiver, *args: Any, **kwargs: Any) -> Any:
        if hanging.is_set():
            entered.set()
            answered.wait(30)
        return retry(self, *args, **kwargs)

    monkeypatch.setattr(transport.Receiver, "retry", slow_retry)
    s = sub()
    host = make_host([{"name": s.name, "concurrency": 1, "prefetch": 2}], shutdown_drain_ms=300)
    host.start()
    stopping = host._consumers[s.name]._stopping
    first = publish(s.topic.name, {}).message_id
    wait_until(lambda: status_of(first) == "Completed")  # a handler returned: claiming ahead is on
    hanging.set()
    batch = publish_many(s.topic.name, [{"payload": {"then": "retry", "n": n}} for n in (1, 2, 3)])
    ids = [r.message_id for r in batch]
    ran = probe.wait_for(2)[1].message_id
    assert entered.wait(10)  # its retry hangs, and the next waits on its thread

    if settle_returns == "during the drain":
        answering = threading.Thread(target=lambda: stopping.wait(10) and answered.set())
        answering.start()
        host.shutdown()
        answering.join()
    else:
        try:
            host.shutdown()
        finally:
            answered.set()
    wait_until(lambda: not runtime_threads(), timeout=15)

    assert [r.message_id for r in probe.runs] == [first, ran]
    assert len(releases) == 2  # the one next in the slot and the one still in line
    for row in Delivery.objects.filter(message_id__in=ids).exclude(message_id=ran):
        assert (row.status, row.attempt_count) == ("Pending", 0)
    assert host.unsettled_outcomes == (settle_returns == "after the drain")


def test_deliveries_claimed_ahead_hold_their_payloads_as_text_until_they_start(
    make_host, monkeypatch, request
):
    """The prefetch's budget (32 MiB of the topic's largest messages) counts JSON text, but a
    claim decoded every payload as it came in: JSON of empty objects is some 25 times larger
    decoded, and 16 deliveries of 256 KiB waiting for a slot held about 100 MB of the host
    (128 of them, the default at that size, most of a gigabyte). A delivery waiting for a slot
    keeps its payload as the stored text; its handler decodes it as it starts."""
    # Claim all 16 ahead however long the first handler took on a loaded machine (the loop
    # claims ahead only for handlers under 50 ms, and only what the slot gets through in 20 ms
    # at their pace), and hold the slot until all are claimed, however slowly 4 MB publishes.
    monkeypatch.setattr(consumer, "PREFETCH_HANDLER_SECONDS", 60.0)
    monkeypatch.setattr(consumer, "PREFETCH_WINDOW_SECONDS", 60.0)
    GatedHandler.gate.clear()
    request.addfinalizer(GatedHandler.gate.set)  # however the test ends, the blocker returns
    topic = TopicFactory(max_payload_bytes=MAX_PAYLOAD_BYTES)
    s = sub(topic=topic, handler_key="t.gated")
    host = make_host([{"name": s.name, "concurrency": 1, "prefetch": 16}])
    host.start()
    quick = publish(topic.name, {}).message_id
    wait_until(lambda: status_of(quick) == "Completed")  # quick handlers: claiming ahead is on
    blocker = publish(topic.name, {"gated": True}).message_id
    wait_until(lambda: status_of(blocker) == "InFlight")
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for _ in range(16):  # one at a time: a batch of 4 MB is over publish_many's bound
            publish(topic.name, {"pad": SWOLLEN_PAYLOAD})
        waiting = host._consumers[s.name]
        wait_until(lambda: waiting.in_flight == 17, timeout=30)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        GatedHandler.gate.set()

    assert held - before < 32 * 2**20, (
        f"16 deliveries waiting for a slot held {(held - before) / 2**20:.0f} MB of the host"
    )
    wait_until(lambda: Delivery.objects.filter(subscription=s, status="Completed").count() == 18)
