"""Running ONE claimed delivery: the handler call, heartbeats, the lease horizon, the time cap,
cancellation, and the settle call that records the outcome.

Abort reasons decide how the outcome is settled:
* Cancelled: when the handler returns, its outcome is dropped and the cancel is acknowledged
  (→ Discarded, key freed). Never before it returns: the acknowledgement frees an
  Exclusive/Ordered key, and the key's next delivery must not start beside a handler that is
  still running. So renewals go on until then (the database renews a cancelled lease and
  answers Cancelled): a handler that ignores the signal keeps the key until it returns, and
  only a host that stops renewing (killed, or cut off from the database) lets the lease run
  out, when lease expiry discards the row. Checked before LeaseLost: the acknowledgement is
  fenced by the lease token, so it succeeds exactly when nobody expired the row meanwhile,
  even if the local horizon has passed.
* LeaseLost (a heartbeat reported Lost, or the local lease horizon passed): the outcome is
  dropped and nothing is written; another consumer may already run the delivery.
* Shutdown: a Complete is still recorded; anything else releases the delivery without using up
  an attempt. The same holds once the consumer has announced that it is stopping
  (``context.stopping``, at the start of the drain): a handler that returns early because of it
  hands the delivery back for the next host instead of spending an attempt and a backoff.
  Not so for a handler the drain gave up on (``outlived_drain``: it ran on through both of the
  drain's waits, which a re-plan lets it do) that then raises: it had its attempt, and its
  failure is settled as usual, or a handler that ignores its signals and fails would escape
  ``max_attempts`` one settings edit at a time. One that returns an outcome (it heard the stop,
  late, and asks for a retry) still hands its delivery back.
* MaxProcessingSeconds: renewals stop; the eventual outcome is settled as usual (the fence
  rejects it if the lease ran out meanwhile).

A handler that completed its delivery inside its own transaction (``context.complete(enlist=
True)``, see ``workqueue.runtime.enlisted``) decides before all of these: once that transaction
has committed (or is still open when the handler returns, inside an outer one) the runtime
settles nothing, whatever the handler returned; if it rolled back, the rules above apply.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from django.db import DatabaseError, InterfaceError, connections

from workqueue import metrics, signals
from workqueue.driver import refuses_writes
from workqueue.driver.base import routed_to_django_connection
from workqueue.exceptions import (
    Cancelled,
    EnlistError,
    LeaseLost,
    PrivilegeRefusedError,
    SerializationFailureError,
    TransientDriverError,
    TransientTransportError,
    WorkQueueError,
    one_line,
)
from workqueue.input_limits import key_length, within_units
from workqueue.logtext import log_text, log_value
from workqueue.operators.display import error_summary
from workqueue.runtime.backoff import retry_delay_seconds
from workqueue.runtime.context import (
    AbortReason,
    AbortSignal,
    StopNotice,
    WorkContext,
    WorkMessage,
)
from workqueue.runtime.enlisted import EnlistedCompletion, cancel_requested, open_transaction
from workqueue.runtime.handlers import HandlerRegistry
from workqueue.runtime.outcome import FatalWorkError, Outcome, TransientWorkError
from workqueue.runtime.plan import SubscriptionPlan, heartbeat_interval_seconds
from workqueue.runtime.timers import Timer, TimerQueue
from workqueue.transports import TransportReceiver
from workqueue.types import ClaimedDelivery, DeliveryStatus, LeaseState, SettleResult

# One documented name for everything that happens to a delivery (README "Logging"): retries
# at WARNING, dead letters, lost leases and failed settles at ERROR, each with the delivery's
# facts in the text and as ``extra`` fields.
logger = logging.getLogger("workqueue.deliveries")

# Settles are retried this long past the lease: until a claim or the sweeper takes the
# delivery back, its holder's token still settles it, and nobody else can have run it.
LEASE_EXPIRY_GRACE_SECONDS = 5.0
MAX_REASON_LENGTH = 100
#: The longest error text a delivery keeps (the procedures cut there too): a handler that put a
#: response body in its exception wrote megabytes per attempt, which every dead-letter page
#: then read. A longer text keeps its start (where the traceback begins) and its end (which
#: names the exception).
MAX_ERROR_LENGTH = 16_000
_ERROR_HEAD_LENGTH = 4_000
_ERROR_MARKER_ROOM = 60
#: The least time between two checks for a cancel of one delivery, however often one is
#: announced (check_lease_soon).
CANCEL_CHECK_SECONDS = 1.0
# A settle or renewal that failed on a lost connection (or a deadlock) is tried again after
# 0.1 s, 0.2 s, 0.4 s ... at most 2 s, for as long as the lease can still be held.
RETRY_MIN_SECONDS = 0.1
RETRY_MAX_SECONDS = 2.0
#: The failures worth that: the database's transient ones, and a cloud transport's that could
#: not be reached, timed out, throttled or failed on its side (its receiver makes one attempt a
#: call, checking its lease first). A refusal (denied, missing) is not made again.
RETRYABLE_SETTLE_ERRORS = (TransientDriverError, TransientTransportError)
# How often the lease horizon looks again while a handler's open transaction holds the
# delivery's row (after context.complete(enlist=True)): nobody else can take the row until then.
HELD_ROW_RECHECK_SECONDS = 1.0

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ExecutionResult:
    """``Settled`` (with the delivery's new status), ``LeaseLost`` or ``Failed``."""

    kind: str
    status: str | None = None
    error: str | None = None
    #: Handed back unprocessed at shutdown (attempt refunded): not counted as processed.
    released: bool = False
    #: Failed because the database refused the settle for want of a grant: every settle of
    #: the subscription would be refused too, until the grant is given (back).
    refused: bool = False

    SETTLED = "Settled"
    LEASE_LOST = "LeaseLost"
    FAILED = "Failed"

    @property
    def outcome_label(self) -> str:
        """How metrics name this result (``workqueue_deliveries_total{outcome=...}``)."""
        if self.released:
            return "released"
        if self.kind == self.SETTLED:
            return _OUTCOME_BY_STATUS.get(self.status or "", "settled")
        return "lease_lost" if self.kind == self.LEASE_LOST else "settle_failed"


_OUTCOME_BY_STATUS = {
    DeliveryStatus.COMPLETED: "completed",
    DeliveryStatus.PENDING: "retried",
    DeliveryStatus.DEAD_LETTERED: "dead_lettered",
    DeliveryStatus.DISCARDED: "discarded",
}


@dataclass(frozen=True, slots=True)
class _Decision:
    kind: str
    reason: str | None = None
    delay_seconds: float | None = None
    error: str | None = None
    exception: BaseException | None = None  # what the handler raised, for the log's traceback


_worker_thread = threading.local()

#: A worker thread's ORM connection that Django checked (``CONN_HEALTH_CHECKS``) or opened less
#: than this long before a delivery starts counts as checked for that delivery too. Django
#: checks a kept connection once per request; a host's deliveries are its requests, and a
#: ``SELECT 1`` round trip before each one's first query was one of a Tasks API task's seven.
#: A connection that breaks within the window costs the next handler an attempt (retried, or
#: dead-lettered if it was the last), as without health checks; one idle for longer is checked
#: as Django would check it.
HEALTH_CHECK_REUSE_SECONDS = 1.0


class _WorkerConnections:
    """One worker thread's ORM connection wrappers, made once (Django's
    ``close_old_connections`` walks every alias through its context-local store on every call, a
    tenth of a no-op delivery's host time, while a thread's wrappers stay the same for its life),
    and when each connection was last known healthy."""

    __slots__ = ("delivery_began", "healthy_since", "watched", "wrappers")

    def __init__(self) -> None:
        self.wrappers = connections.all()
        self.healthy_since: dict[str, float] = {}
        self.delivery_began = 0.0
        self.watched: set[str] = set()  # checked or opened at first use in this delivery


def _worker_connections() -> _WorkerConnections:
    state = getattr(_worker_thread, "connections", None)
    if state is None:
        state = _worker_thread.connections = _WorkerConnections()
    return state


def ready_connections_of_this_thread() -> None:
    """Before a handler, as at a request's start: a connection known healthy within
    HEALTH_CHECK_REUSE_SECONDS needs no ping at the handler's first query; any other is checked
    (or opened) there as Django would, however it was left (a check after an error, or the ORM
    used on this thread between handlers, also ages)."""
    state = _worker_connections()
    now = state.delivery_began = time.monotonic()
    state.watched.clear()
    for wrapper in state.wrappers:
        healthy_since = state.healthy_since.get(wrapper.alias)
        if (
            wrapper.connection is not None
            and healthy_since is not None
            and now - healthy_since < HEALTH_CHECK_REUSE_SECONDS
        ):
            wrapper.health_check_done = True  # Django then sends no ping for it
        else:
            if wrapper.connection is not None:
                wrapper.health_check_done = False
            state.watched.add(wrapper.alias)


def close_old_connections_of_this_thread() -> None:
    """After a handler: ``django.db.close_old_connections`` for the calling worker thread, at a
    fraction of the cost (see _WorkerConnections). Connections are closed when broken or past
    CONN_MAX_AGE exactly as Django would close them. One the handler had checked or opened at
    its first query is remembered as healthy from the handler's start (no later than the check,
    so the window never runs past what was seen)."""
    state = _worker_connections()
    for wrapper in state.wrappers:
        alias = wrapper.alias
        if alias in state.watched and wrapper.connection is not None and wrapper.health_check_done:
            state.healthy_since[alias] = state.delivery_began
        if wrapper.errors_occurred and wrapper.connection is not None and refuses_writes(wrapper):
            # Opened while the server was read-only (a standby a failover left it on,
            # default_transaction_read_only): it stays so for its life, and Django's check
            # passes it, so the thread's handlers would fail until CONN_MAX_AGE closed it.
            wrapper.close()
        wrapper.close_if_unusable_or_obsolete()
        if wrapper.connection is None:
            state.healthy_since.pop(alias, None)
        elif wrapper.health_check_done:
            # Errors occurred in the handler and Django's own check just found it usable.
            state.healthy_since[alias] = time.monotonic()


@functools.cache
def _handler_logger(handler_key: str) -> logging.Logger:
    """The logger a handler's context logs to (cached: getLogger takes logging's module lock,
    which every worker thread would contend for on every delivery)."""
    return logging.getLogger(f"workqueue.handlers.{handler_key}")


@dataclass(slots=True)
class ExecutionServices:
    """What every execution of one consumer shares."""

    receiver: TransportReceiver
    complete: Callable[[ClaimedDelivery], SettleResult]
    timers: TimerQueue
    background: Any  # a WorkerPool: heartbeats
    handlers: HandlerRegistry
    user: Any
    lease_grace_seconds: float = LEASE_EXPIRY_GRACE_SECONDS
    #: Whether the transport has cancels (``supports_cancel``): only then can a refused settle
    #: be a cancel that landed after the last heartbeat, to acknowledge.
    cancels: bool = True
    #: Called before each handler: whether its ORM connections need Django's health check.
    ready_connections: Callable[[], None] = ready_connections_of_this_thread
    #: Called after each handler so the next gets fresh ORM connections, as at the end of a
    #: request. ``run_until_idle`` runs handlers inside a test's transaction and passes no-ops
    #: for both: closing that connection would end the test's transaction.
    refresh_connections: Callable[[], None] = close_old_connections_of_this_thread
    #: Set when the consumer begins to stop; every handler sees it as ``context.stopping``.
    stopping: StopNotice = field(default_factory=StopNotice)
    #: Queue a completion and be called back with its result or error, False if nothing was
    #: queued (``CompletionBatcher.complete_later``); None: ``run_then`` settles on its thread.
    complete_later: (
        Callable[[ClaimedDelivery, Callable[[SettleResult | Exception], None]], bool] | None
    ) = None
    #: Threads whose kept connections run the settles a handler's thread would otherwise make
    #: itself (a retry, a dead letter, a release, a cancel acknowledgement): a host's worker
    #: threads (2 x concurrency per subscription) then open no queue connection of their own,
    #: and a burst of failures costs a thread hand-off each, not a new connection each. None:
    #: settle on the calling thread (``run_until_idle``, whose thread holds the test's
    #: connection).
    settle_threads: Any = None  # a WorkerPool


class DeliveryExecution:
    """One attempt at one delivery, identified by (delivery id, lease token)."""

    def __init__(
        self,
        delivery: ClaimedDelivery,
        plan: SubscriptionPlan,
        services: ExecutionServices,
        on_handler_done: Callable[[float], DeliveryExecution | None] | None = None,
        leased_at: float | None = None,
        on_cancelled_unstarted: Callable[[DeliveryExecution], None] | None = None,
    ) -> None:
        self.delivery = delivery
        self.plan = plan
        self.services = services
        self._on_handler_done = on_handler_done
        #: Told when a renewal finds the delivery cancelled before its handler started.
        self._on_cancelled_unstarted = on_cancelled_unstarted
        self.started = False
        #: When the claim's answer came (time.monotonic()): how long it has waited to start.
        self.received_at = time.monotonic()
        #: Claimed beyond the free slots, to wait for one (set by the consumer).
        self.claimed_ahead = False
        #: What ``on_handler_done`` handed this execution's slot to: the next delivery to run
        #: on this thread, once this one's settling has been handed on.
        self.next_in_slot: DeliveryExecution | None = None
        # How long the handler ran, while its slot is held until its settle has been made.
        self._slot_held_for_settle: float | None = None
        # Whether on_handler_done has been told the slot is free (under the lock).
        self._slot_passed_on = False
        self.signal = AbortSignal(overdue=self._horizon_passed_untold)
        # Set by the consumer when its drain gave up on this handler (see the module's notes).
        self._outlived_drain = False
        self._lock = threading.Lock()
        self._finished = False  # the handler returned and settling began: renewals stop
        self._horizon: Timer | None = None
        self._handler_returned = False  # from then on no horizon is armed
        # Whether the database said the lease is gone (a renewal or an enlisted completion
        # refused), not only the local horizon, which fires when no renewal answered in time:
        # a renewal granted but answered after it holds the lease on, and the handler's
        # outcome is then settled, fenced by the token (review helper-161).
        self._lease_lost_in_database = False
        # When the handler was called (time.monotonic()): how long it has run, for health.
        self._handler_began: float | None = None
        # When the lease may end in the database, by the local clock: the moment the claim
        # (``leased_at``, before its call was sent), or the last renewal that held, was sent,
        # plus the lease. The database counts from later (its own now(), once the call
        # arrived), so from this moment on another consumer may take the delivery, and the
        # handler is told so then (the horizon); its settles are retried a grace longer.
        began = time.monotonic() if leased_at is None else leased_at
        # As long as the claim made it (the subscription's setting in the database then; this
        # host's plan may not have caught up with an edit yet), and every renewal is as long.
        self.lease_seconds = delivery.lease_seconds or plan.lease_seconds
        self._lease_ends = began + self.lease_seconds
        self._beat_retry_seconds = RETRY_MIN_SECONDS
        self._beat_failures = 0  # renewals failed in a row (logged once, as a settle's are)
        # Why the database refused a renewal for want of a grant, if it did: a lease then lost
        # is reported as a refused settle is (review helper-171), since every handler longer
        # than a third of a lease loses its outcome the same way until the grant is given.
        self._renewal_refused: str | None = None
        self._timers: list[Timer] = []
        self._beat_in_flight: Future[bool] | None = None
        # Checks for a cancel (check_lease_soon): whether one waits, and when the last began.
        self._cancel_check_waiting = False
        self._cancel_checked_at = float("-inf")
        # context.complete(enlist=True): the completion run in the handler's transaction, and
        # whether one is being run right now (no renewal may start meanwhile).
        self._enlisted: EnlistedCompletion | None = None
        self._held_reported_until = 0.0  # monotonic: when to say again that it is held
        self._enlisting = False
        # A key hold (wq_complete_holding_key) the database says has ended: renewed no more.
        self._hold_ended = False
        # When the completion that holds the key was called (monotonic): the hold's start.
        self._hold_called_at = 0.0
        # Whether the automatic renewals' timer chain has ended (renewals stopped).
        self._ticks_stopped = False
        # A settle call failed on a lost connection, so it may have committed unanswered: a
        # completion sent again is then refused as already done, which is no lost lease.
        self._answer_lost = False
        # Whether the handler's class logs its failures' tracebacks itself (the Tasks API's):
        # its dead letters are then logged without one, so a failure is not reported twice.
        self._handler_logs_failures = False
        self.log = logging.LoggerAdapter(
            logger,
            {
                "subscription": plan.name,
                "message_id": delivery.message_id,
                "delivery_id": delivery.delivery_id,
                "attempt": delivery.attempt,
                "max_attempts": plan.max_attempts,
                "partition_key": delivery.partition_key,
            },
        )
        # Every line names the delivery, so a plain-text log is enough to find it again.
        # The message id too: it is what a publisher holds (a Tasks API task's result id).
        # The key is the publisher's, and a cloud queue's message carries its ids in its body:
        # escaped, so that a newline in them cannot forge a line (review helper-142).
        self._where = (
            f"subscription={plan.name} delivery={log_value(delivery.delivery_id)} "
            f"attempt={delivery.attempt}/{plan.max_attempts} "
            f"key={log_value(delivery.partition_key)} message={log_value(delivery.message_id)}"
        )

    @property
    def key(self) -> tuple[str, str]:
        return (self.delivery.delivery_id, self.delivery.lease_token)

    @property
    def handler_returned(self) -> bool:
        """Whether the handler has returned (or raised): what is left is recording its outcome."""
        with self._lock:
            return self._handler_returned

    @property
    def takes_slot(self) -> bool:
        """Whether it takes one of its subscription's slots: until its handler has returned
        and its slot has been passed on (which a handler returned past its lease does only
        once its settle has been made)."""
        with self._lock:
            return not self._slot_passed_on

    def handler_running_since(self) -> float | None:
        """When (``time.monotonic()``) the handler was called, while it runs; None before it
        is called and once it has returned."""
        with self._lock:
            return None if self._handler_returned else self._handler_began

    # -- running ---------------------------------------------------------------------------

    def run(self) -> ExecutionResult:
        """Run the handler and settle its outcome; return how the attempt ended."""
        decision = self._run_handler()
        try:
            return self._settle(decision)
        finally:
            self.free_slot_held_for_settle()

    def run_then(self, finish: Callable[[ExecutionResult], None]) -> None:
        """Run the handler and settle its outcome, then call ``finish`` with how it ended.

        A plain completion goes to ``services.complete_later`` when there is one, so this
        thread is free as soon as the handler returns: ``finish`` is then called on the
        batcher's thread once the batch has settled, or on a settle thread when the
        batch's answer needs the ordinary settle path (the completion was refused: a cancel to
        acknowledge or a lost lease; or the batch failed: retried while the lease lasts).
        """
        decision = self._run_handler()
        complete_later = self.services.complete_later
        if complete_later is None or not self._plain_completion(decision):
            try:
                result = self._settle(decision)
            finally:
                self.free_slot_held_for_settle()
            finish(result)
            return
        self._finished = True  # the handler returned: no renewal starts after this

        def settle_alone() -> None:
            try:
                result = self._settle(decision)
            except Exception:
                # On a settle thread nobody else would call finish: the execution would
                # stay counted as running, and the drain would wait for it in vain.
                self.log.exception("Settling the delivery crashed (%s)", self._where)
                result = ExecutionResult(ExecutionResult.FAILED, error="settle crashed")
            finish(result)

        def settled(outcome: SettleResult | Exception) -> None:
            if isinstance(outcome, SettleResult) and outcome.settled:
                self._log_completed()
                finish(ExecutionResult(ExecutionResult.SETTLED, outcome.status))
                return
            if isinstance(outcome, Exception):
                self._answer_lost = True  # the batch may have committed before it failed
            (self.services.settle_threads or self.services.background).run_or_call(settle_alone)

        if not complete_later(self.delivery, settled):
            settle_alone()

    def _log_completed(self) -> None:
        # DEBUG: a line per delivery is too many for INFO on a busy host, and with none at any
        # level an operator could not follow one delivery through.
        self.log.debug("Delivery completed (%s)", self._where)

    def _plain_completion(self, decision: _Decision) -> bool:
        """Whether settling ``decision`` is one fenced completion and nothing else (on the
        batcher's thread, so never one whose slot waits for its settle)."""
        return (
            decision.kind == Outcome.COMPLETE
            and self._slot_held_for_settle is None
            and self._enlisted is None
            and not self.signal.has(AbortReason.CANCELLED)
            and not self.signal.has(AbortReason.LEASE_LOST)
        )

    def _run_handler(self) -> _Decision:
        self.started = True
        # With automatic heartbeats the first tick arms the horizon: it comes well before it
        # (at most a third of the lease, and half of what is left), and most handlers end
        # before either, so a delivery costs the timer thread one timer, not two.
        if self.plan.heartbeat_mode != "Auto" or not self._schedule_auto_heartbeat():
            self._arm_horizon()
        if self.plan.max_processing_seconds:
            self._keep_timer(
                self.services.timers.schedule(
                    self.plan.max_processing_seconds,
                    lambda: self.signal.abort(AbortReason.MAX_PROCESSING_SECONDS),
                )
            )
        began = self._handler_began = time.monotonic()
        try:
            if self.signal.has(AbortReason.CANCELLED):
                # Cancelled while it waited for a slot (claimed ahead, or queued for a worker):
                # the handler never starts, and settling acknowledges the cancel.
                decision = _Decision(Outcome.COMPLETE)
            else:
                decision = self._call_handler()
        finally:
            self._mark_returned()  # the handler's own finally did, unless it never ran
            now = time.monotonic()
            handled_in = now - began  # with the connections' refresh: the slot's time
            metrics.labelled(metrics.HANDLER_SECONDS, self.plan.name).observe(handled_in)
            pass_on = False
            with self._lock:
                horizon = self._horizon
                if self._slot_held_for_settle is None and not self._slot_passed_on:
                    # Asked again: the lease may have run out while the connections were
                    # refreshed after a return just before it (review helper-184).
                    if self._keeps_slot(now):
                        self._slot_held_for_settle = handled_in
                    elif self._on_handler_done is not None:
                        pass_on = self._slot_passed_on = True
            for timer in [*self._timers, horizon]:
                if timer is not None:
                    timer.cancel()
            if pass_on and self._on_handler_done is not None:
                # The handler's slot is free now; settling goes on without holding it.
                self.next_in_slot = self._on_handler_done(handled_in)
        return decision

    def _keeps_slot(self, now: float) -> bool:
        """Whether the handler's slot is kept for its settle, its handler returned at ``now``
        or its slot about to be passed on then (see _mark_returned); with the lock held."""
        return (
            self._on_handler_done is not None
            and not self._lease_lost_in_database
            and (now >= self._lease_ends or self.signal.has(AbortReason.LEASE_LOST))
        )

    def _mark_returned(self) -> None:
        """Record that the handler returned (once), and whether its slot is kept for its
        settle. Past its local horizon, told or not (a horizon the timer has not reached, a
        transaction that held the row and rolled back: review helper-181), the lease may hold
        until a claim takes the delivery back: this consumer's own did so before the settle
        could record the outcome, and ran the finished work again (helper-180). The slot
        stays taken until the settle has been made (free_slot_held_for_settle), which is
        never a batched completion's. Decided at the return, before the connections are
        refreshed (which can take long); asked again as the slot would be passed on after it
        (_run_handler: a refresh that ran past the lease, helper-184). Whether it keeps its
        slot or not, the consumer claims nothing while the settle of a returned handler, from
        the return on, nears or passes the lease's end (Consumer._holds_a_late_settle; reviews
        helper-182, helper-186, helper-187)."""
        with self._lock:
            if self._handler_returned:
                return
            self._handler_returned = True
            returned_at = time.monotonic()
            if self._keeps_slot(returned_at):
                self._slot_held_for_settle = returned_at - (self._handler_began or returned_at)

    def free_slot_held_for_settle(self) -> None:
        """Pass on the slot the handler's return kept for its settle, if it kept one; the
        consumer calls it too when the execution crashed after its handler returned."""
        with self._lock:
            handled_in, self._slot_held_for_settle = self._slot_held_for_settle, None
            if handled_in is not None:
                self._slot_passed_on = True
        if handled_in is not None and self._on_handler_done is not None:
            self.next_in_slot = self._on_handler_done(handled_in)

    def abort(self, reason: str) -> None:
        self.signal.abort(reason)

    @property
    def completed_in_its_transaction(self) -> bool:
        """Whether the handler completed its delivery in its own transaction, committed: it
        runs on with nothing to retry (a key hold, if any, ends with its lease)."""
        return self._completed_in_transaction()

    def mark_outlived_drain(self) -> bool:
        """Mark that the consumer's drain gave up on this handler, unless it has returned; in
        one hold of the lock that its return is recorded under, so that its settle sees the
        mark exactly when the handler returned after it. Whether it was marked."""
        with self._lock:
            if self._handler_returned:
                return False
            self._outlived_drain = True
            return True

    def stop_renewing(self) -> None:
        """Renew the lease no more (the execution crashed): the row is lease expiry's."""
        self._finished = True

    def _call_handler(self) -> _Decision:
        handler_class = self.services.handlers.get(self.plan.handler_key)
        if handler_class is None:
            return _Decision(Outcome.DEAD_LETTER, reason="HandlerNotRegistered")
        self._handler_logs_failures = handler_class.logs_failures
        try:
            payload = self.delivery.decoded_payload()
        except ValueError as exc:
            # Stored JSON this Python cannot read (a number of more digits than
            # sys.get_int_max_str_digits(), written by a caller of wq_publish itself): no
            # attempt would read it, so it is a dead letter now, not a crash each attempt and a
            # LeaseExpired at the last (review helper-178).
            return _Decision(
                Outcome.DEAD_LETTER,
                reason="InvalidPayload",
                error=f"The stored payload cannot be decoded: {one_line(exc)}",
            )
        message = WorkMessage(
            message_id=self.delivery.message_id,
            topic=self.plan.topic_name,
            payload=payload,
            payload_ref=self.delivery.payload_ref,
            partition_key=self.delivery.partition_key,
            attributes=self.delivery.attributes,
            correlation_id=self.delivery.correlation_id,
            published_at=self.delivery.published_at,
        )
        context = WorkContext(
            subscription_name=self.plan.name,
            delivery_id=self.delivery.delivery_id,
            attempt=self.delivery.attempt,
            max_attempts=self.plan.max_attempts,
            is_replay=self.delivery.is_replay,
            worker_id=self.services.receiver.lease_owner,
            signal=self.signal,
            stopping=self.services.stopping,
            logger=logging.LoggerAdapter(_handler_logger(self.plan.handler_key), self.log.extra),
            _heartbeat=self._beat,
            _complete=self._complete_in_transaction,
        )
        self.services.ready_connections()
        try:
            outcome = handler_class(self.services.user).handle(message, context)
        except FatalWorkError as exc:
            return _Decision(
                Outcome.DEAD_LETTER,
                reason=_short(_storable(str(exc))),
                error=describe_error(exc),
                exception=exc,
            )
        except TransientWorkError as exc:
            return _Decision(
                Outcome.RETRY,
                delay_seconds=exc.retry_after_seconds,
                error=describe_error(exc),
                exception=exc,
            )
        except BaseException as exc:
            if (
                isinstance(exc, KeyboardInterrupt)
                and threading.current_thread() is threading.main_thread()
            ):
                raise  # Ctrl-C during run_until_idle (a test): the test run stops
            # SystemExit too (sys.exit(), a command-line parser called inside a handler),
            # asyncio's CancelledError, and a KeyboardInterrupt a handler or a library raised on
            # a worker thread: there any of them would only end the thread, leaving its slot
            # taken and the delivery leased and renewed for the process's life.
            return _Decision(Outcome.RETRY, error=describe_error(exc), exception=exc)
        finally:
            # Before the connections are refreshed, which can hang on a database that does not
            # answer (a broken connection is pinged first): a host stopped meanwhile counts
            # this handler as returned, not as one that did not stop, and a consumer counts
            # its slot as the return left it (helper-182).
            self._mark_returned()
            # What the handler used of the ORM is closed if broken or past CONN_MAX_AGE, as at
            # the end of a request; the next handler on this thread then checks the connection
            # at its first query (CONN_HEALTH_CHECKS) unless it was checked within
            # HEALTH_CHECK_REUSE_SECONDS (ready_connections). Between two handlers nothing
            # else uses these connections.
            self.services.refresh_connections()
        if not isinstance(outcome, Outcome) or outcome.kind not in {
            Outcome.COMPLETE,
            Outcome.RETRY,
            Outcome.DEAD_LETTER,
        }:
            return _Decision(Outcome.RETRY, error=_not_an_outcome(outcome))
        # A handler's own dead letter keeps last_error as it was; a retry records its reason.
        error = outcome.reason if outcome.kind == Outcome.RETRY else None
        reason = outcome.reason
        if outcome.kind == Outcome.DEAD_LETTER and reason is not None:
            reason = _cut_reason(reason)
        return _Decision(
            outcome.kind,
            _storable(reason),
            outcome.delay_seconds,
            None if error is None else _error_text(error),
        )

    # -- heartbeats and timers -------------------------------------------------------------

    def _settle_deadline(self) -> float:
        """Until when a settle is worth retrying: the lease and a grace."""
        return self._lease_ends + self.services.lease_grace_seconds

    @property
    def lease_ends(self) -> float:
        """When the lease may end in the database, by the local clock (monotonic)."""
        return self._lease_ends

    def lease_share_left(self) -> float:
        """The share of the lease not used up yet by the local clock (1.0 just claimed or
        renewed, 0 or less once the database may have taken the delivery back)."""
        return (self._lease_ends - time.monotonic()) / self.lease_seconds

    def _arm_horizon(self) -> None:
        # The local horizon aborts the handler even when a renewal call hangs: past it the
        # lease may have expired in the database and another consumer may own the delivery.
        # A failed renewal does not move it, so one lost heartbeat aborts nothing by itself.
        deadline = self._lease_ends
        timer = self.services.timers.schedule(
            deadline - time.monotonic(), lambda: self._horizon_reached(deadline)
        )
        with self._lock:
            previous, self._horizon = self._horizon, timer
            returned = self._handler_returned
        if previous is not None:
            previous.cancel()
        if returned:
            # A renewal or the first tick that raced the handler's return: nothing to watch.
            timer.cancel()

    def _horizon_reached(self, deadline: float) -> None:
        if self._finished:
            return  # settling already
        if self._lease_ends > deadline:
            # Renewed since. That renewal's horizon may be gone: the first tick's, armed at
            # the same time on the timer thread, can be swapped in after it and cancel it.
            # Watch the renewed lease from here (at worst, a horizon replaced by its equal).
            self._arm_horizon()
            return
        if self._holds_row_in_transaction():
            # The handler's open transaction holds the row, so nobody can take the delivery
            # over yet; whether the lease is lost depends on how that transaction ends.
            self._report_held_past_lease()
            self._keep_timer(
                self.services.timers.schedule(
                    HELD_ROW_RECHECK_SECONDS, lambda: self._horizon_reached(deadline)
                )
            )
            return
        if self._completed_in_transaction():
            if self._holds_key_after_commit():
                self._hold_ran_out()
            return
        self.signal.abort(AbortReason.LEASE_LOST)

    def _hold_ran_out(self, *, in_database: bool = False) -> None:
        """The key hold ran out unrenewed under the handler that runs on: the key's next
        delivery may start beside it. It is told, as a handler whose lease ran out is (review
        helper-196), its heartbeat answers False from now on, nothing renews the lapsed hold,
        and the operator hears of it once (review helper-197), with what ended it
        (``in_database``: a renewal answered that the hold is gone)."""
        # No lock: its callers include a handler reading its signal. At worst two callers at
        # once both log.
        if self._hold_ended:
            return
        self._hold_ended = True
        self.signal.abort(AbortReason.LEASE_LOST)
        if in_database:
            why = "a renewal found the hold gone (it lapsed before the renewal, or was cleared)"
        elif self.signal.has(AbortReason.MAX_PROCESSING_SECONDS):
            why = "the subscription's max_processing_seconds stopped its renewals"
        else:
            why = "renewals failed for a lease"
        self.log.error(
            "The partition key held for a handler that completed in its own transaction ran "
            "out while the handler still ran (%s): %s; the key's next delivery may run beside it",
            self._where,
            why,
        )

    def _horizon_passed_untold(self) -> None:
        """The handler reads its signal: a horizon that passed while this process was frozen
        (SIGSTOP, a paused VM, a long GC pause) is told now, not when the timer thread gets to
        it: resumed, a handler's ``signal.wait(3)`` timed out first, and it went on with its
        work beside the host that had claimed its delivery meanwhile (attack review helper-180).
        The horizon's own rules, but for the wait it schedules while the handler's open
        transaction holds the row (the timer keeps that watch)."""
        if (
            self._finished
            or not self.started
            or time.monotonic() < self._lease_ends
            or self._holds_row_in_transaction()
        ):
            return
        if self._completed_in_transaction():
            if self._holds_key_after_commit():
                self._hold_ran_out()
            return
        self.signal.abort(AbortReason.LEASE_LOST)

    def _report_held_past_lease(self) -> None:
        """Say, once a lease's length, that the handler's open transaction holds the delivery
        past its lease: a handler stuck there holds it, and its key, for as long as that
        transaction stays open, and nothing else would say so."""
        now = time.monotonic()
        if now < self._held_reported_until:
            return
        self._held_reported_until = now + self.lease_seconds
        self.log.warning(
            "The handler's open transaction has held its completion %.0f s past its lease "
            "(%s): nothing can take the delivery (or its key's next one) over until that "
            "transaction ends; a handler stuck there ends only with its database session "
            "(PostgreSQL's idle_in_transaction_session_timeout ends an idle one)",
            now - self._lease_ends,
            self._where,
        )

    def _keep_timer(self, timer: Timer) -> None:
        """Keep ``timer`` to cancel when the handler returns. Those that fired or were cancelled
        go: a long handler's heartbeats added one a tick, for the handler's life."""
        with self._lock:
            if self._timers:  # most deliveries end before their first timer fires
                self._timers = [kept for kept in self._timers if not kept.cancelled]
            self._timers.append(timer)

    def _schedule_auto_heartbeat(self) -> bool:
        """Schedule the next automatic renewal, within half of what is left of the lease: a
        delivery can start with little of it left (claimed ahead, or its claim answered late:
        review helper-171), and a renewal answered late leaves little of the lease it granted
        (helper-177). Never sooner than an eighth of the interval: renewals failing through an
        outage, the lease left shrinking, would otherwise come ever faster until the horizon.
        False when renewals have stopped."""
        with self._lock:
            # Decided and recorded in one step: a completion's commit that looks in between
            # (``_renew_after_commit``) must see the renewals stopped to restart them.
            self._ticks_stopped = self._stopped_renewing()
            if self._ticks_stopped:
                return False
        interval = heartbeat_interval_seconds(self.lease_seconds)
        left = self._lease_ends - time.monotonic()
        delay = min(interval, max(left / 2, interval / 8))
        self._keep_timer(self.services.timers.schedule(delay, self._auto_heartbeat_tick))
        return True

    def _auto_heartbeat_tick(self) -> None:
        if self._horizon is None:
            self._arm_horizon()
        with self._lock:
            # Decided and recorded in one step, as in _schedule_auto_heartbeat.
            stopped = self._stopped_renewing()
            pending = self._beat_in_flight if stopped else None
            if stopped and pending is None:
                self._ticks_stopped = True
        if pending is not None:
            # Another renewal is on its way (a cancel check's, a retry's): granted late, it
            # holds the lease on, and the ticks must go on from its answer (review
            # helper-178); _schedule_auto_heartbeat decides again then.
            pending.add_done_callback(lambda _: self._schedule_auto_heartbeat())
        if stopped:
            return
        future = self.services.background.submit(self._beat, None)
        future.add_done_callback(lambda _: self._schedule_auto_heartbeat())

    def check_lease_soon(self) -> None:
        """Look for an operator's cancel on a background thread (one was announced, or
        announcements may have been missed), unless the cancel is known already.

        Announcements come from anyone who may connect, so they buy nothing by themselves:
        the check is a read that renews nothing (a Manual handler that stopped beating loses
        its lease whatever is announced), only a cancel it finds is confirmed by a renewal
        (which signals the handler), and one delivery has at most one check waiting, made at
        most once every CANCEL_CHECK_SECONDS: a burst naming it took the background threads
        that carry every other delivery's heartbeats, and their handlers were told LeaseLost
        (audit helper-128)."""
        if self.signal.has(AbortReason.CANCELLED) or self._stopped_renewing():
            return
        with self._lock:
            if self._cancel_check_waiting:
                return
            self._cancel_check_waiting = True
            wait = self._cancel_checked_at + CANCEL_CHECK_SECONDS - time.monotonic()
        if wait > 0:
            self._keep_timer(self.services.timers.schedule(wait, self._submit_cancel_check))
        else:
            self._submit_cancel_check()

    def _submit_cancel_check(self) -> None:
        try:
            self.services.background.submit(self._check_for_cancel)
        except RuntimeError:
            # The consumer's pool has shut down (a stop that gave up on this handler): nothing
            # is left to check for, and the caller (the listener's thread) must not fail.
            with self._lock:
                self._cancel_check_waiting = False

    def _check_for_cancel(self) -> None:
        with self._lock:
            self._cancel_check_waiting = False
            self._cancel_checked_at = time.monotonic()
        if self.signal.has(AbortReason.CANCELLED) or self._stopped_renewing():
            return
        read = getattr(self.services.receiver, "cancel_requested", None)
        try:
            asked = read is None or read(self.delivery)
        except Exception:
            asked = True  # the read failed: the renewal finds out, as it did before the read
        if asked and self._beat(None) and not self.signal.has(AbortReason.CANCELLED):
            # Joined a renewal sent before the cancel was asked (its answer: Held): once more.
            self._beat(None)

    def _renew_soon(self) -> None:
        if not self._stopped_renewing():
            self.services.background.submit(self._beat, None)

    def _database_took_the_lease(self) -> bool:
        """Whether the database said the lease is gone, once a renewal on its way has been
        answered (waited for here, a grace at most). A lease only past its local horizon may
        still hold: until a claim or the sweeper takes the delivery back nobody else can have
        run it, and the settle, fenced by the token, records the outcome or is refused. An
        outcome was dropped unasked after every outage longer than the lease, and a Manual
        handler's that overran, then run again or dead-lettered LeaseExpired (attack review
        helper-180)."""
        if not self._lease_lost_in_database:
            with self._lock:
                renewal = self._beat_in_flight
            if renewal is not None:
                with contextlib.suppress(FutureTimeout):
                    renewal.result(timeout=self.services.lease_grace_seconds)
        return self._lease_lost_in_database

    def _stopped_renewing(self) -> bool:
        if self._finished:
            return True
        if self._completed_in_transaction():
            # Completed in the handler's transaction: renewed on only while the completion
            # holds the delivery's partition key for the handler that runs on, whatever a
            # horizon said before the completion was accepted (review helper-195), until the
            # cap stops it as it stops any run or the database says the hold has ended.
            return (
                not self._holds_key_after_commit()
                or self._hold_ended
                or self.signal.has(AbortReason.MAX_PROCESSING_SECONDS)
            )
        return (
            self.signal.has(AbortReason.LEASE_LOST) and self._lease_ran_out()
        ) or self.signal.has(AbortReason.MAX_PROCESSING_SECONDS)

    def _lease_ran_out(self) -> bool:
        """Whether renewing is over: the database said the lease is gone, or it has run out by
        the local clock. A handler the horizon told LeaseLost can hold its lease after all (a
        renewal granted before the horizon, answered after it, moved ``_lease_ends`` on):
        renewals go on then, or the lease would run out while a handler that does not stop
        still runs, and another consumer would run the delivery beside it (review
        helper-177). The signal stays: the handler was told, and may have stopped."""
        return self._lease_lost_in_database or time.monotonic() >= self._lease_ends

    def _beat(self, progress: Mapping[str, Any] | None) -> bool:
        """Renew the lease; concurrent calls share one database call (the first progress wins)."""
        if self._stopped_renewing():
            # A delivery completed in the handler's transaction is no lease lost: a Manual
            # handler told False would stop its tail (review helper-195), though nothing went
            # wrong; a hold that has ended, or the time cap, still says stop.
            return (
                self._completed_in_transaction()
                and not self._hold_ended
                and not self.signal.has(AbortReason.MAX_PROCESSING_SECONDS)
            )
        with self._lock:
            if self._holds_row_in_transaction():
                # The handler's transaction holds the row (and with it the delivery) until it
                # ends; a renewal on our own connection would wait for it.
                return True
            shared = self._beat_in_flight
            if shared is None:
                shared = self._beat_in_flight = Future()
                owner = True
            else:
                owner = False
        if not owner:
            return shared.result()
        held = True
        began = time.monotonic()
        try:
            extension = self.services.receiver.extend_lease(
                self.delivery, _progress(progress) if progress else None
            )
            # A Cancelled answer renews too, and says so with its expiry; the previous
            # release's procedure answered it without renewing, and with no expiry.
            if extension.state == LeaseState.HELD or extension.lease_expires_at is not None:
                granted = extension.granted_seconds
                self._lease_ends = began + (self.lease_seconds if granted is None else granted)
                self._beat_retry_seconds = RETRY_MIN_SECONDS
                self._renewal_refused = None  # granted again: a later loss is no refusal
                self._arm_horizon()
            if self._beat_failures:
                self.log.info(
                    "Heartbeat went through after %d failed tries (%s)",
                    self._beat_failures,
                    self._where,
                )
                self._beat_failures = 0
            if extension.state != LeaseState.HELD:
                # Why the handler is told to stop, for whoever reads DEBUG (a heartbeat that
                # answered so ended a test's handler early once in CI, and nothing said why).
                self.log.debug("Heartbeat answered %s (%s)", extension.state, self._where)
            if extension.state == LeaseState.CANCELLED:
                # Renewed all the same (see the module's docstring), but no longer the
                # handler's to finish: a manual heartbeat tells it so.
                held = False
                self.signal.abort(AbortReason.CANCELLED)
                if not self.started and self._on_cancelled_unstarted is not None:
                    self._on_cancelled_unstarted(self)
            elif extension.state != LeaseState.HELD:
                held = False
                # Not lost but completed, when the handler's transaction committed while this
                # renewal was on its way; or a key hold that has ended (let go, or its row
                # purged): nothing more to renew.
                if self._completed_in_transaction():
                    # The hold has run out (lapsed, and the key's next delivery may run) or was
                    # cleared: nothing more is renewed, and the handler is told.
                    self._hold_ran_out(in_database=True)
                else:
                    self._lease_lost_in_database = True
                    self.signal.abort(AbortReason.LEASE_LOST)
        except WorkQueueError as exc:
            # A failed call is not a lost lease: keep running, and the horizon still aborts the
            # handler if renewals keep failing past the lease. A lost connection is worth
            # trying again soon, on a fresh one, rather than a whole heartbeat interval later.
            # Once at WARNING, then DEBUG, as a settle's: a handler beating every 100 ms said
            # it ten times a second through an outage, each handler of each host.
            self._beat_failures += 1
            self.log.log(
                logging.WARNING if self._beat_failures == 1 else logging.DEBUG,
                "Heartbeat failed (%s): %s",
                self._where,
                one_line(exc),
            )
            if isinstance(exc, PrivilegeRefusedError):
                self._renewal_refused = f"renewing its lease: {exc}"
            if isinstance(exc, RETRYABLE_SETTLE_ERRORS):
                self._retry_beat_soon()
        finally:
            with self._lock:
                self._beat_in_flight = None
            shared.set_result(held)
        return held

    def _retry_beat_soon(self) -> None:
        delay = self._beat_retry_seconds
        self._beat_retry_seconds = min(delay * 2, RETRY_MAX_SECONDS)
        if time.monotonic() + delay < self._lease_ends:
            self._keep_timer(self.services.timers.schedule(delay, self._renew_soon))

    # -- completing inside the handler's transaction ----------------------------------------

    def _holds_row_in_transaction(self) -> bool:
        """Whether a completion in the handler's transaction is being run or awaits its end."""
        enlisted = self._enlisted
        return self._enlisting or (
            enlisted is not None and enlisted.state() == EnlistedCompletion.PENDING
        )

    def _completed_in_transaction(self) -> bool:
        enlisted = self._enlisted
        return enlisted is not None and enlisted.state() == EnlistedCompletion.COMMITTED

    def _complete_in_transaction(self) -> None:
        """``context.complete(enlist=True)``: run ``wq_complete`` in the handler's transaction
        (see ``workqueue.runtime.enlisted``)."""
        if self._finished:
            raise EnlistError(
                f"context.complete(enlist=True) was called for delivery "
                f"{self.delivery.delivery_id} after its handler returned, when the delivery is "
                "no longer running: call it inside handle(), in the transaction that makes "
                "your changes."
            )
        alias = self.services.receiver.enlist_alias
        if alias is None:
            raise EnlistError(
                "context.complete(enlist=True) needs a transport that settles in the database "
                "(the Database transport); this subscription's transport cannot: call "
                "context.complete() after your transaction commits."
            )
        connection = open_transaction(alias)
        with self._lock:
            enlisted = self._enlisted
            if enlisted is not None:
                state = enlisted.state()
                if state == EnlistedCompletion.PENDING and enlisted.connection is connection:
                    return  # already completed in this very transaction
                if state != EnlistedCompletion.ROLLED_BACK:
                    raise EnlistError(
                        f"Delivery {self.delivery.delivery_id} was already completed in "
                        + (
                            "a transaction that has committed"
                            if state == EnlistedCompletion.COMMITTED
                            else "another transaction that is still open"
                        )
                        + ": complete it once, in the transaction that makes your changes."
                    )
            if self._enlisting:
                raise EnlistError(
                    f"Delivery {self.delivery.delivery_id} is being completed by another "
                    "thread right now: complete it once."
                )
            self._enlisting = True
            renewal = self._beat_in_flight
        try:
            if renewal is not None:
                # Let it finish first: once the row is locked below, it would wait for the
                # handler's transaction.
                renewal.result()
            try:
                # Holding the key: the handler runs on after its transaction, and the key's
                # next delivery must not start beside it (review helper-193).
                called_at = time.monotonic()
                settled = self.services.receiver.complete(
                    self.delivery, connection=connection, holding_key=True
                )
            except SerializationFailureError as exc:
                raise EnlistError(
                    f"Delivery {self.delivery.delivery_id} could not be completed in your "
                    "transaction: the database refused it as a serialization failure. The "
                    f"transaction runs above READ COMMITTED on database {alias!r} (REPEATABLE "
                    "READ, SERIALIZABLE or SNAPSHOT), where a row changed after its first "
                    "statement may not be updated, and the host changes the delivery's row "
                    "whenever it renews the lease (every third of it, and at each "
                    "context.heartbeat()). Your changes roll back and the delivery is retried. "
                    "Complete in a READ COMMITTED transaction: give the work queue an alias of "
                    "the same database at READ COMMITTED (WORKQUEUE['DATABASE_ALIAS']) and make "
                    "the handler's changes through it, or on PostgreSQL run `SET TRANSACTION "
                    "ISOLATION LEVEL READ COMMITTED` first in the block."
                ) from exc
            if settled.settled:
                # The hold runs a whole lease from the call (wq_complete_holding_key), once the
                # transaction commits (a rollback leaves the lease where it was).
                self._hold_called_at = called_at
                holds_key = self._holds_key_after_commit()
                self._enlisted = EnlistedCompletion(
                    connection,
                    on_commit=self._hold_starts if holds_key else None,
                    on_committed=self._renew_after_commit if holds_key else None,
                )
                return
        finally:
            self._enlisting = False
        if self.signal.has(AbortReason.CANCELLED) or cancel_requested(
            connection.alias, self.delivery.delivery_id
        ):
            self.signal.abort(AbortReason.CANCELLED)
            raise Cancelled(
                f"Delivery {self.delivery.delivery_id} was cancelled by an operator while it "
                "ran, so it was not completed: let this exception leave the "
                "transaction.atomic() block, so that your changes roll back."
            )
        self._lease_lost_in_database = True
        self.signal.abort(AbortReason.LEASE_LOST)
        raise LeaseLost(
            f"Delivery {self.delivery.delivery_id} (attempt {self.delivery.attempt}) is no "
            "longer held by this handler (its lease expired; another consumer may run it), so "
            "it was not completed: let this exception leave the transaction.atomic() block, so "
            "that your changes roll back."
        )

    # -- settling --------------------------------------------------------------------------

    def _off_worker(self, settle: Callable[[], T]) -> Callable[[], T]:
        """``settle``, made to run on ``services.settle_threads`` (when there are any and this
        is not already one of them) while the calling thread waits for its result."""
        threads = self.services.settle_threads
        if threads is None or threads.runs_on_current_thread():
            return settle

        def on_a_settle_thread() -> T:
            # Once the pool has shut down (a handler that outlived its consumer's stop), or
            # if it dropped the task unstarted while shutting down: settle here, not never.
            try:
                future = threads.submit(settle)
            except RuntimeError:
                return settle()
            try:
                return future.result()
            except CancelledError:
                return settle()

        return on_a_settle_thread

    def _while_lease_lasts(self, settle: Callable[[], T]) -> T:
        """Run a settle call; when it fails on a lost connection (or another transient error,
        or a cloud transport that could not be reached) run it again on a fresh connection,
        backing off, for as long as the lease can still be held. Safe because every settle is
        fenced by the lease token (a cloud receiver by its own clock, before each call): a call
        that did take effect before its connection dropped makes the retry answer "not
        settled", never apply twice. Past the lease the row is lease expiry's to retry, and
        the error stands."""
        delay = RETRY_MIN_SECONDS
        failures = 0
        while True:
            try:
                settled = settle()
            except RETRYABLE_SETTLE_ERRORS as exc:
                self._answer_lost = True
                if time.monotonic() + delay >= self._settle_deadline():
                    raise
                failures += 1
                # Once at WARNING, then DEBUG: every 0.1 to 2 s of an outage, each finished
                # handler said it again (84 lines for six handlers in a 20 s restart).
                self.log.log(
                    logging.WARNING if failures == 1 else logging.DEBUG,
                    "Settle failed (%s): %s; trying again in %.1f s while the lease lasts",
                    self._where,
                    one_line(exc),
                    delay,
                )
                time.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_SECONDS)
                continue
            if failures:
                self.log.info(
                    "Settle went through after %d failed tries (%s)", failures, self._where
                )
            return settled

    def _settle(self, decision: _Decision) -> ExecutionResult:
        result = self._settle_decision(decision)
        if self._renewal_refused and self.signal.has(AbortReason.LEASE_LOST) and not result.refused:
            # The lease ran out because its renewals were refused for want of a grant: however
            # the settle went, that is an operator's to hear (health Error, a one-shot job's
            # exit 2), as a refused settle is (review helper-171).
            return replace(result, refused=True, error=self._renewal_refused)
        return result

    def _settle_decision(self, decision: _Decision) -> ExecutionResult:
        self._finished = True  # the handler returned: no renewal starts after this
        enlisted = self._enlisted
        if enlisted is not None:
            state = enlisted.state(handler_returned=True)
            if state == EnlistedCompletion.COMMITTED or (
                # Still open around the handler, as a test's transaction is around
                # run_until_idle: let go in it, on the connection the queue's calls share
                # with it (the database clock stands still there, so no lease would end).
                state == EnlistedCompletion.PENDING
                and routed_to_django_connection(self.services.receiver.enlist_alias)
            ):
                self._release_key()
            if state != EnlistedCompletion.ROLLED_BACK:
                return self._completed_by_handler(decision)
            if self._completed_at_its_attempt():
                # Its commit reached the server though Django saw it fail (the answer was lost
                # with the connection, whatever the handler made of that error): completed, not
                # a lease lost or a retry refused.
                return self._completed_by_handler(decision)
            if time.monotonic() >= self._lease_ends:
                # The horizon waited while the handler's transaction held the row; with that
                # transaction rolled back, the passed lease counts as lost, as it would have.
                self.signal.abort(AbortReason.LEASE_LOST)
        receiver = self.services.receiver
        try:
            if self.signal.has(AbortReason.CANCELLED):
                return self._acknowledge_cancel()
            if self.signal.has(AbortReason.LEASE_LOST) and self._database_took_the_lease():
                self.log.error(
                    "Lease lost (%s); the handler's outcome was not recorded and the delivery "
                    "may run again",
                    self._where,
                )
                return self._lease_lost()
            # Told LeaseLost by the local horizon only: the lease may hold on, and the settle
            # below (fenced by the token) records the outcome, or is refused should another
            # consumer have taken the delivery.
            stopping = self.signal.has(AbortReason.SHUTDOWN) or self.services.stopping.is_set()
            charged = self._outlived_drain and decision.exception is not None
            if stopping and not charged and decision.kind != Outcome.COMPLETE:
                result = self._result(
                    self._while_lease_lasts(
                        self._off_worker(lambda: receiver.release(self.delivery))
                    )
                )
                return replace(result, released=result.status == DeliveryStatus.PENDING)
            if decision.kind == Outcome.COMPLETE:
                result = self._completion_result(
                    self._while_lease_lasts(lambda: self.services.complete(self.delivery))
                )
                if result.status == DeliveryStatus.COMPLETED:
                    self._log_completed()
                return result
            if decision.kind == Outcome.DEAD_LETTER:
                return self._dead_letter(
                    decision.reason or "DeadLettered", decision.error, decision.exception
                )
            error = decision.error or "Retry requested by handler"
            if self.delivery.attempt >= self._max_attempts_now():
                return self._dead_letter("MaxAttemptsExceeded", error, decision.exception)
            delay = retry_delay_seconds(
                self.delivery.attempt,
                self.plan.backoff_base_seconds,
                self.plan.backoff_max_seconds,
                decision.delay_seconds,
            )
            result = self._result(
                self._while_lease_lasts(
                    self._off_worker(lambda: receiver.retry(self.delivery, delay, error))
                )
            )
            if result.status == DeliveryStatus.PENDING:
                self.log.warning(
                    "Delivery failed, retrying in %.1f s (%s): %s",
                    delay,
                    self._where,
                    _first_line(error),
                    exc_info=_traceback_to_log(decision.exception),
                )
            return result
        except WorkQueueError as exc:
            # The row is left for lease expiry, which retries or dead-letters it.
            self.log.error(
                "Delivery settle failed (%s): %s; the outcome was not recorded, and the "
                "delivery runs again once its lease expires",
                self._where,
                one_line(exc),
            )
            return _failed_settle(exc)

    def _max_attempts_now(self) -> int:
        """The subscription's ``max_attempts``: the plan's, unless the plan says this attempt
        is the last, when the transport says what it goes by now (a value raised since the
        plan was read gives the attempt a retry; see ``TransportReceiver.max_attempts``)."""
        if self.delivery.attempt < self.plan.max_attempts:
            return self.plan.max_attempts
        return self.services.receiver.max_attempts(self.plan.max_attempts)

    def _hold_starts(self) -> None:
        """The handler's transaction committed a completion that holds the key: the local
        lease now ends a whole lease after the completion's call, as the hold does (review
        helper-196: moved at the call, a block that then rolled back kept a lease the database
        never gave). Run by the commit's hooks before the completion reads committed, so that
        no horizon looks at the lease the delivery had in between (review helper-197)."""
        self._lease_ends = max(self._lease_ends, self._hold_called_at + self.lease_seconds)
        self._arm_horizon()

    def _renew_after_commit(self) -> None:
        """Renew the hold at once (a block that went on past the lease after the call committed
        with the hold run out). Run by the commit's hooks, so it must not raise into the
        handler's block: a pool that has shut down leaves the renewal to the timer."""
        with contextlib.suppress(RuntimeError):
            self._renew_soon()
            if self.plan.heartbeat_mode != "Auto":
                return
            with self._lock:
                # Read under the lock that the renewals' own decision to stop is recorded
                # under: a renewal that decided to stop before the commit and recorded it after
                # this look left the hold renewed once, to lapse under its running handler
                # (review helper-196's race, now a test). Taken over here, so that only one
                # restarts them.
                restart, self._ticks_stopped = self._ticks_stopped, False
            if restart:
                # The automatic renewals had stopped (a horizon said the lease was lost before
                # this completion was accepted: review helper-195): they go on for the hold.
                self._schedule_auto_heartbeat()

    def _holds_key_after_commit(self) -> bool:
        """Whether a completion in the handler's transaction holds the delivery's partition
        key (wq_complete_holding_key) while the handler runs on."""
        return self.plan.partition_mode != "None" and self.delivery.partition_key is not None

    def _release_key(self) -> None:
        """Free the partition key the handler's own completion held while it ran on. Should it
        fail for good, the key is free when the lease ends."""
        if not self._holds_key_after_commit():
            return  # nothing held
        try:
            # Retried on a lost connection as a settle is (fenced by the token, so safe): a
            # release dropped once left an Ordered key idle for a whole lease (review
            # helper-195).
            self._while_lease_lasts(
                self._off_worker(lambda: self.services.receiver.release_key(self.delivery))
            )
        except WorkQueueError as exc:
            self.log.warning(
                "The partition key of a delivery completed in its handler's transaction could "
                "not be freed (%s): %s; its next delivery waits for the lease to end",
                self._where,
                _first_line(str(exc)),
            )

    def _completed_by_handler(self, decision: _Decision) -> ExecutionResult:
        """The handler's own transaction completed the delivery (or will, with the outer
        transaction still open around it): nothing is settled again."""
        if decision.kind != Outcome.COMPLETE:
            self.log.warning(
                "The handler completed the delivery in its transaction, then %s (%s); the "
                "completion stands and nothing else is recorded",
                f"raised {_first_line(decision.error)}"
                if decision.exception is not None and decision.error
                else f"returned {decision.kind}",
                self._where,
                exc_info=decision.exception,
            )
        self._log_completed()
        return ExecutionResult(ExecutionResult.SETTLED, DeliveryStatus.COMPLETED)

    def _dead_letter(
        self, reason: str, error: str | None, exception: BaseException | None
    ) -> ExecutionResult:
        settled = self._while_lease_lasts(
            self._off_worker(
                lambda: self.services.receiver.dead_letter(self.delivery, reason, error)
            )
        )
        if (
            not settled.settled
            and self._answer_lost
            and self._read_back("dead_lettered_at_its_attempt", reason)
        ):
            # The first call committed and its answer was lost with the connection: the dead
            # letter is this attempt's, and is logged and signalled as one.
            result = ExecutionResult(ExecutionResult.SETTLED, DeliveryStatus.DEAD_LETTERED)
        else:
            result = self._result(settled)
        if result.status == DeliveryStatus.DEAD_LETTERED:
            self.log.error(
                "Delivery dead-lettered: %s (%s)%s",
                log_text(reason),  # a FatalWorkError's message: every line of it
                self._where,
                f": {_first_line(error)}" if error else "",
                exc_info=None if self._handler_logs_failures else _traceback_to_log(exception),
            )
            # Robust: a receiver that raises (Django logs it) must not fail the settle.
            signals.dead_lettered.send_robust(
                sender=DeliveryExecution,
                subscription_id=self.plan.subscription_id,
                delivery_id=self.delivery.delivery_id,
                partition_key=self.delivery.partition_key,
                reason=reason,
            )
        return result

    def _acknowledge_cancel(self) -> ExecutionResult:
        try:
            settled = self._while_lease_lasts(
                self._off_worker(lambda: self.services.receiver.acknowledge_cancel(self.delivery))
            )
        except WorkQueueError as exc:
            self.log.error("Acknowledging the cancel failed (%s): %s", self._where, exc)
            return _failed_settle(exc)
        if settled.settled:
            return ExecutionResult(ExecutionResult.SETTLED, DeliveryStatus.DISCARDED)
        return ExecutionResult(ExecutionResult.LEASE_LOST)

    def _result(self, settled: SettleResult) -> ExecutionResult:
        if settled.settled:
            return ExecutionResult(ExecutionResult.SETTLED, settled.status)
        if self.services.cancels:
            # A cancel may have landed after the last heartbeat: acknowledging it frees the
            # key now instead of at lease expiry.
            result = self._acknowledge_cancel()
            if result.kind != ExecutionResult.LEASE_LOST:
                return result
        self.log.error(
            "Lease lost (%s): the settle was refused, so the handler's outcome was not "
            "recorded and the delivery may run again%s",
            self._where,
            " (or the settle's first call, whose answer was lost with its connection, took effect)"
            if self._answer_lost
            else "",
        )
        return self._lease_lost()

    def _lease_lost(self) -> ExecutionResult:
        """LeaseLost, refused (as a settle refused for want of a grant) when a renewal was."""
        refused = self._renewal_refused
        return ExecutionResult(ExecutionResult.LEASE_LOST, error=refused, refused=bool(refused))

    def _completion_result(self, settled: SettleResult) -> ExecutionResult:
        """``_result`` of a completion, which may be refused because an earlier call of it
        committed and its answer was lost with the connection: recorded, not a lost lease (as
        the log and metrics would otherwise say). A dead letter is read back too (by its
        reason: lease expiry gives its own); a retry or release is not, since lease expiry
        leaves the same row (Pending at the same attempt), and the lost lease logged says the
        first call may have taken effect."""
        if not settled.settled and self._answer_lost and self._completed_at_its_attempt():
            return ExecutionResult(ExecutionResult.SETTLED, DeliveryStatus.COMPLETED)
        return self._result(settled)

    def _completed_at_its_attempt(self) -> bool:
        return self._read_back("completed_at_its_attempt")

    def _read_back(self, method: str, *args: Any) -> bool:
        """The receiver's read-back ``method`` of this delivery (``completed_at_its_attempt``,
        ``dead_lettered_at_its_attempt``), False when it cannot tell."""
        # A receiver from before the method (a third-party transport) cannot tell either.
        read_back = getattr(self.services.receiver, method, None)
        if read_back is None:
            return False
        try:
            return bool(read_back(self.delivery, *args))
        except (WorkQueueError, DatabaseError, InterfaceError):
            return False  # cannot tell: reported as before


