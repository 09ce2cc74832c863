"""The sweeper: lease expiry across all subscriptions and retention purges, in bounded batches,
one pass at a time across every instance (a transaction-scoped lock on a private connection).

A pass takes at most ``MAX_BATCHES`` batches a step, so no pass holds the lock for long. A pass
that stopped at that limit (so rows may be left) is *behind*, and the next one follows after a
pause as long as the pass took, up to one interval (``pause_after``), instead of a whole
interval: a queue settling more rows a second than one pass an interval can purge is still
swept as fast as the database can delete, with the sweeper resting between passes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workqueue import metrics, transport
from workqueue.runtime.executor import report_lease_expired_dead_letter
from workqueue.runtime.service import OutageLog
from workqueue.types import DeliveryStatus

logger = logging.getLogger(__name__)

EXPIRE_BATCH = 500
PURGE_BATCH = 1000
MAX_BATCHES = 20
PURGE_STEPS = ("terminal_deliveries", "orphan_messages", "expired_deduplications")
#: How long a session must stay blocked writing to its client to count as stalled.
STALLED_LISTENER_CONFIRM_SECONDS = 1.0


@dataclass(slots=True)
class SweeperPassResult:
    """Rows changed by one pass; -1 marks a step that failed (the pass went on). ``behind``:
    a step stopped at the pass's limit, so rows may be left."""

    skipped: bool = False
    expired: int = 0
    expired_dead_letters: int = 0
    purged: dict[str, int] = field(default_factory=dict)
    behind: bool = False
    #: Sessions disconnected for holding the notification queue (see _release_stalled_listeners).
    released_listeners: int = 0

    @property
    def failed_steps(self) -> list[str]:
        """The steps that failed (their errors are logged)."""
        counts = {
            "expired_leases": self.expired,
            **self.purged,
            "released_listeners": self.released_listeners,
        }
        return [step for step, rows in counts.items() if rows < 0]


def pause_after(result: SweeperPassResult, took_seconds: float, interval_seconds: float) -> float:
    """Seconds to wait before the next pass: the interval, or as long as this pass took (at
    most the interval) when it may have left rows."""
    if result.behind:
        return min(took_seconds, interval_seconds)
    return interval_seconds


