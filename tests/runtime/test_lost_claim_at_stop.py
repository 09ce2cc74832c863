"""Review helper-171: a claim whose answer is lost with its connection (it committed) as the host
stops. Outside a stop the next claim takes back what it took (``retake_claim_id``), and a
re-plan carries the lost claim over to the next consumer; a shutdown does neither, and does not
count it: the deliveries it took wait InFlight for their lease to expire (their attempt spent
unrun; a last attempt is dead-lettered LeaseExpired without running), while the host says every
handler finished or was handed back."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tests.support.handlers import probe
from tests.support.hosts import one, status_of, sub
from workqueue import publish
from workqueue.driver import get_driver
from workqueue.exceptions import TransientDriverError
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
    assert claimed.wait(10)
    assert status_of(victim) == "InFlight"  # the claim committed

    host.shutdown()

    said = describe_left_behind(host)
    assert not [r for r in probe.runs if r.message_id == victim]
    status = status_of(victim)
    assert status == "Pending" or host.left_work_behind, (
        f"the delivery the lost claim took is {status} until its lease expires (an attempt "
        f"spent unrun), and the stopped host says: {said!r}"
    )