def _failed_settle(exc: WorkQueueError) -> ExecutionResult:
    return ExecutionResult(
        ExecutionResult.FAILED, error=str(exc), refused=isinstance(exc, PrivilegeRefusedError)
    )


def _not_an_outcome(returned: Any) -> str:
    """The error recorded for a handler that returned ``returned``, not an ``Outcome`` (a
    ``handle`` that does its work and forgets to return): the delivery is retried, its work
    repeated each time until it is dead-lettered, so the text says what to return."""
    try:
        shown = repr(returned)
    except Exception as exc:
        # A model instance whose __str__ follows a relation that is not there, say: raised
        # here, it crashed the execution, and the delivery waited InFlight for its lease to
        # run out, its attempt spent with no error recorded (audit helper-134).
        shown = f"a {type(returned).__name__} whose repr() raised {type(exc).__name__}"
    if len(shown) > 80:
        shown = f"{shown[:77]}..."
    return (
        f"Handler returned no valid outcome ({shown}): end handle() with `return "
        "Outcome.complete()` (or Outcome.retry(...), Outcome.dead_letter(...)), or raise to "
        "fail; this attempt counts as failed and is retried"
    )


def report_lease_expired_dead_letter(
    sender: type,
    subscription: str,
    subscription_id: Any,
    delivery_id: str,
    partition_key: str | None,
    reason: str = "LeaseExpired",
) -> None:
    """A dead letter made by lease expiry (a claim or the sweeper found its holder gone on the
    last attempt): logged like a handler's, so alerting sees both, and signalled
    (``dead_lettered``, from ``sender``). Robustly: a receiver that raises (Django logs it)
    must not take the claim, or the sweeper's batch, with it."""
    logger.error(
        "Delivery dead-lettered: LeaseExpired (subscription=%s delivery=%s key=%s): its holder "
        "stopped renewing the lease on its last attempt",
        subscription,
        log_value(delivery_id),  # a cloud queue's message names its own
        log_value(partition_key),
        extra={
            "subscription": subscription,
            "delivery_id": delivery_id,
            "partition_key": partition_key,
        },
    )
    signals.dead_lettered.send_robust(
        sender=sender,
        subscription_id=subscription_id,
        delivery_id=delivery_id,
        partition_key=partition_key,
        reason=reason,
    )


