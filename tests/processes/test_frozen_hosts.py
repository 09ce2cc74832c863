"""A host frozen past its lease (SIGSTOP, a paused VM) and then resumed: its handler is told
its lease is gone before it can go on beside the host that took the delivery meanwhile (attack
review helper-180). Real host processes against PostgreSQL."""

from __future__ import annotations

import signal as signals
import time

import pytest

from tests.factories import SubscriptionFactory
from tests.support.processes import read_events
from tests.support.waiting import wait_until
from workqueue import publish

pytestmark = [pytest.mark.processes, pytest.mark.usefixtures("queue_db")]


def test_a_host_frozen_past_its_lease_tells_its_handler_before_it_goes_on_beside_the_new_holder(
    processes,
):
    """Exclusive key k, 5 s lease. Host A's handler is a cooperative one: it waits on its
    signal (``context.signal.wait(3)``) and does its work's last step only if not told to
    stop. A is frozen (SIGSTOP) a second in, past its lease; host B claims the delivery and
    starts it (attempt 2); then A resumes. README, Guarantees: "A handler whose renewals
    stopped holding is told LeaseLost no later than the database lets another consumer claim
    its delivery". On resume A's wait times out before the timer thread gets to fire the
    horizon, so the handler is never told: it runs its last step (the "end" event, signal
    None) while B runs the same key. The signal now checks the horizon as it is read."""
    sub = SubscriptionFactory(
        handler_key="tests.record", partition_mode="Exclusive", lease_seconds=5
    )
    a = processes.host(sub.name, concurrency=1)
    publish(sub.topic.name, {"sleepMs": 3000}, partition_key="k")
    wait_until(lambda: any(e["event"] == "start" for e in read_events(processes.events)))
    time.sleep(1)
    a.popen.send_signal(signals.SIGSTOP)
    try:
        b = processes.host(sub.name, concurrency=1)
        wait_until(
            lambda: any(
                e["event"] == "start" and e["pid"] == b.pid for e in read_events(processes.events)
            ),
            timeout=30,
        )
    finally:
        a.popen.send_signal(signals.SIGCONT)
    wait_until(lambda: len(read_events(processes.events)) >= 4, timeout=30)

    events = read_events(processes.events)
    b_start = next(e for e in events if e["pid"] == b.pid and e["event"] == "start")
    a_last = [e for e in events if e["pid"] == a.pid and e["event"] != "start"]
    assert a_last, events
    (a_end,) = a_last
    assert a_end["t"] > b_start["t"]  # A went on after B had claimed and started key k
    assert (a_end["event"], a_end["signal"]) == ("abort", "LeaseLost"), (
        f"A's cooperative handler was not told its lease was gone before it went on beside B's "
        f"run of key k: {a_end['event']} with signal {a_end['signal']}"
    )
