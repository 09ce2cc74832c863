"""A consumer that fails is reported and restarted, never silently gone; a one-shot run never
releases what it claimed because its budget looked spent.

Faults are injected into the real driver (it raises an unexpected exception a few times), and
a slow thread is simulated by delaying the step that hands a claimed delivery to a worker.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.handlers import probe
from tests.support.hosts import one, states, status_of, sub
from tests.support.waiting import wait_until
from workqueue import publish, transport
from workqueue.driver import get_driver
from workqueue.models import Delivery, HostRecord
from workqueue.runtime import consumer as consumer_module

pytestmark = pytest.mark.usefixtures("queue_db")


class InjectedFault(Exception):
    """Not a WorkQueueError: what a bug or an unmapped driver error looks like."""


def failing(times: int, original: Callable[..., Any], when: Callable[..., bool]) -> Callable:
    """``original``, except that its first ``times`` calls for which ``when(*args)`` holds raise
    InjectedFault."""
    lock = threading.Lock()
    left = [times]

    def call(*args: Any, **kwargs: Any) -> Any:
        if when(*args, **kwargs):
            with lock:
                fail = left[0] > 0
                left[0] -= fail
            if fail:
                raise InjectedFault("injected fault")
        return original(*args, **kwargs)

    return call


@pytest.fixture(autouse=True)
def fast_restarts(monkeypatch):
    monkeypatch.setattr(consumer_module, "RESTART_MIN_SECONDS", 0.05)


def recorded_state(host: Any, name: str) -> tuple[str, str] | None:
    record = HostRecord.objects.filter(instance_id=host.instance_id).first()
    for entry in record.subscriptions if record else []:
        if entry["name"] == name:
            return entry["state"], entry["reason"]
    return None


def test_a_claim_loop_that_raises_is_reported_as_error_then_restarted(
    make_host, monkeypatch, caplog
):
    s = sub()
    driver = get_driver()
    monkeypatch.setitem(
        vars(driver),
        "call",
        failing(3, driver.call, lambda name, *args, **kwargs: name == "wq_claim"),
    )
    host = make_host(one(s))
    caplog.set_level(logging.ERROR, logger="workqueue.runtime.consumer")

    host.start()

    state, reason = wait_until(lambda: states(host)[s.name][0] == "Error" and states(host)[s.name])
    assert "InjectedFault('injected fault')" in reason
    assert wait_until(lambda: recorded_state(host, s.name) == (state, reason) or None)
    failures = [r for r in caplog.records if "claim loop failed" in r.getMessage()]
    assert failures and failures[0].exc_info is not None  # logged with its traceback

    wait_until(lambda: states(host)[s.name] == ("Running", ""))
    message = publish(s.topic.name, {"then": "complete"}).message_id
    wait_until(lambda: status_of(message) == "Completed")
    assert wait_until(lambda: recorded_state(host, s.name) == ("Running", "") or None)


def test_a_consumer_that_cannot_start_is_reported_as_error_then_started(make_host, monkeypatch):
    s = sub()
    message = publish(s.topic.name, {"then": "complete"}).message_id
    monkeypatch.setattr(
        transport, "_driver", failing(2, transport._driver, lambda *args, **kwargs: True)
    )
    host = make_host(one(s))

    host.start()  # does not raise

    state, reason = states(host)[s.name]
    assert (state, reason) == ("Error", "Consumer could not start: InjectedFault('injected fault')")
    wait_until(lambda: status_of(message) == "Completed")
    assert states(host)[s.name] == ("Running", "")


def test_run_once_with_max_1_processes_the_delivery_it_claimed_even_on_a_slow_thread(
    make_host, monkeypatch
):
    """Between the claim's return and the delivery counting as running, the run looked idle
    with its budget spent: a thread descheduled there made the run release its only delivery."""
    s = sub()
    message = publish(s.topic.name, {"then": "complete"}).message_id
    original = consumer_module.RunBudget.give_back

    def descheduled(self: Any, unused: int) -> None:
        time.sleep(0.3)  # the claim has returned; the loop thread loses the CPU here
        original(self, unused)

    monkeypatch.setattr(consumer_module.RunBudget, "give_back", descheduled)
    host = make_host(one(s, concurrency=1))

    result = host.run_once(max_deliveries=1, idle_exit_ms=200)

    assert (result.processed, result.reason) == (1, "MaxDeliveries")
    row = Delivery.objects.get(message_id=message)
    assert (row.status, row.attempt_count) == ("Completed", 1)


def test_run_once_never_ends_between_a_claims_return_and_its_read_of_the_claim_pending(
    make_host, monkeypatch
):
    """The run read a consumer's handlers in flight, then whether a claim was pending: the
    reverse of the order the loop writes them in (in flight counted before "pending" is
    cleared). A claim ending between the two reads read as neither, and with the budget spent
    the run ended as MaxDeliveries with the handler just started (review helper-119)."""
    s = sub()
    # Longer than the drain: a run that ends early aborts it and hands it back.
    message = publish(s.topic.name, {"sleepMs": 2000, "then": "complete"}).message_id
    in_flight = consumer_module.Consumer.in_flight.fget

    def read_then_descheduled(self: Any) -> int:
        value = in_flight(self)
        # The run's loop reading it (host health reads it too, on the same thread).
        if sys._getframe(2).f_code.co_name == "run_once" and self.receive_pending:
            # The run's thread loses the CPU right after this read; the claim returns meanwhile.
            wait_until(lambda: not self.receive_pending, timeout=10, interval=0.001)
        return value

    monkeypatch.setattr(consumer_module.Consumer, "in_flight", property(read_then_descheduled))
    receive = transport.Receiver.receive

    def slow(self: transport.Receiver, max_rows: int) -> Any:
        time.sleep(0.2)  # a claim on a loaded database: the run's reads land inside it
        return receive(self, max_rows)

    monkeypatch.setattr(transport.Receiver, "receive", slow)
    host = make_host(one(s, concurrency=1), shutdown_drain_ms=200)

    result = host.run_once(max_deliveries=1, idle_exit_ms=60_000)

    assert (result.processed, result.reason) == (1, "MaxDeliveries")
    assert probe.runs[-1].signal_reason is None  # ran to its end, not aborted by a drain
    row = Delivery.objects.get(message_id=message)
    assert (row.status, row.attempt_count) == ("Completed", 1)


def test_a_one_shot_run_whose_claims_keep_raising_reports_them_not_max_deliveries(
    make_host, monkeypatch, caplog
):
    """A claim that raised kept what it had taken from the run's budget: the run ended as
    MaxDeliveries, with nothing done and nothing reported that could not run (exit 0). Its stop
    tries once to take back what the last claim may have taken, and the same fault there must
    not fail the stop (it did, leaving the consumer's threads and sessions open)."""
    s = sub()
    driver = get_driver()
    monkeypatch.setitem(
        vars(driver), "call", failing(10**9, driver.call, lambda name, *a, **k: name == "wq_claim")
    )
    host = make_host(one(s))

    result = host.run_once(max_deliveries=1, idle_exit_ms=300, max_duration_ms=20_000)

    assert (result.processed, result.reason) == (0, "Idle")
    assert [entry["name"] for entry in result.could_not_run] == [s.name]
    assert "stopping the consumer failed" not in caplog.text


def test_a_consumer_whose_build_fails_after_its_threads_started_leaves_none_running(
    make_host, monkeypatch
):
    """A consumer starts its handler threads as it is built, then its completion thread. When
    the system refused that thread (a process at its thread limit), the build failed and the
    threads already started were left waiting for work forever: each retry of the start added
    as many again, in the process that was short of threads already."""
    s = sub()
    message = publish(s.topic.name, {"then": "complete"}).message_id
    refused = [2]
    real_start = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        if thread.name == f"wq-{s.name}-completions" and refused[0] > 0:
            refused[0] -= 1
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    host = make_host(one(s, concurrency=3))

    host.start()
    wait_until(lambda: status_of(message) == "Completed")
    host.shutdown()

    assert refused == [0]
    left = [t.name for t in threading.enumerate() if t.name.startswith(f"wq-{s.name}")]
    assert left == [], f"{len(left)} threads of failed builds still run: {left}"


def test_a_consumer_whose_carry_over_fails_leaves_no_threads_running(make_host, monkeypatch):
    """A consumer built to replace one a re-plan stopped takes over what its receiver still
    owed (``carry_over_from``, which a third party's transport implements too). When that
    raised, the consumer built (its threads running) was dropped unstopped."""
    s = sub()
    host = make_host(one(s, concurrency=3))
    host.start()
    monkeypatch.setattr(
        transport.Receiver,
        "carry_over_from",
        failing(1, transport.Receiver.carry_over_from, lambda *args, **kwargs: True),
    )
    type(s).objects.filter(pk=s.pk).update(backoff_max_seconds=60)  # an operator edit

    host.reconcile()
    assert states(host)[s.name][0] == "Error"
    wait_until(lambda: states(host)[s.name] == ("Running", ""))
    message = publish(s.topic.name, {"then": "complete"}).message_id
    wait_until(lambda: status_of(message) == "Completed")
    host.shutdown()

    left = [t.name for t in threading.enumerate() if t.name.startswith(f"wq-{s.name}")]
    assert left == [], f"{len(left)} threads of the dropped consumer still run: {left}"