def _short(text: str) -> str:
    """A FatalWorkError's message as a dead-letter reason."""
    return _cut_reason(text.strip() or "FatalWorkError")


def _cut_reason(text: str) -> str:
    """``text`` as the reason column holds it (in UTF-16 units, as SQL Server counts), cut with
    an ellipsis rather than by the database, which could cut through a character."""
    if key_length(text) <= MAX_REASON_LENGTH:
        return text
    return within_units(text, MAX_REASON_LENGTH - 1) + "…"


#: Characters of an error's summary in a settle's log line.
SUMMARY_WIDTH = 500


def _first_line(text: str) -> str:
    """What a log line says of an error: its exception's ``Type: message`` line, as the
    operators' listings show it. (A traceback's last line, used until audit helper-136, is the
    end of the exception's message, for a database error its ``LINE 1:`` or caret line.)
    Its control characters are escaped: the message is often a payload's data."""
    return log_text(error_summary(text, width=SUMMARY_WIDTH))


def _traceback_to_log(exception: BaseException | None) -> BaseException | None:
    """What a settle's log line shows a traceback of: what the handler raised, but not a
    ``TransientWorkError``, the handler's own way of asking for a retry (its message is on the
    line, and the delivery keeps the traceback in ``last_error``)."""
    return None if isinstance(exception, TransientWorkError) else exception


