"""The claim loop of one subscription: claim what free slots can run (and, while handlers
are quick, a few more to start as slots free), run each delivery on a worker thread, batch the
completions, back off when idle, wake up on a kick.

Reading order: ``_loop`` (claim → start → wait), ``_execute`` (one delivery on a worker
thread), ``stop`` (drain, abort, drain).
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from workqueue import metrics
from workqueue.exceptions import WorkQueueError, one_line
from workqueue.models.hosts import (
    CLAIM_LOOP_FAILED,
    RATE_TOKENS_FAILED,
    RECEIVE_FAILED,
    SETTLES_REFUSED,
)
from workqueue.runtime.context import AbortReason
from workqueue.runtime.executor import (
    RETRY_MAX_SECONDS,
    RETRY_MIN_SECONDS,
    RETRYABLE_SETTLE_ERRORS,
    DeliveryExecution,
    ExecutionResult,
    ExecutionServices,
    report_lease_expired_dead_letter,
)
from workqueue.runtime.handler_runs import HandlerRun
from workqueue.runtime.handlers import HandlerRegistry
from workqueue.runtime.plan import SubscriptionPlan
from workqueue.runtime.timers import Timer, TimerQueue
from workqueue.runtime.workers import WorkerPool
from workqueue.transports import TransportReceiver, transport_for
from workqueue.types import (
    ClaimedDelivery,
    ClaimResult,
    DeliveryStatus,
    PartitionMode,
    SettleResult,
)

logger = logging.getLogger(__name__)

COMPLETION_BATCH_LIMIT = 500
GATHER_SECONDS = 0.002
#: Claiming ahead pays only while handlers are about as quick as a claim's round trip; past
#: this mean handler time a delivery claimed ahead would keep another host from it for longer
#: than it saves, so the loop claims for free slots only.
PREFETCH_HANDLER_SECONDS = 0.05
#: Past the free slots, the loop claims no more than the slots get through in this long at the
#: handlers' mean time: enough to keep them busy across the next claim's round trip (and a
#: busy server's slower one), never so much that a delivery claimed ahead waits long for its
#: slot while another host has none.
PREFETCH_WINDOW_SECONDS = 0.02
#: ``prefetch`` unless a subscription's settings entry gives one (see default_prefetch). Claims
#: of a few hundred cost the database about half as much per delivery as claims of a few
#: (measured in bench/drain.py); the window keeps the wait of each one short whatever the count.
DEFAULT_PREFETCH = 256
#: Deliveries claimed ahead hold their messages in the host's memory: by default no more of
#: them than this many bytes' worth of the topic's largest messages.
PREFETCH_MAX_BYTES = 32 * 1024 * 1024
#: A delivery claimed ahead starts only while at least this share of its lease is left (else it
#: goes back to the queue, its attempt refunded): a handler never starts on a lease about to end.
PREFETCH_MIN_LEASE_SHARE = 0.5
#: A delivery claimed for a free slot goes back unrun (attempt refunded) once it has waited
#: for a worker thread this share of its lease, counted from its claim's answer: the threads
#: may all be busy settling (review helper-161). Not from the claim's sending: a claim slower
#: than half the lease would then have handed back every delivery it took, for ever (review
#: helper-162).
START_MAX_WAIT_SHARE = 0.5
#: ... and, whatever it waited for, once less than this share of its lease is left by the
#: local clock, counted from the claim's sending: a claim answered that late (a host frozen
#: between its commit and the start, a commit held up by a synchronous standby) may have left
#: a lease gone in the database, the delivery taken over already (review helper-171). A claim
#: slower than most of a lease is a database too slow to run on, not a reason to start late.
START_MIN_LEASE_SHARE = 0.1
#: No claim is made while a handler that returned is still having its outcome recorded this
#: close to its lease's end, or past it: the database may hand the delivery to that claim (its
#: lease gone there first), and the finished work would run again (review helper-186). The
#: margin is for a claim on its way as the lease ends, which the database may answer after it.
LATE_SETTLE_MARGIN_SECONDS = 1.0
#: Weight of the latest handler time in the running mean that decides whether to claim ahead.
HANDLER_TIME_WEIGHT = 0.2
RESTART_MIN_SECONDS = 1.0
RESTART_MAX_SECONDS = 30.0


#: Statuses a settle leaves a delivery in for good (nothing of it is claimable again).
_ENDED = frozenset(
    {DeliveryStatus.COMPLETED, DeliveryStatus.DEAD_LETTERED, DeliveryStatus.DISCARDED}
)


def default_prefetch(max_payload_bytes: int) -> int:
    """How many deliveries a subscription whose settings entry gives no ``prefetch`` may claim
    ahead: DEFAULT_PREFETCH, or fewer when that many of its topic's largest messages would hold
    more than PREFETCH_MAX_BYTES (128 at the 256 KiB default ``max_payload_bytes``)."""
    return min(DEFAULT_PREFETCH, PREFETCH_MAX_BYTES // max_payload_bytes)


#: How long, and how many, cancel announcements for deliveries a consumer does not hold are
#: kept, in case their claim has committed but not been registered yet (milliseconds, unless
#: the process is starved).
RECENT_CANCEL_SECONDS = 30.0
RECENT_CANCELS_KEPT = 1000

#: Claim-loop failures in a row after which a one-shot run counts its subscription as unable to
#: run (fewer are a blip the next claim may get past).
FAILURES_THAT_PERSIST = 3


def restart_delay_seconds(failures_in_a_row: int) -> float:
    """How long a failed consumer waits before it tries again: 1 s, 2 s, 4 s ... at most 30 s.
    The exponent stops growing once past the cap: a float power overflows at 1,025 failures
    in a row (hours of an outage), which crashed the claim loop."""
    doublings = min(failures_in_a_row - 1, 16)
    return min(RESTART_MIN_SECONDS * 2**doublings, RESTART_MAX_SECONDS)


@dataclass(frozen=True, slots=True)
class ConsumerConfig:
    concurrency: int
    #: How many deliveries past ``concurrency`` the loop may claim ahead while handlers are
    #: quick (see PREFETCH_HANDLER_SECONDS); they start, in claim order, as slots free.
    prefetch: int = 0
    idle_poll_min_ms: int = 250
    idle_poll_max_ms: int = 5000
    shutdown_drain_ms: int = 8000
    #: Whether every publish to the topic wakes this consumer, wherever it was published from
    #: (the database sends notifications). Then a handler's return after a claim that took all
    #: there was wakes nothing; without them (SQL Server) it stands in for a poll, as it always
    #: did: a handler's own enlisted publish, say, is claimed as soon as it has returned.
    publishes_wake: bool = False


class RunBudget:
    """How many deliveries a one-shot run may still receive (None: unlimited)."""

    def __init__(self, max_deliveries: int | None) -> None:
        self.remaining = max_deliveries
        # Takes that were granted some of it, ever: read before and after its reads of the
        # consumers, an unchanged count tells a run that no claim took any meanwhile (one
        # given back and taken again between two reads of "spent" looks spent to both).
        self._takes = 0
        self._lock = threading.Lock()

    def take(self, wanted: int) -> int:
        with self._lock:
            if self.remaining is None:
                return wanted
            granted = min(wanted, self.remaining)
            self.remaining -= granted
            if granted:
                self._takes += 1
            return granted

    def give_back(self, unused: int) -> None:
        with self._lock:
            if self.remaining is not None:
                self.remaining += unused

    def read(self) -> tuple[bool, int]:
        """(whether it is spent, how many takes were granted some of it so far), in one hold."""
        with self._lock:
            return self.remaining == 0, self._takes


SettleCallback = Callable[[SettleResult | Exception], None]


class CompletionBatcher:
    """Settles completions in batches: while one ``wq_complete_many`` call runs, the next
    completions queue up and go together in the following call. Each caller still gets its
    own fenced result: waiting for it (``complete``) or called back with it on the batcher's
    thread (``complete_later``), which leaves the caller's thread free meanwhile."""

    def __init__(self, receiver: TransportReceiver, name: str) -> None:
        self._receiver = receiver
        self._queue: queue.SimpleQueue[tuple[ClaimedDelivery, SettleCallback] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._stopped = False
        # A completion held back from a batch that already had its delivery id, to open the
        # next one (the batcher's thread alone reads and writes it).
        self._held_back: tuple[ClaimedDelivery, SettleCallback] | None = None
        self._thread = threading.Thread(target=self._run, name=f"{name}-completions", daemon=True)
        self._thread.start()

    def complete(self, delivery: ClaimedDelivery) -> SettleResult:
        future: Future[SettleResult] = Future()

        def settled(outcome: SettleResult | Exception) -> None:
            if isinstance(outcome, Exception):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

        if not self.complete_later(delivery, settled):
            # A handler that outlived the drain finishes after the batcher stopped: settle it
            # on its own thread rather than queueing where nobody listens.
            return self._receiver.complete(delivery)
        return future.result()

    def complete_later(self, delivery: ClaimedDelivery, settled: SettleCallback) -> bool:
        """Queue ``delivery``'s completion; ``settled`` is called on the batcher's thread with
        its result, or with the error that failed its batch, and must return quickly. False
        (nothing queued) once the batcher has stopped."""
        with self._lock:
            if self._stopped:
                return False
            self._queue.put((delivery, settled))
        return True

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._queue.put(None)  # everything queued before this is still settled
        self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            while self._settle_next_batch():
                pass
        finally:
            self._receiver.close()

    def _settle_next_batch(self) -> bool:
        """Wait for completions and settle those queued by then as one batch; False once
        stopped. A call of its own, so that nothing of a settled batch (its deliveries, their
        payloads, the callers' callbacks) is kept while the thread waits for the next."""
        item, self._held_back = self._held_back or self._queue.get(), None
        if item is None:
            return False
        batch = [item]
        in_batch = {item[0].delivery_id}
        while len(batch) < COMPLETION_BATCH_LIMIT:
            try:
                more = self._queue.get_nowait()
            except queue.Empty:
                break
            if more is None:
                self._queue.put(None)  # finish this batch, then stop
                break
            if more[0].delivery_id in in_batch:
                # Two holders of one delivery (a lease that ran out and the re-claim; on AWS,
                # two copies of a message): a batch's results are keyed by delivery id, so in
                # one batch each was told the other's result.
                self._held_back = more
                break
            batch.append(more)
            in_batch.add(more[0].delivery_id)
        metrics.SETTLE_BATCH.observe(len(batch))
        outcomes: list[SettleResult | Exception]
        try:
            results = self._receiver.complete_many(d for d, _ in batch)
        except Exception as exc:  # every caller must hear about it
            outcomes = [exc] * len(batch)
        else:
            outcomes = [results[delivery.delivery_id] for delivery, _ in batch]
        for (_, settled), outcome in zip(batch, outcomes, strict=True):
            try:
                settled(outcome)
            except Exception:  # one caller's failure must not stop the others' results
                logger.exception("A completion callback failed")
        return True


class Consumer:
    """Runs one subscription's deliveries with at most ``concurrency`` handlers at a time."""

    def __init__(
        self,
        plan: SubscriptionPlan,
        config: ConsumerConfig,
        *,
        lease_owner: str,
        handlers: HandlerRegistry,
        user: Any,
        timers: TimerQueue,
        budget: RunBudget | None = None,
        on_result: Callable[[ExecutionResult], None] | None = None,
        predecessors: Sequence[Consumer] = (),
    ) -> None:
        """``predecessors``: consumers of the same subscription that a re-plan stopped while
        handlers they gave up on still run (``lingering``); those handlers take slots of this
        consumer's concurrency until they return."""
        self.plan = plan
        self.config = config
        self.budget = budget
        self._on_result = on_result
        # Once per consumer: the transport's own receiver (on the Database transport, the
        # procedures' Receiver itself), so claiming and settling pay nothing for the seam.
        transport = transport_for(plan.driver_class)
        self.receiver = transport.receiver(plan.subscription_id, lease_owner)
        #: Whether operators can cancel its running deliveries (announced cancels are for it).
        self.hears_cancels = transport.supports_cancel
        name = f"wq-{plan.name}"
        # Twice the concurrency: a finished handler frees its slot at once while its thread
        # may still settle (a retry, a dead letter; completions go to the batcher), so
        # claiming overlaps settling. The second half starts only when a delivery is handed
        # over before the thread that freed its slot is back for the next.
        with contextlib.ExitStack() as built:
            # What started is stopped again should a later step fail (the system refusing a
            # thread): a consumer that failed to build is retried, and leaked each time.
            built.callback(self.receiver.close)
            self._workers = WorkerPool(2 * config.concurrency, name, started=config.concurrency)
            built.callback(self._workers.shutdown)
            # Renewals and cancel checks on two threads, settles made off the handlers' threads
            # (retries, dead letters, releases, hand-backs) on two others: sharing two, a
            # renewal waited behind a burst of slow settles past its lease, and another
            # consumer ran the delivery beside its handler (review helper-177).
            self._background = WorkerPool(2, f"{name}-bg")
            built.callback(self._background.shutdown)
            self._settles = WorkerPool(2, f"{name}-settle")
            built.callback(self._settles.shutdown)
            self._completions = CompletionBatcher(self.receiver, name)
            built.pop_all()  # from here, stop() ends them
        self._services = ExecutionServices(
            receiver=self.receiver,
            complete=self._completions.complete,
            complete_later=self._completions.complete_later,
            timers=timers,
            background=self._background,
            settle_threads=self._settles,
            handlers=handlers,
            user=user,
            cancels=self.hears_cancels,
        )
        self._running: dict[tuple[str, str], DeliveryExecution] = {}  # until settled
        # Cancels announced for deliveries not (yet) held here, oldest first: id -> when.
        self._recent_cancels: dict[str, float] = {}
        self._handlers_running = 0  # slots taken: from claim until the handler returns
        # No earlier than this (monotonic) can an execution here near its lease's end, when a
        # returned handler's settle on its way would hold claims back (_holds_a_late_settle):
        # a bound kept as deliveries start, made exact only once it is reached, so that the
        # room read at every handler's return costs no walk of them (review helper-187: a walk
        # of the settles on their way cost ~20% more host CPU per delivery at concurrency 32).
        self._leases_checked_until = math.inf
        # Claimed ahead, waiting for a slot (only while every slot is taken), in claim order.
        self._ready: deque[DeliveryExecution] = deque()
        # Due when the one that has waited longest will have waited too long: nothing renews
        # its lease while it waits, and left until a slot frees, it may have expired (an attempt
        # spent unrun). One timer for them all, set while any waits (they wait in claim order).
        self._ready_check: Timer | None = None
        # Set when one of them waited too long: every slot is held by handlers that outlive a
        # lease, and what is claimed ahead would only go back again. Nothing is claimed ahead
        # until a slot frees (else this host takes the handed-back delivery straight back).
        self._slots_stalled = False
        # Claimed ahead, turned late waiting for a slot, and queued to be handed back on a
        # settle thread; still counted as running until the release returns.
        self._late: dict[tuple[str, str], DeliveryExecution] = {}
        # Every delivery going back unstarted, from the moment that is decided until its
        # release has returned (past its time in ``_late``): no worker may start one, and a
        # cancel heard meanwhile must not take one for a delivery that holds a slot.
        self._handing_back: set[tuple[str, str]] = set()
        # Running mean of handler times (None until one returns): whether to claim ahead.
        self._handler_seconds: float | None = None
        # How much room to claim into the loop waits for: a handler that returns wakes it only
        # once that much is free (each wake-up is a thread switch, and most would find too
        # little).
        self._slots_wanted = 1
        # Whether the last claim got fewer deliveries than it asked for: then a settle may
        # make more claimable (an Exclusive/Ordered key freed), and wakes the loop.
        self._last_receive_short = False
        # Whether the last claim took all there was (ClaimResult.drained): then a handler that
        # returns frees a slot with nothing to fill it, and does not wake the loop.
        self._last_receive_drained = False
        self._lock = threading.Condition()
        self._wake = threading.Event()
        self._kicked = False
        self._stopping = threading.Event()
        # Once stop() has begun, hand-backs made by other threads (a late one, the claim loop's)
        # are made again only until its drain ends: a database down at shutdown must not hold
        # the stop for a lease.
        self._hand_backs_end = math.inf
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.received = 0
        self.finished = 0  # executions ended, however
        # Of which the handler's outcome was recorded: not handed back, not refused for a lost
        # lease (another consumer runs it), not left unknown by a settle that failed.
        self.processed = 0
        self.last_activity = time.monotonic()
        self.receive_pending = False
        self.last_receive_empty = False
        self.abandoned = 0  # handlers still running when stop() gave up on them
        # Of those, the ones that completed their delivery in their own transaction.
        self.abandoned_completed = 0
        self.unsettled = 0  # handlers that had returned then, their outcome not yet recorded
        #: Deliveries claimed ahead that a stop could not hand back (left to lease expiry).
        self.not_handed_back = 0
        #: 1 when this consumer's claim was still waiting for the database as its stop ended:
        #: what it took is left to lease expiry (said in the host's last line).
        self.claims_left_out = 0
        # Whether the claim loop is in a claim, from its call to the start or hand-back of
        # what it took (not while it waits for rate tokens or probes settles).
        self._claim_out = False
        #: Why the claim loop is not claiming right now (health reports the subscription as
        #: Error with this reason); None while it works.
        self.failure: str | None = None
        self._failures_in_a_row = 0
        # Set while the database refuses settles for want of a grant (a DBA's REVOKE): every
        # outcome reached meanwhile is lost and its delivery runs again at lease expiry, so
        # the loop claims nothing until ``_claims_resume_at``, then one delivery at a time,
        # until a settle goes through.
        self._settles_refused = False
        self._refusal = ""  # why they are refused, while they are (health's reason)
        self._claims_resume_at = 0.0
        # The executions claimed while settles are refused (the probes): the next probe waits
        # for these, not for handlers claimed before the refusal (a long or hung one).
        self._probes: set[Any] = set()
        self._predecessors = list(predecessors)
        self._successors: list[Consumer] = []  # told when a handler of this one returns
        for predecessor in self._predecessors:
            predecessor._successors.append(self)

    # -- public ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def kick(self) -> None:
        """Wake the loop now (something was published to the subscription's topic)."""
        self._kicked = True
        self._wake.set()

    def check_lease(self, delivery_id: str | None) -> None:
        """Renew the lease of a running delivery now (it may just have been cancelled): the
        renewal reports the cancel and the handler is signalled without waiting a heartbeat.
        ``None``: every delivery this consumer holds (cancels may have been missed).

        An id it holds no delivery of is remembered for a while: its claim may have committed
        and not be registered yet, and the execution is checked once it is (``_start``)."""
        with self._lock:
            executions = [
                e
                for e in self._running.values()
                if delivery_id is None or e.delivery.delivery_id == delivery_id
            ]
            if delivery_id is not None and not executions:
                self._remember_cancel(delivery_id)
        for execution in executions:
            execution.check_lease_soon()

    def _remember_cancel(self, delivery_id: str) -> None:
        now = time.monotonic()
        self._recent_cancels.pop(delivery_id, None)  # announced again: it goes to the end
        while self._recent_cancels and (
            len(self._recent_cancels) >= RECENT_CANCELS_KEPT
            or next(iter(self._recent_cancels.values())) < now - RECENT_CANCEL_SECONDS
        ):
            del self._recent_cancels[next(iter(self._recent_cancels))]  # the oldest
        self._recent_cancels[delivery_id] = now

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._running)

    def handler_runs(self, default_threshold_seconds: int) -> list[HandlerRun]:
        """The handlers running now (called, not yet returned), each with when it started and
        its threshold: the subscription's ``max_processing_seconds``, else
        ``default_threshold_seconds``."""
        with self._lock:
            executions = list(self._running.values())
        if self.plan.max_processing_seconds:
            threshold, source = self.plan.max_processing_seconds, "max_processing_seconds"
        else:
            threshold, source = default_threshold_seconds, "HANDLER_RUN_WARNING_SECONDS"
        runs = []
        for execution in executions:
            since = execution.handler_running_since()
            if since is not None:
                runs.append(
                    HandlerRun(
                        key=execution.key,
                        subscription=self.plan.name,
                        delivery_id=execution.delivery.delivery_id,
                        handler_key=self.plan.handler_key,
                        started_at=since,
                        threshold_seconds=threshold,
                        threshold_source=source,
                        cancellable=self.hears_cancels,
                    )
                )
        return runs

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, *, process_lives_on: bool = False) -> None:
        """Stop claiming, tell running handlers (``context.stopping``) and let them finish,
        then abort the rest with Shutdown.

        Each phase waits at most SHUTDOWN_DRAIN_MS. When the process ends next (a shutdown),
        anything still running after the second wait is left to lease expiry. When it lives on
        (``process_lives_on``: a re-plan stops this consumer and starts another), a handler
        that outlives the drain goes on running here, so its lease is renewed and its outcome
        settled until it returns (``lingering`` until then): left to expire, its delivery
        would run a second time beside it, on this host's next consumer or another host,
        whatever its partition key. Safe to call twice and before ``start``.
        """
        drain = self.config.shutdown_drain_ms / 1000
        self._hand_backs_end = time.monotonic() + drain
        self._stopping.set()
        self._wake.set()
        # Tell running handlers now, not when the drain is over: cooperative ones can stop
        # early and the drain ends as soon as they have.
        self._services.stopping.notify()
        if self._thread.is_alive():
            self._thread.join(drain)
        with self._lock:
            waiting = [*self._ready, *self._late.values()]
            self._ready.clear()
            self._late.clear()
            if self._ready_check is not None:
                self._ready_check.cancel()
                self._ready_check = None
            for execution in waiting:
                self._running.pop(execution.key, None)
                self._handing_back.discard(execution.key)
        # Claimed ahead and never started (a hand-back still queued behind busy settle
        # threads included): back to the queue now, attempt refunded, before the process may
        # end.
        self._hand_back_all(waiting, time.monotonic() + drain)
        gave_up = False
        if not self.wait_idle(drain):
            with self._lock:
                running = list(self._running.values())
            for execution in running:
                execution.abort(AbortReason.SHUTDOWN)
            gave_up = not self.wait_idle(drain)
        self._workers.shutdown()
        if self._thread.is_alive() and self._claim_out:
            # A claim still out (its answer slower than the drain): the loop hands back what it
            # took when the answer comes, which must be before the process may end (review
            # helper-161). Waited for as long again; one still out then is counted and said.
            self._hand_backs_end = time.monotonic() + drain
            self._thread.join(drain)
            self.claims_left_out = int(self._thread.is_alive() and self._claim_out)
        with self._lock:
            # Taken out, so that no worker starts them after all (_take_for_this_thread), and
            # counted in the same hold, so that what is counted is what is left.
            never_started = [e for e in self._running.values() if not e.started]
            for execution in never_started:
                self._running.pop(execution.key, None)
            if gave_up:
                left = list(self._running.values())
                # Marked: should it fail after all, the failure uses its attempt.
                outlived = [e for e in left if e.mark_outlived_drain()]
                self.abandoned = len(outlived)
                self.abandoned_completed = sum(
                    1 for e in outlived if e.completed_in_its_transaction
                )
                self.unsettled = len(left) - self.abandoned
        # Claimed but still queued for a worker thread: handed back, attempts refunded.
        self._hand_back_all(never_started, time.monotonic() + drain)
        if not process_lives_on and not self._thread.is_alive():
            self._hand_back_lost_claim(time.monotonic() + drain)
        if gave_up and process_lives_on and self.abandoned:
            logger.warning(
                "%s: %d handler(s) did not stop; they run on with their leases renewed until "
                "they return, beside the consumer that replaces this one",
                self.plan.name,
                self.abandoned,
            )
            threading.Thread(
                target=self._close_once_idle, name=f"{self._thread.name}-lingering", daemon=True
            ).start()
            return
        if gave_up:
            self._warn_of_left_behind()
        self._close()

    def left_running(self) -> tuple[int, int]:
        """Of the executions still here: (handlers running, handlers returned whose outcome is
        not recorded yet)."""
        with self._lock:
            returned = sum(1 for e in self._running.values() if e.handler_returned)
            return len(self._running) - returned, returned

    def slots_and_settles(self, now: float) -> tuple[int, bool, bool]:
        """For the consumer a re-plan started beside this one: (of its concurrency, the slots
        its executions still take (``takes_slot``); whether a settle of one of them holds
        claims back at ``now`` (_holds_a_late_settle); whether any execution is still here,
        its settle on its way if its handler returned)."""
        with self._lock:
            taken = sum(1 for e in self._running.values() if e.takes_slot)
            return taken, self._holds_a_late_settle(now), bool(self._running)

    def _holds_a_late_settle(self, now: float) -> bool:
        """Whether a handler that returned is having its outcome recorded past its lease, or
        within LATE_SETTLE_MARGIN_SECONDS of its end; called with the lock held."""
        if now < self._leases_checked_until:
            return False
        # The bound is reached: read every execution here (a renewal may have moved its lease
        # on since; a handler still running may return any moment, so it counts for the bound).
        late = False
        earliest = math.inf
        for execution in self._running.values():
            near = execution.lease_ends - LATE_SETTLE_MARGIN_SECONDS
            earliest = min(earliest, near)
            if now >= near and execution.handler_returned:
                late = True
        self._leases_checked_until = earliest
        return late

    @property
    def lingering(self) -> bool:
        """Whether handlers it gave up on still run (stopped with ``process_lives_on``)."""
        return self._stopping.is_set() and self.in_flight > 0

    def _close_once_idle(self) -> None:
        with self._lock:
            while self._running:
                # Timed: not every way out of _running notifies (a crash while starting one).
                self._lock.wait(1.0)
        self._close()

    def _close(self) -> None:
        self._completions.stop()
        self._background.shutdown()
        self._settles.shutdown()
        self.receiver.close()

    def _warn_of_left_behind(self) -> None:
        """Log what the drain gave up on: handlers still running, and handlers that returned
        but whose outcome is not recorded yet (its settle is still being retried on a database
        that does not answer). Told apart, because an operator told that handlers "did not
        stop" goes looking for one that ignores its abort signal. Executions that never started
        are not among them: stop() hands them back."""
        retried = self.abandoned - self.abandoned_completed
        if retried:
            logger.warning(
                "%s: %d handler(s) did not stop; their deliveries will be retried after lease "
                "expiry",
                self.plan.name,
                retried,
            )
        if self.abandoned_completed:
            # Told apart: their work committed, and an operator told it "will be retried"
            # would look for a second run that never comes (review helper-195).
            logger.warning(
                "%s: %d handler(s) that completed their delivery in their own transaction did "
                "not stop; their deliveries are not retried, and their partition keys stay held "
                "until their leases end",
                self.plan.name,
                self.abandoned_completed,
            )
        if self.unsettled:
            logger.warning(
                "%s: %d handler(s) returned but their outcome is not recorded yet (its settle "
                "has not returned, or is being retried on a database that does not answer); "
                "unless this process lives on until it is, lease expiry retries the delivery",
                self.plan.name,
                self.unsettled,
            )

    # -- the loop --------------------------------------------------------------------------

    def _run(self) -> None:
        """Run the claim loop; restart it with capped backoff whenever it fails, so a bug or
        an unexpected driver error never silently ends this subscription's consumer."""
        try:
            while not self._stopping.is_set():
                try:
                    self._loop()
                    return
                except Exception as exc:
                    delay = self._failed(f"{CLAIM_LOOP_FAILED}: {exc!r}")
                    logger.exception(
                        "%s: the claim loop failed; restarting it in %.1f s", self.plan.name, delay
                    )
                    self._stopping.wait(delay)
        finally:
            self.receiver.close()

    @property
    def retrying(self) -> bool:
        """Whether its last claim failed, but not yet several times in a row: the next one
        may well get past it."""
        return self.failure is not None and not self.failing

    @property
    def failing(self) -> bool:
        """Whether the claim loop has failed several times in a row just now (a missing
        grant, a database that stays away), not once (a dropped connection it gets past), or
        the database refuses to record outcomes (a grant taken away: no blip)."""
        return self._settles_refused or self._failures_in_a_row >= FAILURES_THAT_PERSIST

    def _failed(self, reason: str) -> float:
        """Record a failure (health shows it); return the backoff before the next try."""
        self._failures_in_a_row += 1
        self.failure = reason
        return restart_delay_seconds(self._failures_in_a_row)

    def _settle_refused(self, error: str | None) -> bool:
        """A settle was refused for want of a grant: claim nothing for a while (the backoff of
        a failed claim), and then only one delivery at a time, so that few handlers run for
        outcomes that cannot be recorded (each would run again at lease expiry, and at its last
        attempt be dead-lettered as LeaseExpired), until a settle goes through again. Called
        with the lock held; True for the first refusal of a spell (to be logged)."""
        now = time.monotonic()
        first = not self._settles_refused
        self._settles_refused = True
        self._refusal = f"{SETTLES_REFUSED}: {error}"
        if now >= self._claims_resume_at:  # handlers refused together count as one refusal
            self._claims_resume_at = now + self._failed(self._refusal)
        return first

    def _settles_recorded(self) -> None:
        with self._lock:
            if not self._settles_refused:
                return
            self._settles_refused = False
            self._claims_resume_at = 0.0
            self.failure = None
            self._failures_in_a_row = 0
        logger.info("%s: outcomes are recorded again; claiming as before", self.plan.name)
        self._wake.set()

    def _probe_settles(self) -> None:
        """Settles are refused and no delivery is left to probe them with (the refused ones
        wait out their leases, or were on their last attempt): ask the transport, so that
        health stops reading Error soon after the grant is given back, not at the next
        delivery a lease or a publish brings."""
        if self.failure != self._refusal:
            return  # the claim itself failed: its failure is what health says, and stays
        # A receiver from before the question (a third-party transport) is not asked.
        settles_go_through = getattr(self.receiver, "settles_go_through", None)
        if settles_go_through is None:
            return
        try:
            if not settles_go_through():
                return
        except WorkQueueError:
            return  # not known now: asked again after the next empty claim
        self._settles_recorded()

    def _recovered(self) -> None:
        # Under the lock: a worker's refused settle (_settle_refused) sets the same fields, and
        # cleared between its check and its writes it read as refused with no reason.
        with self._lock:
            if self._settles_refused:
                # Not over until a settle goes through (_settles_recorded). A claim that
                # failed meanwhile said why in the failure; claiming again, the refusal is
                # what holds the work back again (and what the settle probe answers to).
                self.failure = self._refusal
                return
            ended, self.failure = self.failure, None
            self._failures_in_a_row = 0
        if ended is not None:
            # Said as a recovery, the failure it ends after: quoted first, it read as an error.
            logger.info("%s: claiming again (it had stopped: %s)", self.plan.name, ended)

    def _loop(self) -> None:
        min_delay = self.config.idle_poll_min_ms / 1000
        max_delay = self.config.idle_poll_max_ms / 1000
        delay = min_delay
        gathered = False
        while not self._stopping.is_set():
            with self._lock:
                # Read with the room: a refusal pauses claims as its delivery stops counting
                # as running, under this lock (_finish).
                paused = self._claims_resume_at - time.monotonic()
                free, capacity = self._room()
                if self._settles_refused:
                    # One delivery, once the last one's outcome is known: a probe of whether
                    # settles go through again.
                    free = 0 if self._probes else min(free, 1)
                room = free
                busy = self._handlers_running > 0
            if paused > 0:
                self._wait(paused)  # settles refused (_settle_refused); a stop wakes it
                continue
            if 0 < free < capacity / 2 and busy and not gathered:
                # Little room and handlers are finishing: a moment's wait lets one claim fill
                # much of it instead of many claims filling a slot each (each claim is a round
                # trip and a commit).
                gathered = True
                self._wait_for_slots(math.ceil(capacity / 2), GATHER_SECONDS)
                continue
            gathered = False
            # Marked before the budget is taken, so a one-shot run never sees the budget spent
            # while the claim that spent it has not returned yet.
            self.receive_pending = True
            if self.budget is not None:
                free = self.budget.take(free)
            if free <= 0:
                self.receive_pending = False
                # Full (or the one-shot budget is spent): wait for a slot or a stop. Whatever
                # the last claim took, the next freed slot must wake the loop now; one freed
                # since the room was read still saw "drained" and woke nothing (reachable when
                # the room shrank after a short claim: a predecessor's handlers, a prefetch
                # window cut by slower handlers), so it is claimed for at once.
                with self._lock:
                    self._last_receive_drained = False
                    # While settles are refused the room is one probe at a time, whatever
                    # slots are free: a free slot is no reason to claim again.
                    probing = self._settles_refused and bool(self._probes)
                    freed_since = room <= 0 and not probing and self._room()[0] > 0
                if not freed_since:
                    self._wait(max_delay)
                continue
            if self.plan.rate_limited:
                tokens_asked_at = time.monotonic()
                try:
                    granted, full_in = self._take_rate_tokens(free, max_delay)
                except BaseException:
                    # Not a database error (those grant nothing): the loop restarts. As for a
                    # claim that raises (below), the budget taken for it was not spent (review
                    # helper-171: the run ended MaxDeliveries with nothing done).
                    self.receive_pending = False
                    if self.budget is not None:
                        self.budget.give_back(free)
                    raise
                if self.budget is not None:
                    self.budget.give_back(free - granted)
                if granted <= 0:
                    self.receive_pending = False
                    continue  # _take_rate_tokens waited for the next token (or a stop)
                free = granted
            try:
                self._claim_out = True  # until what it took is started or handed back
                if self._stopping.is_set():
                    # Asked after stop() read _claim_out (a rate-token call answered late):
                    # no claim now that stop() will not wait for (review helper-163).
                    if self.budget is not None:
                        self.budget.give_back(free)
                    break
                leased_at = time.monotonic()  # the leases run from no earlier than this
                try:
                    claimed = self._receive(free)
                except BaseException:
                    # Not a database error (those come back as an empty claim): the loop
                    # restarts. What this claim took from the one-shot budget was not spent; kept
                    # taken, the run would end as MaxDeliveries with nothing done.
                    if self.budget is not None:
                        self.budget.give_back(free)
                    raise
                unused = free - len(claimed.deliveries)
                self._last_receive_short = unused > 0
                self._last_receive_drained = claimed.drained
                if self.budget is not None:
                    self.budget.give_back(unused)
                if self.plan.rate_limited and unused:
                    self._return_rate_tokens(unused, time.monotonic() - tokens_asked_at, full_in)
                if self._stopping.is_set():
                    for delivery in claimed.deliveries:
                        lease_ends = self._lease_ends(delivery, leased_at)
                        self._release(delivery, self._hand_back_until(lease_ends))
                    break
                self._start_all(claimed.deliveries, leased_at)
            finally:
                # Only now: until the claimed deliveries count as running, a one-shot run must
                # not take "budget spent and nothing in flight" for done.
                self.receive_pending = False
                self._claim_out = False
            if claimed.deliveries:
                delay = min_delay
                if claimed.drained and self.budget is None:
                    # The subscription had no more to give: claiming again now would come back
                    # empty, a round trip for nothing that also holds up the worker threads
                    # taking over what this claim got. Wait for a reason (a publish's kick, a
                    # settle that frees a key or makes a retry claimable) or the shortest poll.
                    # A one-shot run claims again at once: an empty claim tells it it is done.
                    self._wait(min_delay)
                continue
            if self._settles_refused and not self._probes:
                self._probe_settles()
            # Empty: back off, unless a publish to the topic kicked us awake.
            delay = min_delay if self._wait(delay) else min(delay * 2, max_delay)

    def _take_rate_tokens(self, wanted: int, max_wait: float) -> tuple[int, float]:
        """Tokens for up to ``wanted`` claims from the subscription's shared bucket, and the
        seconds it would take to refill as the take left it; when none are left, wait until
        the next is due (at most ``max_wait``) and return no tokens."""
        try:
            granted, wait, full_in = self.receiver.take_rate_tokens(wanted)
        except WorkQueueError as exc:
            if self.failure is None:
                logger.warning(
                    "%s: not claiming until the database answers again: %s",
                    self.plan.name,
                    one_line(exc),
                )
            self._failed(f"{RATE_TOKENS_FAILED}: {one_line(exc)}")
            self._stopping.wait(max_wait)
            return 0, 0.0
        if self.failure is not None and self.failure.startswith(RATE_TOKENS_FAILED):
            # Answered: the failure is over, whether or not a token is due yet. Left to the
            # next claim, it lasted until a token was (up to 1/rate seconds of Error, and a
            # one-shot job reporting a subscription that could not run: audit helper-134).
            self._recovered()
        if not granted:
            # A publish's kick adds no token: only time does, so only a stop cuts this short.
            self._stopping.wait(min(max(wait, 0.001), max_wait))
        return granted, full_in

    def _return_rate_tokens(self, unused: int, held_seconds: float, full_in: float) -> None:
        try:
            self.receiver.return_rate_tokens(unused, held_seconds, full_in)
        except WorkQueueError:
            # Tokens not given back only slow this subscription below its limit for a moment;
            # the next take reports the database being away, if it still is.
            logger.debug("%s: could not return %d rate-limit tokens", self.plan.name, unused)

    def _wait_for_slots(self, wanted: int, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        with self._lock:
            self._slots_wanted = wanted
            try:
                while self._room()[0] < wanted:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or self._stopping.is_set():
                        return
                    self._lock.wait(remaining)
            finally:
                self._slots_wanted = 1

    def _room(self) -> tuple[int, int]:
        """(how many deliveries a claim may take now, the most it could take when all is
        free); called with the lock held. Past the free slots, room to claim ahead while the
        running handlers are quick, nobody counts the deliveries (a one-shot run works on
        what it claims, no more), no rate limit is taken at the claim and no delivery claimed
        ahead has had to go back since a slot last freed: ``prefetch`` at most,
        and no more than the slots get through in PREFETCH_WINDOW_SECONDS."""
        concurrency = self.config.concurrency
        now = time.monotonic()
        taken_elsewhere, late_elsewhere = (
            self._predecessors_hold(now) if self._predecessors else (0, False)
        )
        if late_elsewhere or self._holds_a_late_settle(now):
            # A handler returned past its lease (which keeps its slot), or near its end, has
            # its outcome still to be recorded: a claim meanwhile, for another free slot or
            # ahead, may take that delivery back (its lease may have run out in the database)
            # and run the finished work again (reviews helper-182, helper-186). Claims wait as
            # long as that settle takes.
            return 0, concurrency
        free = concurrency - self._handlers_running - taken_elsewhere
        handler_seconds = self._handler_seconds
        if (
            # Nothing ahead while a predecessor's handlers run: _start would run what this
            # claims on every slot it counts free of its own.
            taken_elsewhere
            or self.config.prefetch <= 0
            # A rate limit is taken at the claim: deliveries claimed ahead would keep piling
            # up while every slot hangs on a slow downstream, then all start at its recovery.
            or self.plan.rate_limited
            or self._slots_stalled
            or self.budget is not None
            or handler_seconds is None
            or handler_seconds >= PREFETCH_HANDLER_SECONDS
        ):
            ahead = 0
        else:
            ahead = self.config.prefetch
            window = concurrency * PREFETCH_WINDOW_SECONDS  # handler-seconds the slots give
            if handler_seconds * ahead > window:
                ahead = int(window / handler_seconds)
        return free + max(ahead - len(self._ready), 0), concurrency + ahead

    def _predecessors_hold(self, now: float) -> tuple[int, bool]:
        """(slots ``predecessors`` still take: handlers running, or a settle past the lease on
        its way, review helper-181; whether a settle of theirs holds claims back); called
        with the lock held (the order is always this consumer's lock, then a predecessor's)."""
        held = [(p, *p.slots_and_settles(now)) for p in self._predecessors]
        # A stopped consumer starts nothing more: one whose slots are all free and whose
        # settles are all made is done.
        self._predecessors = [p for p, taken, _, unsettled in held if taken or unsettled]
        return sum(taken for _, taken, _, _ in held), any(late for _, _, late, _ in held)

    def _predecessor_freed_a_slot(self) -> None:
        """A handler of a predecessor returned (its slot is this consumer's now), or a settle
        of one that held claims back was made."""
        with self._lock:
            self._lock.notify_all()  # the loop may be gathering room for one claim
        self._wake.set()

    def _wait(self, seconds: float) -> bool:
        """Sleep until woken (a kick, a freed slot, a stop) or ``seconds`` pass; True on a kick."""
        self._wake.wait(seconds)
        self._wake.clear()
        kicked, self._kicked = self._kicked, False
        return kicked

    def _receive(self, max_rows: int) -> ClaimResult:
        began = time.monotonic()
        try:
            result = self.receiver.receive(max_rows)
        except WorkQueueError as exc:
            # Expected while the database is away: no traceback, one log line per outage (on
            # one line: a session cut inside the procedure adds the server's CONTEXT, its SQL),
            # and the idle backoff paces the retries. Running handlers carry on (their settles
            # retry on their own); health says why nothing is claimed meanwhile.
            if self.failure is None:
                logger.warning(
                    "%s: not claiming until the database answers again: %s",
                    self.plan.name,
                    one_line(exc),
                )
            self._failed(f"{RECEIVE_FAILED}: {one_line(exc)}")
            result = ClaimResult([])
        else:
            claimed_in = time.monotonic() - began
            metrics.labelled(metrics.CLAIM_SECONDS, self.plan.name).observe(claimed_in)
            self._recovered()
        self.last_receive_empty = not result.deliveries
        if result.deliveries:
            self.received += len(result.deliveries)
            self.last_activity = time.monotonic()
        for expired in result.expired_dead_letters:
            report_lease_expired_dead_letter(
                Consumer,
                self.plan.name,
                expired.subscription_id,
                expired.delivery_id,
                expired.partition_key,
                expired.reason,
            )
        return result

    def _start_all(self, deliveries: list[ClaimedDelivery], leased_at: float) -> None:
        for index, delivery in enumerate(deliveries):
            try:
                self._start(delivery, leased_at)
            except BaseException:
                # Claimed but never started: hand them back rather than leave them to expiry.
                for unstarted in deliveries[index:]:
                    lease_ends = self._lease_ends(unstarted, leased_at)
                    self._release(unstarted, self._hand_back_until(lease_ends))
                raise

    def _start(self, delivery: ClaimedDelivery, leased_at: float) -> None:
        execution = DeliveryExecution(
            delivery,
            self.plan,
            self._services,
            on_handler_done=self._free_slot,
            leased_at=leased_at,
            on_cancelled_unstarted=self._hand_back_cancelled_ahead,
        )
        with self._lock:
            self._running[execution.key] = execution
            self._leases_checked_until = min(
                self._leases_checked_until, execution.lease_ends - LATE_SETTLE_MARGIN_SECONDS
            )
            if self._settles_refused:
                self._probes.add(execution.key)
            announced = self._recent_cancels.pop(delivery.delivery_id, None)
            cancelled = announced is not None and announced >= leased_at - RECENT_CANCEL_SECONDS
            ahead = execution.claimed_ahead = self._handlers_running >= self.config.concurrency
            if ahead:
                self._ready.append(execution)  # claimed ahead: starts when a slot frees
                if self._ready_check is None:
                    self._check_ready_when_late(self._ready[0])
            else:
                self._handlers_running += 1
        if cancelled:
            # Announced between the claim's commit and now: the renewal reports it and the
            # handler is signalled (one claimed ahead is not started if the answer comes
            # before its slot does, and stopped at once otherwise).
            execution.check_lease_soon()
        if not ahead:
            self._run_in_slot(execution)

    def _run_in_slot(self, execution: DeliveryExecution) -> None:
        """Hand ``execution``, which holds a slot, to a worker thread."""
        try:
            self._workers.run(self._execute, execution)
        except BaseException as exc:
            with self._lock:
                self._running.pop(execution.key, None)
                self._handlers_running -= 1
            if not isinstance(exc, RuntimeError):
                raise
            # The pool is shutting down: hand it back.
            self._release(execution.delivery, self._hand_back_until(execution.lease_ends))

    def _free_slot(self, handled_seconds: float) -> DeliveryExecution | None:
        """A handler returned (on its worker thread): its slot is passed on."""
        with self._lock:
            self._slots_stalled = False
            previous = self._handler_seconds
            self._handler_seconds = (
                handled_seconds
                if previous is None
                else previous + HANDLER_TIME_WEIGHT * (handled_seconds - previous)
            )
        return self._pass_slot_on()

    def _pass_slot_on(self) -> DeliveryExecution | None:
        """A slot is free (its handler returned, or the delivery it went to can no longer
        start): it goes to the next delivery claimed ahead, returned for this thread to run
        next (no hand-off to another thread), else back to the loop."""
        late: list[DeliveryExecution] = []
        with self._lock:
            following = None
            while self._ready and following is None and not self._stopping.is_set():
                candidate = self._ready.popleft()
                if candidate.lease_share_left() >= PREFETCH_MIN_LEASE_SHARE:
                    following = candidate
                else:
                    self._to_hand_back(candidate)
                    late.append(candidate)
            if following is None:
                self._handlers_running -= 1
            wanted = self._room()[0] >= self._slots_wanted
            if wanted:
                self._lock.notify_all()  # the loop may be gathering room for one claim
            # After a claim that took all there was the free slot has nothing to fill, unless
            # something was published since without waking the loop (no notifications).
            wanted = wanted and not (self._last_receive_drained and self.config.publishes_wake)
        for execution in late:
            # Waited so long for a slot that its lease is mostly gone: back to the queue,
            # attempt refunded, on a settle thread (this worker holds no connection).
            self._settles.run_or_call(self._hand_back, execution)
        if wanted:
            self._wake.set()
        if self._successors:  # only a consumer a re-plan stopped has any
            for successor in list(self._successors):
                successor._predecessor_freed_a_slot()
        return following

    def _execute(self, execution: DeliveryExecution) -> None:
        """Run ``execution`` on this worker thread, then each delivery its slot passes on."""
        current: DeliveryExecution | None = execution
        try:
            while current is not None:
                if self._too_late_to_start(current):
                    current = self._pass_slot_on()
                    continue
                if not self._take_for_this_thread(current):
                    return  # handed back unrun; nothing follows it in the slot
                self._execute_one(current)
                # Unlinked as the slot moves on: the first execution stays referenced (this
                # call's argument) for as long as the slot keeps passing on, and through the
                # links it kept every execution since, payloads and all, under steady load.
                following, current.next_in_slot = current.next_in_slot, None
                current = following
        finally:
            # Settles run on the batcher and the settle threads; a worker opens a queue
            # connection only when its handler renews the lease itself (context.heartbeat()),
            # or to settle after the settle pool stopped. Kept, every one of the 2 x
            # concurrency workers would come to hold one, idle, for the thread's life.
            self.receiver.close()

    def _too_late_to_start(self, execution: DeliveryExecution) -> bool:
        """Whether ``execution``, about to start on this worker, has used up its share of the
        lease meanwhile, and is handed back unrun (attempt refunded) instead.

        A delivery claimed ahead is given its slot when a handler returns, with enough lease
        left then, but starts only once that handler's settle has returned on this thread,
        which may take longer than the lease (a slow database, a settle retried through an
        outage); a host frozen between a claim and its start does the same. Started anyway,
        it ran on a lease another host may have taken back, two executions of one Exclusive
        key at once, until its first heartbeat a third of a lease later (audit helper-128).
        One claimed for a free slot waits for a worker thread, which may all be busy settling
        the same way: it is checked too (review helper-161)."""
        if not self._waited_too_long(execution):
            return False  # the usual answer, given without the lock
        with self._lock:
            if (
                self._running.get(execution.key) is not execution
                or execution.key in self._handing_back
                or self._stopping.is_set()
                or not self._waited_too_long(execution)
            ):
                # stop() or a cancel decides for it (_take_for_this_thread), or it starts
                return False
            self._to_hand_back(execution)
        self._settles.run_or_call(self._hand_back, execution)
        return True

    @staticmethod
    def _waited_too_long(execution: DeliveryExecution) -> bool:
        if execution.claimed_ahead:  # however it came by its slot (a cancel passes one on)
            return execution.lease_share_left() < PREFETCH_MIN_LEASE_SHARE
        waited = time.monotonic() - execution.received_at
        return (
            waited >= START_MAX_WAIT_SHARE * execution.lease_seconds
            or execution.lease_share_left() < START_MIN_LEASE_SHARE
        )

    def _take_for_this_thread(self, execution: DeliveryExecution) -> bool:
        """Mark ``execution`` started on this worker; once the consumer is stopping, hand it
        back unrun instead (attempt refunded), and say so.

        A delivery can reach a worker after stop() began: queued for the thread, or next in a
        slot whose previous delivery was still settling (on a database that does not answer,
        past the whole drain). stop() hands back what has not started, and the two decide
        under the consumer's lock, so no delivery starts after it was handed back, on a lease
        this host no longer holds while another host may run it."""
        with self._lock:
            if (
                self._running.get(execution.key) is not execution
                or execution.key in self._handing_back
            ):
                # stop() took it back, or a cancel did (_hand_back_cancelled_ahead), and hands
                # it back; a cancel passed its slot on too, so nothing follows it here.
                return False
            if not self._stopping.is_set():
                execution.started = True
                return True
        self._release_while_counted(execution)
        return False

    def _execute_one(self, execution: DeliveryExecution) -> None:
        try:
            execution.run_then(lambda result: self._finish(execution, result))
        except BaseException:
            logger.exception("%s: delivery execution crashed", self.plan.name)
            execution.stop_renewing()
            # A slot its handler's return kept for the settle would otherwise stay taken for
            # the consumer's life (review helper-181).
            execution.free_slot_held_for_settle()
            self._finish(
                execution, ExecutionResult(ExecutionResult.FAILED, error="execution crashed")
            )

    def _finish(self, execution: DeliveryExecution, result: ExecutionResult) -> None:
        """Account for an execution that ended (on its worker, or on the thread that settled
        its batched completion); once per execution."""
        with self._lock:
            if execution.key not in self._running:
                return  # accounted for already (it crashed after settling)
            # Before it stops counting as running: the loop, which claims one delivery at a
            # time while settles are refused, must not find none running and no pause yet.
            refusal_is_news = result.refused and self._settle_refused(result.error)
            del self._running[execution.key]
            self._probes.discard(execution.key)
            now = time.monotonic()
            # A settle that may have held claims back (_holds_a_late_settle: the bound on the
            # leases' ends was reached) has been made: they may resume. Not read from this
            # one's lease, which a renewal answered after the return may have moved on since.
            held_claims = now >= self._leases_checked_until
            if not self._running:
                self._leases_checked_until = math.inf
            self.finished += 1
            if result.kind == ExecutionResult.SETTLED and not result.released:
                self.processed += 1
            if self._stopping.is_set() or held_claims:
                # stop() waits for the running ones to end; the loop may be gathering room.
                self._lock.notify_all()
        self.last_activity = now
        if held_claims:
            self._wake.set()
            for successor in list(self._successors):
                successor._predecessor_freed_a_slot()
        # The settle may have made more claimable (a partition key freed, a retry due now):
        # worth a claim when the last one came back short, or one is on its way (it may have
        # looked before this settle committed). A full claim's loop waits for slots instead.
        # Read in the opposite order to the loop's writes (short, then no claim pending): read
        # the other way round, a claim ending between the two reads was missed by both.
        if (self.receive_pending or self._last_receive_short) and self._may_free_work(result):
            self._wake.set()
        if refusal_is_news:
            logger.warning(
                "%s: not claiming: the database refused to record a handler's outcome (%s); "
                "the delivery runs again once its lease expires. Claiming one delivery at a "
                "time, at most %.0f s apart, until an outcome is recorded again.",
                self.plan.name,
                result.error,
                RESTART_MAX_SECONDS,
                extra={"action": "settles_refused", "subscription": self.plan.name},
            )
        elif (
            result.kind == ExecutionResult.SETTLED
            and not result.released
            and not result.refused  # recorded, but its renewals were refused
            and self._settles_refused
        ):
            # A hand-back at shutdown says nothing of whether outcomes are recorded again.
            self._settles_recorded()
        metrics.labelled(metrics.DELIVERIES, self.plan.name, result.outcome_label).inc()
        if self._on_result is not None:
            self._on_result(result)

    def _may_free_work(self, result: ExecutionResult) -> bool:
        """Whether ``result`` can have made a delivery claimable: any settle of a partitioned
        subscription (its key is free again), otherwise one that left its delivery Pending (a
        retry, a hand-back) or whose outcome is unknown. A keyless delivery that ended
        (Completed, DeadLettered, Discarded) frees only its slot."""
        if self.plan.partition_mode != PartitionMode.NONE:
            return True
        return result.kind != ExecutionResult.SETTLED or result.status not in _ENDED

    def _check_ready_when_late(self, head: DeliveryExecution) -> None:
        """Set the timer for when ``head``, the delivery claimed ahead that has waited longest,
        will have used up its share of the lease; called with the lock held."""
        self._ready_check = self._services.timers.schedule(
            (head.lease_share_left() - PREFETCH_MIN_LEASE_SHARE) * head.lease_seconds,
            self._hand_back_the_late,
        )

    def _hand_back_the_late(self) -> None:
        """Deliveries claimed ahead that used up their share of the lease waiting for a slot
        (every slot held by a handler that runs on) go back now, attempts refunded. Looked at
        only when a slot freed, they stayed claimed while the slots stayed busy, their leases
        expired unrenewed, and each attempt was spent without a run (on a last attempt, a
        LeaseExpired dead letter). On the timer thread: the hand-backs' calls go elsewhere."""
        late: list[DeliveryExecution] = []
        with self._lock:
            self._ready_check = None
            while self._ready and self._ready[0].lease_share_left() < PREFETCH_MIN_LEASE_SHARE:
                execution = self._ready.popleft()
                self._to_hand_back(execution)
                late.append(execution)
            if late:
                self._slots_stalled = True
            if self._ready and not self._stopping.is_set():
                self._check_ready_when_late(self._ready[0])
        for execution in late:
            self._settles.run_or_call(self._hand_back, execution)

    def _hand_back_cancelled_ahead(self, execution: DeliveryExecution) -> None:
        """A delivery that has not started was found cancelled: it goes back now, which
        acknowledges the cancel (the release is refused), instead of holding its Exclusive or
        Ordered key from every other host until it would have started.

        One claimed ahead and waiting for a slot would wait until a slot frees or half its
        lease has passed (audit helper-128). One that holds a slot already (next in the slot
        of a handler that returned, or queued for a worker thread) would wait until it reached
        a worker: next in a slot, that is once the previous delivery's settle has returned on
        the same thread, up to its lease and a grace while the database answers slowly. Its
        slot passes on now (marked as going back under the lock the worker decides under, so
        the worker neither starts it nor passes the slot on a second time). Once the consumer
        is stopping, stop() hands back whatever has not started."""
        holds_slot = False
        with self._lock:
            if (
                self._running.get(execution.key) is not execution
                or execution.key in self._handing_back
            ):
                return  # gone already, or going back
            try:
                self._ready.remove(execution)
            except ValueError:
                if execution.started or self._stopping.is_set():
                    return  # it started (settling acknowledges the cancel), or stop() decides
                holds_slot = True
            self._to_hand_back(execution)
        if holds_slot:
            following = self._pass_slot_on()
            if following is not None:
                self._run_in_slot(following)
        self._settles.run_or_call(self._hand_back, execution)

    def _to_hand_back(self, execution: DeliveryExecution) -> None:
        """Mark ``execution``, which never started, as going back (``_hand_back`` next, unless
        stop() takes it first); called with the lock held."""
        self._handing_back.add(execution.key)
        self._late[execution.key] = execution

    def _hand_back(self, execution: DeliveryExecution) -> None:
        """Release a delivery claimed ahead that can no longer start in time, and wake the
        loop: it is claimable again, perhaps after the loop's last claim took all there was.
        Unless stop() took it back first."""
        with self._lock:
            if self._late.pop(execution.key, None) is None:
                return  # stop() took it back, and hands it back
        self._release_while_counted(execution)
        self._wake.set()

    def _release_while_counted(self, execution: DeliveryExecution) -> None:
        """Hand ``execution``'s delivery back, counted as running until the release returns,
        so that stop() waits for it: the process may end as soon as stop() returns. Should
        stop() give up first and release it too, the second release is refused by the lease
        token."""
        try:
            self._release(execution.delivery, self._hand_back_until(execution.lease_ends))
        finally:
            with self._lock:
                if self._running.get(execution.key) is execution:
                    del self._running[execution.key]
                    self._probes.discard(execution.key)
                self._handing_back.discard(execution.key)
                self._lock.notify_all()  # stop() may be waiting for the running ones to end

    def _lease_ends(self, delivery: ClaimedDelivery, leased_at: float) -> float:
        return leased_at + (delivery.lease_seconds or self.plan.lease_seconds)

    def _hand_back_all(self, executions: list[DeliveryExecution], until: float) -> None:
        """Hand back deliveries that never started; a failed hand-back is made again until
        ``until`` (a drain's end), or its lease's end if sooner. Once one has failed past it,
        the rest go to lease expiry: each call to a database that does not answer waits out
        its own timeout (about 30 s), and made one after another they held a stop far past
        its drain."""
        left = failed = 0
        answered = True
        for execution in executions:
            # Each is tried while the database answers, however short the drain (0 is
            # allowed): only once one has failed past the drain's end are the rest left.
            if not answered and time.monotonic() >= until:
                left += 1
            else:
                answered = self._release(execution.delivery, min(execution.lease_ends, until))
                failed += not answered
        # Counted for the stop's last line, which said "every handler finished or was handed
        # back" while these waited for lease expiry, their attempt spent without a run.
        self.not_handed_back += left + failed
        if left:
            logger.warning(
                "%s: the drain's time ran out before %d delivery(ies) that never started were "
                "handed back; they run again once their leases expire, which counts an attempt",
                self.plan.name,
                left,
            )

    def _hand_back_until(self, lease_ends: float) -> float:
        """Until when a failed hand-back is made again: the lease's end, or once stopping,
        the drain's."""
        return min(lease_ends, self._hand_backs_end)

    def _release(self, delivery: ClaimedDelivery, until: float) -> bool:
        """Hand back a delivery that never started, its attempt refunded; False when the call
        failed for good. A call that fails on a lost connection (or an unreachable
        transport) is made again, backing off, while the lease lasts (``until``: its end;
        while stopping, a drain's): left to lease expiry, the attempt would count as a run,
        and a last attempt be dead-lettered without ever running. Fenced by the lease token,
        so a release whose answer was lost is refused the second time, never applied
        twice."""
        delay = RETRY_MIN_SECONDS
        while True:
            try:
                if not self.receiver.release(delivery).settled and self.hears_cancels:
                    # Refused: the lease is gone, or the delivery was cancelled while it waited
                    # (wq_release leaves a cancelled one alone). Acknowledge the cancel now, as
                    # the handler's start would have, rather than leave the delivery (and, in
                    # an Exclusive or Ordered subscription, its key) to lease expiry. Fenced by
                    # the lease token and the cancel request, so it changes nothing otherwise.
                    self.receiver.acknowledge_cancel(delivery)
                return True
            except RETRYABLE_SETTLE_ERRORS as exc:
                if time.monotonic() + delay >= until:
                    self._release_failed(exc)
                    return False
                # Once at WARNING, then DEBUG, as a finished handler's settle retries.
                logger.log(
                    logging.WARNING if delay == RETRY_MIN_SECONDS else logging.DEBUG,
                    "%s: handing back a delivery that never started failed (%s); trying again "
                    "in %.1f s while its lease lasts",
                    self.plan.name,
                    one_line(exc),
                    delay,
                )
                time.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_SECONDS)
            except WorkQueueError as exc:
                self._release_failed(exc)
                return False

    def _hand_back_lost_claim(self, until: float) -> None:
        """At a shutdown, a claim whose answer was lost (it may have committed) has taken
        deliveries that nobody runs: the next claim would have taken them back, and a re-plan's
        consumer would have (carry_over_from), but none comes. Taken back now and handed back,
        attempts refunded, rather than left InFlight to lease expiry, each attempt spent unrun
        and a last one dead-lettered without running (review helper-171); counted among the
        claims left out when that fails or the drain ends first.

        One delivery a claim: a claim takes back what the lost one took before anything new,
        so only the last, which finds nothing left to take back, may claim one afresh (handed
        back at once too; review helper-172). The first hand-back that fails ends it: a
        database that does not answer would make each of them wait out its own timeout.

        A claim that finds nothing to take back may take a delivery whose handler returned and
        whose settle is still on its way past its lease (the drain gave up on it): handed back,
        its finished work would run again. So no claim is made while a settle holds claims
        back (as in _room); one still holding them at ``until`` leaves the lost claim counted."""
        while getattr(self.receiver, "owes_a_lost_claim", False) and time.monotonic() < until:
            if not self._late_settles_made_by(until):
                break
            try:
                retaken = self._receive(1).deliveries
            except Exception:
                # Not a database error (_receive answers those with an empty claim): whatever
                # it is, the stop goes on; a stop that raised left the consumer's threads and
                # connections open.
                logger.warning(
                    "%s: taking back what a claim whose answer was lost took failed",
                    self.plan.name,
                    exc_info=True,
                )
                break
            if not retaken:
                break  # the claim failed: still owed, and counted below
            if not all(self._release(delivery, until) for delivery in retaken):
                self.not_handed_back += 1
                break
        if getattr(self.receiver, "owes_a_lost_claim", False):
            self.claims_left_out += 1

    def _late_settles_made_by(self, until: float) -> bool:
        """Wait, at most until ``until``, for no settle here to hold claims back; whether none
        does."""
        with self._lock:
            while self._holds_a_late_settle(time.monotonic()):
                remaining = until - time.monotonic()
                if remaining <= 0:
                    return False
                # Timed: a settle's lease moving on (a renewal) notifies nobody.
                self._lock.wait(min(remaining, 0.1))
        return True

    def _release_failed(self, exc: WorkQueueError) -> None:
        logger.warning(
            "%s: handing back a delivery that never started failed: %s; its lease will expire "
            "and count the attempt",
            self.plan.name,
            exc,
        )

    def wait_idle(self, seconds: float) -> bool:
        """Wait at most ``seconds`` for every execution here to be settled or handed back;
        whether they were."""
        deadline = time.monotonic() + seconds
        with self._lock:
            while self._running:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._lock.wait(remaining)
        return True