class Sweeper:
    def __init__(self) -> None:
        # Each step's failures, told as a periodic job's are: a database away (a failover, a
        # session cut under the step) once a spell in a WARNING line and its end at INFO, as
        # a consumer whose claim is cut says it (a traceback at ERROR paged whoever alerts on
        # ERROR for every failover that landed on a pass); anything else each time, with its
        # traceback.
        self._steps: dict[str, OutageLog] = {}

    def _step(self, step: str) -> OutageLog:
        if step not in self._steps:
            self._steps[step] = OutageLog(f"Sweeper step {step!r}", logger)
        return self._steps[step]

    def run_once(self) -> SweeperPassResult:
        """Run one pass, or skip it (``skipped=True``) when another sweeper holds the lock."""
        try:
            return self._run_pass()
        except Exception:
            # The lock's own connection failed: the steps never ran. (Each step catches its own.)
            metrics.SWEEPER_PASSES.labels("failed").inc()
            raise

    def _run_pass(self) -> SweeperPassResult:
        with transport.sweep_lock() as acquired:
            if not acquired:
                metrics.SWEEPER_PASSES.labels("skipped").inc()
                return SweeperPassResult(skipped=True)
            result = SweeperPassResult()
            self._expire_leases(result)
            for step in PURGE_STEPS:
                result.purged[step] = self._purge(step, result)
            result.purged["task_results"] = self._purge_task_results(result)
            result.purged["host_records"] = self._purge_host_records(result)
            self._release_stalled_listeners(result)
        counts = {"expired_leases": result.expired, **result.purged}
        for step, rows in counts.items():
            if rows > 0:
                metrics.SWEEPER_ROWS.labels(step).inc(rows)
        metrics.SWEEPER_PASSES.labels(
            "failed" if result.failed_steps else "behind" if result.behind else "caught_up"
        ).inc()
        if result.expired > 0 or any(n > 0 for n in result.purged.values()):
            # A step that failed (-1, and logged) is left out: no count to say.
            logger.info(
                "Sweeper pass: %s lease(s) expired (%d dead-lettered), purged %s%s",
                result.expired if result.expired >= 0 else "? (the step failed)",
                result.expired_dead_letters,
                {step: rows for step, rows in result.purged.items() if rows >= 0},
                "; rows left for the next pass" if result.behind else "",
                extra={"action": "sweep", "behind": result.behind},
            )
        return result

    def _expire_leases(self, result: SweeperPassResult) -> None:
        try:
            for _ in range(MAX_BATCHES):
                rows = transport.expire_leases_all(EXPIRE_BATCH)
                result.expired += len(rows)
                dead = [r for r in rows if r["new_status"] == DeliveryStatus.DEAD_LETTERED]
                names = self._subscription_names({r["subscription_id"] for r in dead})
                for row in dead:
                    result.expired_dead_letters += 1
                    # By name, as a consumer logs it: the name is what operators act on.
                    report_lease_expired_dead_letter(
                        Sweeper,
                        names.get(str(row["subscription_id"]), str(row["subscription_id"])),
                        row["subscription_id"],
                        row["delivery_id"],
                        row["partition_key"],
                    )
                if len(rows) < EXPIRE_BATCH:
                    break
            else:
                result.behind = True
        except Exception as exc:
            self._step("expiring leases").failed(exc)
            result.expired = -1
        else:
            self._step("expiring leases").passed()

    def _release_stalled_listeners(self, result: SweeperPassResult) -> None:
        """Keep the notification queue from filling up behind a listener that stopped reading.

        The server keeps each notification until every listening session has handed it to its
        client. A host frozen or hung with its connection still open (SIGSTOP, a paused VM, a
        deadlocked wake-up thread: the kernel keeps the socket) stops reading, and the queue
        grows by each publish's announcement until, some hundreds of millions later, every
        publish fails at its commit. Such a session is disconnected: a host reconnects when it
        resumes and catches up on what it missed, as after any outage."""
        step = self._step("looking for sessions that stopped reading")
        try:
            usage = transport.notification_queue_usage()
            stalled = usage is not None and usage >= transport.NOTIFICATION_QUEUE_WARNING_USAGE
            # Else no queue (SQL Server), or one that listeners keep reading.
            found = (
                transport.release_stalled_listeners(STALLED_LISTENER_CONFIRM_SECONDS)
                if stalled
                else None
            )
        except Exception as exc:
            step.failed(exc)
            result.released_listeners = -1
            return
        step.passed()
        if found is None:
            return
        full = f"{usage:.1%}"
        result.released_listeners = len(found.released)
        for holder in found.released:
            logger.warning(
                "Disconnected %s: it had stopped reading its notifications, and the server's "
                "notification queue, which keeps them until every listener has read them, was "
                "%s full (every publish fails once it is full). A host reconnects when it "
                "resumes.",
                holder,
                full,
                extra={"action": "stalled_listener_released", "queue_usage": usage},
            )
        for refusal in found.refused:
            logger.error(
                "The server's notification queue is %s full (every publish fails once it is "
                "full) and a session that stopped reading it could not be disconnected: %s. "
                "End it (SELECT pg_terminate_backend(pid)), or let the sweeper's role do so "
                "(membership in the session's role, or pg_signal_backend).",
                full,
                refusal,
                extra={"action": "stalled_listener_refused", "queue_usage": usage},
            )
        if not found.released and not found.refused:
            logger.error(
                "The server's notification queue is %s full (every publish fails once it is "
                "full), and no session of this database that this login can see has stopped "
                "reading: a listener of another login (pg_monitor shows it), in another "
                "database of the server, or inside a long transaction is holding it. Find it "
                "in pg_stat_activity (wait_event ClientWrite, or an old xact_start) and end it.",
                full,
                extra={"action": "notification_queue_full", "queue_usage": usage},
            )

    def _purge_task_results(self, result: SweeperPassResult) -> int:
        """Tasks API results go with their messages (so with the topic's retention)."""
        # Imported here: the sweeper's module is loaded by code that runs before the models.
        from workqueue.models import TaskResult

        return self._in_batches("task results", TaskResult.objects.purge_orphans, result)

    def _purge_host_records(self, result: SweeperPassResult) -> int:
        from workqueue.models import HostRecord

        return self._in_batches("host records", HostRecord.objects.purge_unseen, result)

    def _purge(self, step: str, result: SweeperPassResult) -> int:
        return self._in_batches(step, lambda size: transport.purge(step, size), result)

    def _in_batches(
        self, step: str, remove: Callable[[int], int], result: SweeperPassResult
    ) -> int:
        """Rows ``remove`` deleted in up to MAX_BATCHES batches, or -1 when it failed; marks
        ``result`` behind when every batch came back full."""
        total = 0
        try:
            for _ in range(MAX_BATCHES):
                removed = remove(PURGE_BATCH)
                total += removed
                if removed < PURGE_BATCH:
                    break
            else:
                result.behind = True
        except Exception as exc:
            self._step(f"purging {step}").failed(exc)
            return -1
        self._step(f"purging {step}").passed()
        return total

    def _subscription_names(self, subscription_ids: set[Any]) -> dict[str, str]:
        """The names of the subscriptions with these ids, by id as text; none when they
        cannot be read (the leases are expired by then: their log lines and signals must still
        go out)."""
        if not subscription_ids:
            return {}
        from workqueue.models import Subscription

        try:
            names = {
                str(pk): name
                for pk, name in Subscription.objects.filter(pk__in=subscription_ids).values_list(
                    "pk", "name"
                )
            }
        except Exception as exc:
            self._step("reading subscription names").failed(exc)
            return {}
        self._step("reading subscription names").passed()
        return names