def describe_error(exc: BaseException) -> str:
    """``exc``'s traceback as the work queue keeps it (storable, at most MAX_ERROR_LENGTH)."""
    return _error_text("".join(traceback.format_exception(exc)).strip())


def _error_text(text: str) -> str:
    """``text`` as a delivery keeps it: storable, and at most MAX_ERROR_LENGTH long."""
    text = _storable(text)
    if key_length(text) <= MAX_ERROR_LENGTH:
        return text
    # Counted in UTF-16 units, as SQL Server's columns hold them: its LEFT would otherwise cut
    # a longer text (or half a character) where Python's count did not.
    head = within_units(text, _ERROR_HEAD_LENGTH)
    tail = within_units(
        text, MAX_ERROR_LENGTH - _ERROR_HEAD_LENGTH - _ERROR_MARKER_ROOM, from_end=True
    )
    left_out = len(text) - len(head) - len(tail)
    return head + f"\n[... {left_out:,} characters left out ...]\n" + tail


def _storable(value: Any) -> Any:
    """What a handler reported, in a form the database accepts: NUL characters and lone
    surrogates (refused by PostgreSQL and by the UTF-8 encoder) are written out as escapes, in
    strings and inside progress mappings, so a handler's text can never make its settle fail."""
    if isinstance(value, str):
        return value.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode()
    if isinstance(value, Mapping):
        return {_storable(str(k)): _storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_storable(v) for v in value]
    return value


def _progress(progress: Mapping[str, Any]) -> dict[str, Any]:
    """Keep progress within 4000 characters of JSON: drop the checkpoint, then cut the text."""
    value = _storable(dict(progress))
    if len(json.dumps(value, default=str)) <= 4000:
        return value
    value.pop("checkpoint", None)
    if isinstance(value.get("message"), str):
        value["message"] = value["message"][:500]
    return value
