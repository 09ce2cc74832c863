"""How long a host's handlers have been running, and which have run too long.

A handler that never returns while its lease is renewed (an Auto heartbeat renews it for as
long as the handler runs) is InFlight and Running to every other reading: only the host that
runs it knows when it started. Health reports each subscription's oldest run, and names the
runs past their threshold (the subscription's ``max_processing_seconds``, else
``WORKQUEUE["HANDLER_RUN_WARNING_SECONDS"]``) as stuck, read from the executions the consumers
hold: no query, so nothing is added to the claim and settle path.
"""

from __future__ import annotations

import logging
import shlex
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from workqueue.logtext import log_text, log_value
from workqueue.models.hosts import STUCK_RUNS_LISTED

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HandlerRun:
    """One handler running now on this host."""

    #: (delivery id, lease token): one attempt, so a delivery stuck again on a later attempt
    #: is a run of its own. Never shown (the lease token fences settles).
    key: tuple[str, str]
    subscription: str
    delivery_id: str
    handler_key: str
    started_at: float  # time.monotonic()
    threshold_seconds: int
    #: Which setting gave the threshold: ``max_processing_seconds`` or
    #: ``HANDLER_RUN_WARNING_SECONDS``.
    threshold_source: str
    #: Whether its transport can cancel a running delivery (``supports_cancel``).
    cancellable: bool = True

    def seconds(self, now: float) -> float:
        return max(now - self.started_at, 0.0)

    def stuck(self, now: float) -> bool:
        return self.seconds(now) >= self.threshold_seconds


def what_to_do(subscription: str, delivery_id: str, cancellable: bool) -> str:
    """What an operator can do about a stuck run, as one sentence: the command that cancels
    it, ready to paste (quoted for a shell: on a cloud queue the delivery id is the message's
    own text, which whoever may send to the queue chose), or, where the transport cannot
    cancel a running delivery, what can stop it."""
    if not cancellable:
        return (
            "Its transport cannot cancel a running delivery: restart its host, or give the "
            "subscription a max_processing_seconds, past which a handler is aborted"
        )
    command = shlex.join(
        [
            *("manage.py", "workqueue", "discard", "-s", log_text(subscription)),
            *("--delivery", log_text(delivery_id), "--reason", "TEXT"),
        ]
    )
    return f"Cancel it with `{command}` (it is never run again)"


def runs_report(runs: Iterable[HandlerRun], now: float) -> dict[str, Any]:
    """A subscription's health fields for ``runs`` (its handlers running on this host):
    ``oldest_run_seconds`` (None when none runs), ``stuck_count`` and ``stuck_runs``, the
    oldest ``STUCK_RUNS_LISTED`` of them first."""
    ordered = sorted(runs, key=lambda run: run.started_at)
    stuck = [run for run in ordered if run.stuck(now)]
    return {
        "oldest_run_seconds": round(ordered[0].seconds(now), 1) if ordered else None,
        "stuck_count": len(stuck),
        "stuck_runs": [
            {
                "delivery_id": run.delivery_id,
                "handler_key": run.handler_key,
                "seconds": round(run.seconds(now), 1),
                "threshold_seconds": run.threshold_seconds,
                "cancellable": run.cancellable,
            }
            for run in stuck[:STUCK_RUNS_LISTED]
        ],
    }


class StuckRunLog:
    """Logs each stuck run once, at WARNING, when it is first seen stuck: a host looks every
    half second, and a line each time would bury everything else while it runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._logged: set[tuple[str, str]] = set()

    def report(self, stuck: Iterable[HandlerRun], now: float) -> None:
        """Log the runs of ``stuck`` (every stuck run of the host now) not logged before, and
        forget the ones no longer stuck (returned), so what is remembered stays bounded."""
        current = {run.key: run for run in stuck}
        with self._lock:
            new = [run for key, run in current.items() if key not in self._logged]
            self._logged = set(current)
        for run in new:
            # The delivery id is a cloud queue's message text on some transports, and the names
            # are operators': escaped, none can forge a line (workqueue.logtext).
            logger.warning(
                "%s: handler %s has run delivery %s for %d s, past the %d s of %s; it may be "
                "hung (its lease is renewed while it runs). %s; a handler deaf to its abort "
                "signal runs on until its host restarts.",
                log_value(run.subscription),
                log_value(run.handler_key),
                log_value(run.delivery_id),
                run.seconds(now),
                run.threshold_seconds,
                run.threshold_source,
                what_to_do(run.subscription, run.delivery_id, run.cancellable),
                extra={
                    "action": "handler_run_stuck",
                    "subscription": run.subscription,
                    "delivery_id": run.delivery_id,
                    "handler_key": run.handler_key,
                    "seconds": round(run.seconds(now), 1),
                },
            )
