"""What a handler sees: the message, and a context with its delivery's facts and controls."""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.db import models

from workqueue.exceptions import EnlistError


class AbortReason(models.TextChoices):
    CANCELLED = "Cancelled"  # an operator discarded the running delivery
    LEASE_LOST = "LeaseLost"  # the lease is gone: another consumer may run it now
    MAX_PROCESSING_SECONDS = "MaxProcessingSeconds"  # the subscription's time cap passed
    SHUTDOWN = "Shutdown"  # the host is draining


class AbortSignal:
    """Tells a running handler to stop. Handlers poll ``aborted`` or block on ``wait()``.

    Several reasons may arrive; ``reason`` is the first. The runtime reads all of them
    (``has()``) because a cancel, shutdown and the time cap each change how the outcome is
    settled, whatever arrived first (a cancel is acknowledged even after the lease horizon).
    """

    def __init__(self, overdue: Callable[[], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._reasons: list[str] = []
        # Made by the first wait(): most handlers never block on their signal, and an Event
        # per delivery costs more than the rest of the signal.
        self._event: threading.Event | None = None
        # Called as the handler reads its signal, before any reason is recorded: the runtime
        # records a reason that is due but not told yet (a lease whose horizon passed while
        # the process was frozen, its timer not run yet when the handler's wait timed out).
        self._overdue = overdue

    @property
    def aborted(self) -> bool:
        if not self._reasons and self._overdue is not None:
            self._overdue()
        return bool(self._reasons)

    @property
    def reason(self) -> str | None:
        if not self._reasons and self._overdue is not None:
            self._overdue()
        with self._lock:
            return self._reasons[0] if self._reasons else None

    def has(self, reason: str) -> bool:
        # No lock: reasons are only ever appended (under the lock), and reading a list while
        # another thread appends is safe; the runtime asks this several times per delivery.
        return reason in self._reasons

    def wait(self, timeout: float | None = None) -> bool:
        """Block until aborted or ``timeout`` seconds pass; True when aborted."""
        if self.aborted:
            return True
        with self._lock:
            if self._reasons:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout) or self.aborted

    def abort(self, reason: str) -> bool:
        """Record ``reason``; True if it is new. (Called by the runtime, not by handlers.)"""
        with self._lock:
            if reason in self._reasons:
                return False
            self._reasons.append(reason)
            event = self._event
        if event is not None:
            event.set()
        return True


class StopNotice:
    """Tells running handlers that their host has begun to stop (the start of the drain).

    A request, not an order: the handler may finish, or return early so the drain ends sooner.
    Whatever it returns then, except ``Outcome.complete()``, hands the delivery back without
    using up an attempt. Handlers still running when the drain time is up are aborted with
    ``Shutdown`` (``context.signal``). Handlers read it with ``is_set()`` or block on ``wait()``.
    """

    def __init__(self) -> None:
        self._event = threading.Event()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the host is stopping or ``timeout`` seconds pass; True when stopping."""
        return self._event.wait(timeout)

    def notify(self) -> None:
        """Announce the stop. (Called by the runtime, not by handlers.)"""
        self._event.set()


@dataclass(frozen=True, slots=True)
class WorkMessage:
    message_id: str
    topic: str
    payload: Any
    payload_ref: Mapping[str, Any] | None
    partition_key: str | None
    attributes: Mapping[str, str]
    correlation_id: str | None
    published_at: dt.datetime


@dataclass(slots=True)
class WorkContext:
    """A delivery's facts and the handler's controls.

    ``stopping`` is set when the host begins to stop (``StopNotice``): long handlers should
    check it between steps and return early. ``signal`` aborts this delivery (cancelled, lease
    lost, time cap, or ``Shutdown`` once the drain time is up). ``heartbeat(progress=None)``
    renews the lease now (``Manual`` subscriptions must call it within every lease); it returns
    False once the lease is lost, the delivery was cancelled or the time cap passed, and the
    handler should then stop.

    ``complete(enlist=True)`` completes the delivery inside the handler's open
    ``transaction.atomic()``, so the handler's database writes and the completion commit or roll
    back together (README "Exactly-once effects for database work").
    """

    subscription_name: str
    delivery_id: str
    attempt: int
    max_attempts: int
    is_replay: bool
    #: The host instance holding this delivery's lease (its lease owner).
    worker_id: str
    signal: AbortSignal
    stopping: StopNotice
    logger: logging.LoggerAdapter
    _heartbeat: Callable[[Mapping[str, Any] | None], bool] = field(repr=False)
    _complete: Callable[[], None] = field(repr=False)

    def heartbeat(self, progress: Mapping[str, Any] | None = None) -> bool:
        return self._heartbeat(progress)

    def complete(self, *, enlist: bool = False) -> None:
        """Complete this delivery in the transaction open on the work queue's database alias.

        Call it inside the ``transaction.atomic(using=...)`` block that makes the handler's
        changes: the completion is the same fenced ``wq_complete`` any completion runs, on the
        caller's connection, and commits or rolls back with the block. The runtime then
        settles nothing more for this delivery, whatever the handler returns, once the block
        has committed; after a rollback the handler's outcome is settled as usual.

        Raises ``LeaseLost`` (or its subclass ``Cancelled``) when the delivery may no longer
        be completed, having completed nothing: let it leave the block so the block rolls back.
        Raises ``EnlistError`` when no transaction is open on the queue's alias, the
        transaction is on another alias, or the handler has already returned. Calling it
        again in the same open transaction does nothing. Until the block ends the delivery's
        row stays locked: keep what follows the call short.
        """
        if not enlist:
            raise EnlistError(
                "context.complete() completes only inside your transaction: call "
                "context.complete(enlist=True) within transaction.atomic(), or return "
                "Outcome.complete() to complete when the handler returns."
            )
        self._complete()
