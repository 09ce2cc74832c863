"""Test-only handlers.

* ``registry``: a private HandlerRegistry for in-process tests (``Host(config, registry=...)``).
  Its handlers do what the payload says and report to ``probe``, so a test can wait for a
  handler to start, see the abort reason it got, and read its heartbeat results.
* ``tests.record`` (global registry, for subprocess hosts via WORKQUEUE_HANDLER_MODULES): appends
  one JSON line per event to the file named by WQ_TEST_EVENT_LOG, sleeps (stopping early on the
  abort signal, or ignoring it) and fails on request. Every run writes ``start`` and then exactly
  one of ``end``, ``fail`` or ``abort`` just before it returns (unless its process is killed),
  each with the process id, a CLOCK_MONOTONIC time and the abort reason seen by then, so the
  logs of several processes merge into one timeline of handler executions.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from workqueue.driver import get_driver
from workqueue.runtime.context import WorkContext, WorkMessage
from workqueue.runtime.handlers import BaseWorkHandler, HandlerRegistry, register_handler
from workqueue.runtime.outcome import FatalWorkError, Outcome, TransientWorkError

# -- in-process handlers (private registry) -----------------------------------------------------

registry = HandlerRegistry()


@dataclass
class Run:
    """What one handler call saw."""

    message_id: str
    attempt: int
    max_attempts: int
    delivery_id: str
    subscription: str
    user: Any
    thread: str
    started_at: float
    started: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    payload_ref: Any = None
    signal_reason: str | None = None
    stopping_seen: bool = False
    heartbeats: list[bool] = field(default_factory=list)


class Probe:
    """Collects every handler run; tests wait on it instead of sleeping."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self.runs: list[Run] = []

    def reset(self) -> None:
        with self._lock:
            self.runs = []

    def add(self, run: Run) -> None:
        with self._lock:
            self.runs.append(run)
            self._lock.notify_all()

    def wait_for(self, count: int = 1, timeout: float = 10.0, **match: Any) -> list[Run]:
        """Wait until ``count`` runs match ``match`` (attribute equality); return them."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                found = [r for r in self.runs if all(getattr(r, k) == v for k, v in match.items())]
                if len(found) >= count:
                    return found
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(
                        f"expected {count} run(s) matching {match} within {timeout}s; "
                        f"saw {len(found)} of {len(self.runs)}"
                    )
                self._lock.wait(remaining)


probe = Probe()


class ScriptedHandler(BaseWorkHandler):
    """Does what the payload says, in this order:

    * ``parallelHeartbeats`` N: N threads call ``context.heartbeat()`` at once (results recorded);
    * ``heartbeatEveryMs`` N: call ``context.heartbeat(progress)`` every N ms (recording each
      result) until it returns False, the signal fires (then once more) or ``sleepMs`` passes;
    * ``sleepMs`` N: wait up to N ms for the abort signal (``ignoreSignal``: just sleep;
      ``untilStopping``: wait for ``context.stopping`` instead, as a cooperative handler would);
    * ``then``: ``complete`` (default), ``retry`` (``reason``, ``delay``), ``dead_letter``
      (``reason``), ``fatal`` / ``transient`` (``message``, ``retryAfter``), ``crash``
      (a ValueError with ``message``), ``exit`` (``SystemExit``, which is no ``Exception``),
      ``interrupt`` (``KeyboardInterrupt``, as a library might pass one on), ``invalid``
      (returns ``value``);
    * ``thenByAttempt``: {"<attempt>": action} overrides ``then`` on that attempt;
    * ``thenOnAbort``: the same choices, used instead of ``then`` when the signal fired;
    * ``thenOnStopping``: the same, used when the host announced it is stopping;
    * ``unstorable``: append a NUL character and a lone surrogate (which no payload can carry)
      to ``message`` and ``reason``.
    """

    def handle(self, message: WorkMessage, context: WorkContext) -> Any:
        payload = message.payload if isinstance(message.payload, dict) else {}
        run = Run(
            message_id=message.message_id,
            attempt=context.attempt,
            max_attempts=context.max_attempts,
            delivery_id=context.delivery_id,
            subscription=context.subscription_name,
            user=self.user,
            thread=threading.current_thread().name,
            started_at=time.monotonic(),
            payload_ref=message.payload_ref,
        )
        probe.add(run)
        run.started.set()
        try:
            self._wait(payload, context, run)
            run.signal_reason = context.signal.reason
            run.stopping_seen = context.stopping.is_set()
            action = payload.get("thenByAttempt", {}).get(str(context.attempt))
            action = action or payload.get("then", "complete")
            if context.signal.aborted and "thenOnAbort" in payload:
                action = payload["thenOnAbort"]
            elif run.stopping_seen and "thenOnStopping" in payload:
                action = payload["thenOnStopping"]
            return self._finish(action, payload)
        finally:
            run.finished.set()

    def _wait(self, payload: dict[str, Any], context: WorkContext, run: Run) -> None:
        sleep = payload.get("sleepMs", 0) / 1000
        every = payload.get("heartbeatEveryMs")
        deadline = time.monotonic() + sleep
        if payload.get("parallelHeartbeats"):
            self._parallel_heartbeats(payload["parallelHeartbeats"], context, run)
        if every:
            while time.monotonic() < deadline:
                progress = payload.get("progress") or {"message": f"beat {len(run.heartbeats)}"}
                held = context.heartbeat(progress)
                run.heartbeats.append(held)
                if not held:
                    return
                if context.signal.wait(every / 1000):
                    run.heartbeats.append(context.heartbeat(progress))  # after the abort
                    return
            return
        if payload.get("ignoreSignal"):
            time.sleep(sleep)
        elif payload.get("untilStopping"):
            context.stopping.wait(sleep)
        elif sleep:
            context.signal.wait(sleep)

    @staticmethod
    def _parallel_heartbeats(count: int, context: WorkContext, run: Run) -> None:
        """``count`` threads call ``heartbeat`` at the same moment."""
        barrier = threading.Barrier(count)
        results: list[bool] = []

        def beat(n: int) -> None:
            barrier.wait()
            try:
                results.append(context.heartbeat({"message": f"caller {n}"}))
            finally:
                get_driver().close()  # the renewing caller used this thread's connection

        threads = [threading.Thread(target=beat, args=(n,)) for n in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        run.heartbeats.extend(results)

    @staticmethod
    def _finish(action: str, payload: dict[str, Any]) -> Any:
        message = payload.get("message", "")
        if payload.get("unstorable"):
            message += " \x00 \ud800"
            payload = {**payload, "reason": payload.get("reason", "") + " \x00 \ud800"}
        if action == "complete":
            return Outcome.complete()
        if action == "retry":
            return Outcome.retry(payload.get("reason"), payload.get("delay"))
        if action == "dead_letter":
            return Outcome.dead_letter(payload.get("reason", "dead"))
        if action == "fatal":
            raise FatalWorkError(message)
        if action == "transient":
            raise TransientWorkError(message, payload.get("retryAfter"))
        if action == "crash":
            raise ValueError(message)
        if action == "exit":
            raise SystemExit(message)
        if action == "interrupt":
            raise KeyboardInterrupt(message)
        if action == "invalid":
            return payload.get("value")
        raise AssertionError(f"unknown action {action!r}")


registry.register("t.script", ScriptedHandler)


# -- subprocess handler (global registry) -------------------------------------------------------

EVENT_LOG_ENV = "WQ_TEST_EVENT_LOG"


def fails_transiently(message_id: str, attempt: int, percent: float) -> bool:
    """Deterministic per (message, attempt): the same run fails in every process."""
    digest = hashlib.sha256(f"{message_id}:{attempt}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % 10_000 < percent * 100


def record(event: str, message: WorkMessage, context: WorkContext, **extra: Any) -> None:
    path = os.environ.get(EVENT_LOG_ENV)
    if not path:
        return
    payload = message.payload if isinstance(message.payload, dict) else {}
    line = json.dumps(
        {
            "event": event,
            "pid": os.getpid(),
            "t": time.monotonic_ns(),  # CLOCK_MONOTONIC: comparable across processes
            "sub": context.subscription_name,
            "key": message.partition_key,
            "ordinal": payload.get("ordinal"),
            "message": message.message_id,
            "delivery": context.delivery_id,
            "attempt": context.attempt,
            # The abort reason the handler had been given by now (None: not signalled).
            "signal": context.signal.reason,
            **extra,
        }
    )
    # One O_APPEND write per line: lines from concurrent processes never interleave.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


@register_handler("tests.record")
class RecordingHandler(BaseWorkHandler):
    """Payload: ``ordinal`` (echoed to the log), ``sleepMs`` (every attempt) or
    ``sleepFirstAttemptMs`` (attempt 1 only), stopping early on the abort signal unless
    ``ignoreSignal`` (then sleeping on, and logging when the signal fired as ``signalled_at``),
    or, with ``untilStopping``, on ``context.stopping`` (logged as ``stopping``, then a retry),
    ``failPercent`` (transient failure when the hash of message id + attempt says so) and
    ``failFirstAttempt`` (a transient failure on attempt 1)."""

    def handle(self, message: WorkMessage, context: WorkContext) -> Outcome:
        payload = message.payload if isinstance(message.payload, dict) else {}
        # Each execution's own id: two runs of one (delivery, attempt) in one process never
        # merge into one in the log.
        run = uuid.uuid4().hex
        record("start", message, context, run=run)
        sleep_ms = payload.get("sleepMs", 0)
        if context.attempt == 1:
            sleep_ms = payload.get("sleepFirstAttemptMs", sleep_ms)
        signalled_at = None  # when an ignored abort signal fired (CLOCK_MONOTONIC ns)
        if sleep_ms and payload.get("untilStopping"):
            if context.stopping.wait(sleep_ms / 1000):
                record("stopping", message, context)
                return Outcome.retry("the host is stopping")
        elif sleep_ms and payload.get("ignoreSignal"):
            deadline = time.monotonic() + sleep_ms / 1000
            if context.signal.wait(sleep_ms / 1000):
                signalled_at = time.monotonic_ns()
                time.sleep(max(0.0, deadline - time.monotonic()))
        elif sleep_ms and context.signal.wait(sleep_ms / 1000):
            record("abort", message, context, run=run)
            return Outcome.retry(f"stopped: {context.signal.reason}")
        failing_first = payload.get("failFirstAttempt") and context.attempt == 1
        if failing_first or fails_transiently(
            message.message_id, context.attempt, payload.get("failPercent", 0)
        ):
            record("fail", message, context, run=run, signalled_at=signalled_at)
            raise TransientWorkError("chaos: transient failure")
        record("end", message, context, run=run, signalled_at=signalled_at)
        return Outcome.complete()


@register_handler("tests.noop")
class NoopHandler(BaseWorkHandler):
    """The default handler key of ``tests.factories.SubscriptionFactory``: completes at once, so
    a subscription made by the factory runs in an in-process host (private registry) and in a
    subprocess host (``WORKQUEUE_HANDLER_MODULES=tests.support.handlers``) alike."""

    def handle(self, message: WorkMessage, context: WorkContext) -> Outcome:
        return Outcome.complete()


registry.register("tests.noop", NoopHandler)
