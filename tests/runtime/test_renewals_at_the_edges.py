"""A host keeps holding a lease the database lets it hold while its handler still runs, or
another consumer runs the same delivery (one Exclusive key in two places) beside it. Two ways
it stopped (attack review helper-177, both seen failing):

(a) A renewal the database GRANTS but whose answer comes after the local lease horizon: the
    horizon signalled LeaseLost, and from then on every renewal was skipped, although the
    token still held and the database had just extended the lease.
(b) Renewals shared the consumer's two background threads with the settles made off the
    handlers' threads (retries, dead letters, releases): behind a few slow settles a renewal
    waited past the lease, the horizon stopped it, and it was never sent.

Real hosts and threads against PostgreSQL; faults are injected by delaying a driver call."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.support.handlers import probe
from tests.support.hosts import one, sub
from workqueue import publish
from workqueue.runtime.executor import DeliveryExecution
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")


def _watch_horizon(
    monkeypatch: pytest.MonkeyPatch, fired: list[float], watched_ids: list[str] | None = None
) -> None:
    """Record when a first attempt's horizon (of ``watched_ids``' deliveries, or any) reached
    its deadline with no renewal since: the handler is told LeaseLost then."""
    reached = DeliveryExecution._horizon_reached

    def watched(self: DeliveryExecution, deadline: float) -> None:
        mine = watched_ids is None or self.delivery.delivery_id in watched_ids
        if (
            mine
            and self.delivery.attempt == 1
            and not self._finished
            and self._lease_ends <= deadline
        ):
            fired.append(time.monotonic())
        reached(self, deadline)

    monkeypatch.setattr(DeliveryExecution, "_horizon_reached", watched)


def test_a_renewal_granted_after_the_horizon_keeps_the_host_renewing(make_host, monkeypatch):
    """Lease 5 s, renewals every 1.7 s. The first renewal commits at ~1.7 s (the database now
    holds the lease to ~6.7 s) and its answer comes at ~5.3 s, after the horizon (5 s) has
    told the handler LeaseLost. A handler that ignores the signal keeps working (as handlers
    that call a slow API do). The token still holds the delivery, so the host should go on
    renewing: nobody else may claim the delivery while the handler runs."""
    s = sub(partition_mode="Exclusive", lease_seconds=5, max_attempts=5)
    extend = Receiver.extend_lease
    renewals: list[tuple[float, float, str]] = []  # (sent, answered, state)
    horizon: list[float] = []
    _watch_horizon(monkeypatch, horizon)

    def first_answered_late(self: Receiver, delivery: Any, progress: Any = None) -> Any:
        sent = time.monotonic()
        granted = extend(self, delivery, progress)  # committed: the lease runs on in the db
        if not renewals:
            time.sleep(3.6)  # its answer is held up (a slow network, a busy host)
        renewals.append((sent, time.monotonic(), granted.state))
        return granted

    monkeypatch.setattr(Receiver, "extend_lease", first_answered_late)
    host = make_host(one(s, concurrency=1))
    host.start()
    publish(s.topic.name, {"sleepMs": 12000, "ignoreSignal": True}, partition_key="k")
    (run,) = probe.wait_for(1)
    t0 = run.started_at

    time.sleep(max(0.0, t0 + 8.5 - time.monotonic()))  # past the late renewal's lease (~6.7 s)
    still_running = not run.finished.is_set()
    taken = Receiver(s.id, "another-host").receive(1).deliveries
    taken_at = time.monotonic() - t0
    assert run.finished.wait(10)

    sent = [(round(a - t0, 1), round(b - t0, 1), state) for a, b, state in renewals]
    timeline = (
        f"the horizon said LeaseLost at {[round(t - t0, 1) for t in horizon]} s; renewals "
        f"(sent, answered, state): {sent}"
    )
    assert still_running
    assert not taken, (
        f"another consumer claimed the delivery at {taken_at:.1f} s while host 1's handler ran "
        f"(till 12 s) on a lease the database had granted it: {timeline}"
    )


def test_a_renewal_does_not_wait_behind_slow_settles(make_host, monkeypatch):
    """Lease 5 s; seven deliveries run at once: six fail at ~1.2 s (each retry's settle takes
    2 s, a database slow to write), one runs for 9 s and ignores its signals. Its renewal is
    due at ~1.7 s; it must reach the database before the lease runs out (5 s), whatever
    settles of other deliveries are queued, so that nobody else may claim it meanwhile."""
    s = sub(
        partition_mode="Exclusive",
        lease_seconds=5,
        max_attempts=5,
        backoff_base_seconds=60,
        backoff_max_seconds=60,
    )
    retry, extend = Receiver.retry, Receiver.extend_lease
    settles: list[tuple[float, float]] = []
    renewals: list[float] = []
    ticks: list[float] = []
    began: list[float] = []
    horizon: list[float] = []
    long_id: list[str] = []
    _watch_horizon(monkeypatch, horizon, long_id)

    def slow_retry(self: Receiver, delivery: Any, *args: Any, **kwargs: Any) -> Any:
        sent = time.monotonic()
        time.sleep(2.0)
        try:
            return retry(self, delivery, *args, **kwargs)
        finally:
            settles.append((sent, time.monotonic()))

    def recorded_extend(self: Receiver, delivery: Any, progress: Any = None) -> Any:
        if delivery.delivery_id in long_id and delivery.attempt == 1:
            renewals.append(time.monotonic())
        return extend(self, delivery, progress)

    tick, beat = DeliveryExecution._auto_heartbeat_tick, DeliveryExecution._beat

    def recorded_tick(self: DeliveryExecution) -> None:
        if self.delivery.delivery_id in long_id and self.delivery.attempt == 1:
            ticks.append(time.monotonic())
        tick(self)

    def recorded_beat(self: DeliveryExecution, progress: Any) -> bool:
        if (
            self.delivery.attempt == 1
            and self.delivery.delivery_id in long_id
            and "-bg-" in threading.current_thread().name
        ):
            began.append(time.monotonic())
        return beat(self, progress)

    monkeypatch.setattr(Receiver, "retry", slow_retry)
    monkeypatch.setattr(Receiver, "extend_lease", recorded_extend)
    monkeypatch.setattr(DeliveryExecution, "_auto_heartbeat_tick", recorded_tick)
    monkeypatch.setattr(DeliveryExecution, "_beat", recorded_beat)
    victim = publish(s.topic.name, {"sleepMs": 9000, "ignoreSignal": True}, partition_key="long")
    for n in range(6):
        publish(s.topic.name, {"sleepMs": 1200, "then": "retry"}, partition_key=f"f{n}")
    host = make_host([{"name": s.name, "concurrency": 7, "prefetch": 0}])
    host.start()
    (run,) = probe.wait_for(1, message_id=victim.message_id)
    long_id.append(run.delivery_id)
    t0 = run.started_at

    time.sleep(max(0.0, t0 + 6.5 - time.monotonic()))  # past the lease, if never renewed
    taken = Receiver(s.id, "another-host").receive(1).deliveries  # or this host took it back
    assert run.finished.wait(10)
    ended = time.monotonic() - t0

    waited = [round(b - t, 1) for t, b in zip(ticks, began, strict=False)]
    beside = [
        (f"attempt {r.attempt} on this host", round(r.started_at - t0, 1))
        for r in probe.runs
        if r.message_id == victim.message_id and r is not run and r.started_at - t0 < ended
    ] + [("another host's claim", 6.5) for d in taken if d.message_id == victim.message_id]
    timeline = (
        f"its renewal, due at {[round(t - t0, 1) for t in ticks]} s, began on a background thread "
        f"at {[round(t - t0, 1) for t in began]} s (waited {waited} s) and sent extend_lease at "
        f"{[round(t - t0, 1) for t in renewals]} s; the horizon said LeaseLost at "
        f"{[round(t - t0, 1) for t in horizon]} s; the settles (sent, done) ran "
        f"{[(round(a - t0, 1), round(b - t0, 1)) for a, b in settles]}"
    )
    assert not beside, (
        f"the long delivery (key 'long') ran again, started at (s) {beside}, while its first "
        f"handler ran (0 to {ended:.1f} s): {timeline}"
    )
