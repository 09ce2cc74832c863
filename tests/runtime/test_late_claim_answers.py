"""Review helper-171: a delivery claimed for a free slot whose claim answered late (the host
frozen, or the answer held up, between the claim's commit and the start) starts on a lease that
has already run out, and runs unsignalled beside the consumer that took it over."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.support.handlers import probe
from tests.support.hosts import sub
from workqueue import publish

pytestmark = pytest.mark.usefixtures("queue_db")


def test_a_delivery_whose_claim_answered_after_its_lease_never_starts(make_host, monkeypatch):
    """``_too_late_to_start`` judges a delivery claimed for a free slot by how long it waited
    since the claim's answer was taken in (``received_at``), never by its lease, which runs
    from before the claim was sent (``leased_at``). A claim whose answer comes late (a host
    frozen between the claim and the start, a commit held up by a synchronous standby, a slow
    network) hands the handler a lease already gone in the database; and with automatic
    heartbeats the lease horizon is armed only at the first tick, a third of a lease after the
    start. Meanwhile another consumer takes the delivery over: one Exclusive key run in two
    places at once, the first handler not even signalled."""
    from workqueue.models import Delivery
    from workqueue.transport import Receiver

    s = sub(partition_mode="Exclusive", lease_seconds=5, max_attempts=5)
    victim = publish(s.topic.name, {"sleepMs": 4000}, partition_key="k").message_id
    real_receive = Receiver.receive
    answered_late = threading.Event()
    host_consumer_owner: list[str] = []

    def late_answer(self: Receiver, max_rows: int) -> Any:
        result = real_receive(self, max_rows)
        late = self.lease_owner in host_consumer_owner and not answered_late.is_set()
        if result.deliveries and late:
            answered_late.set()
            time.sleep(6.0)  # the claim committed; its answer reaches the loop 6 s later
        return result

    monkeypatch.setattr(Receiver, "receive", late_answer)
    host = make_host([{"name": s.name, "concurrency": 1, "prefetch": 0}])
    host_consumer_owner.append(host.instance_id)
    host.start()
    assert answered_late.wait(10)
    claimed_by_host = Delivery.objects.get(message_id=victim)
    assert claimed_by_host.status == "InFlight"
    assert claimed_by_host.lease_owner == host.instance_id

    time.sleep(5.3)  # its 5 s lease runs out; another host's claim takes it over
    taken = Receiver(s.id, "another-host").receive(1).deliveries
    assert [d.message_id for d in taken] == [victim]
    taken_at = time.monotonic()

    time.sleep(2.0)  # the first host takes its late answer in
    late = [r for r in probe.runs if r.message_id == victim]
    if late:
        run = late[0]
        run.finished.wait(10)
        ran_for = time.monotonic() - run.started_at
    assert not late, (
        f"host 1 started the victim {run.started_at - taken_at:+.1f}s after another consumer had "
        f"claimed it (key 'k' held by both) and ran it for {ran_for:.1f}s before it was told "
        f"{run.signal_reason!r}"
    )
