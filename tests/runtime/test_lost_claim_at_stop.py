"""Review helper-171: a claim whose answer is lost with its connection (it committed) as the host
stops. Outside a stop the next claim takes back what it took (``retake_claim_id``), and a
re-plan carries the lost claim over to the next consumer; a shutdown does neither, and does not
count it: the deliveries it took wait InFlight for their lease to expire (their attempt spent
unrun; a last attempt is dead-lettered LeaseExpired without running), while the host says every
handler finished or was handed back."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.support.handlers import probe
from tests.support.hosts import one, status_of, sub
from workqueue import publish
from workqueue.driver import get_driver
from workqueue.exceptions import PrivilegeRefusedError, TransientDriverError
from workqueue.models import Delivery
from workqueue.runtime.consumer import CompletionBatcher
from workqueue.runtime.process import describe_left_behind

pytestmark = pytest.mark.usefixtures("queue_db")


def test_a_claim_whose_answer_is_lost_as_the_host_stops_is_handed_back_or_counted(
    make_host, monkeypatch
):
    s = sub(lease_seconds=60, max_attempts=5)
    host = make_host(one(s, concurrency=1), shutdown_drain_ms=2000)
    host.start()
    consumer = host._consumers[s.name]
    driver = get_driver()
    real_call = driver.call
    armed, claimed = threading.Event(), threading.Event()

    def answer_lost(name: str, params: Any, **kwargs: Any) -> Any:
        rows = real_call(name, params, **kwargs)
        if name == "wq_claim" and armed.is_set() and any(r["kind"] == "Claimed" for r in rows):
            armed.clear()
            claimed.set()
            consumer._stopping.wait(10)  # the stop begins while the answer is on its way
            raise TransientDriverError("server closed the connection unexpectedly")
        return rows

    monkeypatch.setattr(driver, "call", answer_lost)
    armed.set()
    victim = publish(s.topic.name, {"then": "complete"}).message_id
    assert claimed.wait(30)  # a loaded CI machine once took longer than 10 s
    assert status_of(victim) == "InFlight"  # the claim committed

    host.shutdown()

    said = describe_left_behind(host)
    assert not [r for r in probe.runs if r.message_id == victim]
    status = status_of(victim)
    assert status == "Pending" or host.left_work_behind, (
        f"the delivery the lost claim took is {status} until its lease expires (an attempt "
        f"spent unrun), and the stopped host says: {said!r}"
    )


def test_the_stop_retakes_only_what_the_lost_claim_took(make_host, monkeypatch):
    """Review helper-172: the retake had room for concurrency + prefetch, so past what the lost
    claim took it claimed fresh deliveries too, stranded InFlight when their hand-back failed."""
    s = sub(lease_seconds=60, max_attempts=5)
    host = make_host(one(s, concurrency=3), shutdown_drain_ms=1000)
    host.start()
    consumer = host._consumers[s.name]
    driver = get_driver()
    real_call = driver.call
    armed, claimed = threading.Event(), threading.Event()
    claims_at_stop: list[list[str]] = []

    def answer_lost(name: str, params: Any, **kwargs: Any) -> Any:
        if name == "wq_release" and consumer._stopping.is_set():
            raise PrivilegeRefusedError("permission denied for function wq_release (test)")
        rows = real_call(name, params, **kwargs)
        if name == "wq_claim" and consumer._stopping.is_set():
            claims_at_stop.append([r["message_id"] for r in rows if r["kind"] == "Claimed"])
        if name == "wq_claim" and armed.is_set() and any(r["kind"] == "Claimed" for r in rows):
            armed.clear()
            claimed.set()
            consumer._stopping.wait(10)
            raise TransientDriverError("server closed the connection unexpectedly")
        return rows

    monkeypatch.setattr(driver, "call", answer_lost)
    armed.set()
    victim = publish(s.topic.name, {"then": "complete"}).message_id
    assert claimed.wait(30)  # a loaded CI machine once took longer than 10 s
    # Published while the lost claim's answer is on its way: no claim of this host took it.
    bystander = publish(s.topic.name, {"then": "complete"}).message_id

    host.shutdown()

    assert not probe.runs
    row = Delivery.objects.get(message_id=bystander)
    assert (row.status, row.attempt_count) == ("Pending", 0), (
        f"a delivery no lost claim took was claimed at the stop ({claims_at_stop}) and left "
        f"{row.status} at attempt {row.attempt_count} (victim {victim}: {status_of(victim)})"
    )


def test_handing_back_a_lost_claims_deliveries_gives_up_once_the_database_stops_answering(
    make_host, monkeypatch
):
    """_hand_back_all stops calling once one hand-back failed past the drain ("made one after
    another they held a stop far past its drain"); _hand_back_lost_claim calls for each
    delivery in turn, each waiting out its own timeout. README (104930f) says each wait of a
    stop is bounded by SHUTDOWN_DRAIN_MS."""
    s = sub(lease_seconds=60, max_attempts=5)
    for n in range(4):
        publish(s.topic.name, {"then": "complete", "n": n})
    host = make_host(one(s, concurrency=4), shutdown_drain_ms=500)
    driver = get_driver()
    real_call = driver.call
    armed, claimed = threading.Event(), threading.Event()

    seen: list[Any] = []

    def stopping() -> bool:
        if not seen and host._consumers.get(s.name) is not None:
            seen.append(host._consumers[s.name])
        return bool(seen) and seen[0]._stopping.is_set()

    def answer_lost(name: str, params: Any, **kwargs: Any) -> Any:
        if name == "wq_release" and stopping():
            time.sleep(1.5)  # a database that no longer answers: the call's own timeout
            raise TransientDriverError("timed out (test)")
        rows = real_call(name, params, **kwargs)
        if name == "wq_claim" and armed.is_set() and any(r["kind"] == "Claimed" for r in rows):
            armed.clear()
            claimed.set()
            deadline = time.monotonic() + 10
            while not stopping() and time.monotonic() < deadline:
                time.sleep(0.01)
            raise TransientDriverError("server closed the connection unexpectedly")
        return rows

    monkeypatch.setattr(driver, "call", answer_lost)
    armed.set()
    host.start()
    assert claimed.wait(30)  # a loaded CI machine once took longer than 10 s

    began = time.monotonic()
    host.shutdown()
    took = time.monotonic() - began

    assert took < 4.0, f"the stop took {took:.1f} s with a drain of 0.5 s"


def test_the_stop_takes_back_no_delivery_whose_late_settle_is_on_its_way(make_host, monkeypatch):
    """Review helper-187 (proven here): a claim whose answer was lost may have taken nothing, so
    the stop's retake claims one delivery afresh. A handler that returned just before its lease
    ended, its settle still on its way past the lease when the drain gave up, had its delivery
    taken by that claim and handed back: the settle was refused and the finished work would
    run again. The retake waits for such a settle (as every claim does) or leaves the lost
    claim to its lease."""
    s = sub(lease_seconds=5, max_attempts=3, heartbeat_mode="Manual")
    host = make_host(
        one(s, concurrency=2),
        shutdown_drain_ms=3_000,
        idle_poll_min_ms=30_000,
        idle_poll_max_ms=30_000,
    )
    slow: list[str] = []
    complete_later = CompletionBatcher.complete_later  # bound by the consumers as they start

    def slow_complete_later(self: CompletionBatcher, delivery: Any, settled: Any) -> bool:
        if delivery.message_id in slow:
            time.sleep(3)  # on its way past the lease's end
        return complete_later(self, delivery, settled)

    monkeypatch.setattr(CompletionBatcher, "complete_later", slow_complete_later)
    host.start()
    consumer = host._consumers[s.name]
    finished = publish(s.topic.name, {"sleepMs": 4_600, "ignoreSignal": True}).message_id
    slow.append(finished)
    (run,) = probe.wait_for(1)
    driver = get_driver()
    real_call = driver.call
    armed, lost = threading.Event(), threading.Event()

    def answer_lost(name: str, params: Any, **kwargs: Any) -> Any:
        rows = real_call(name, params, **kwargs)
        if name == "wq_claim" and armed.is_set():
            armed.clear()
            lost.set()
            consumer._stopping.wait(10)  # the stop begins while the answer is on its way
            raise TransientDriverError("server closed the connection unexpectedly")
        return rows

    monkeypatch.setattr(driver, "call", answer_lost)
    armed.set()
    consumer.kick()  # a claim for the free slot, which finds nothing and whose answer is lost
    assert lost.wait(10)

    # The stop begins now: it gives up at 6 s from the start (the handler returned at 4.6 s,
    # its lease ended at 5 s), and the settle is made at 7.6 s.
    host.shutdown()

    assert run.finished.is_set()
    row = Delivery.objects.get(message_id=finished)
    assert row.status == "Completed", (
        f"the finished work's delivery is {row.status} at attempt {row.attempt_count}: the "
        f"stop's retake took it while its settle was on its way, and it runs again"
    )
