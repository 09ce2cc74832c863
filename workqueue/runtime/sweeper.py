"""The sweeper: lease expiry across all subscriptions and retention purges, in bounded batches,
one pass at a time across every instance (a transaction-scoped lock on a private connection)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from workqueue import signals, transport
from workqueue.runtime.executor import log_lease_expired_dead_letter
from workqueue.types import DeliveryStatus

logger = logging.getLogger(__name__)

EXPIRE_BATCH = 500
PURGE_BATCH = 1000
MAX_BATCHES = 20
PURGE_STEPS = ("terminal_deliveries", "orphan_messages", "expired_deduplications")


@dataclass(slots=True)
class SweeperPassResult:
    """Rows changed by one pass; -1 marks a step that failed (the pass went on)."""

    skipped: bool = False
    expired: int = 0
    expired_dead_letters: int = 0
    purged: dict[str, int] = field(default_factory=dict)


class Sweeper:
    def run_once(self) -> SweeperPassResult:
        """Run one pass, or skip it (``skipped=True``) when another sweeper holds the lock."""
        with transport.sweep_lock() as acquired:
            if not acquired:
                return SweeperPassResult(skipped=True)
            result = SweeperPassResult()
            self._expire_leases(result)
            for step in PURGE_STEPS:
                result.purged[step] = self._purge(step)
            result.purged["task_results"] = self._purge_task_results()
        if result.expired or any(n for n in result.purged.values()):
            logger.info(
                "Sweeper pass: %d lease(s) expired (%d dead-lettered), purged %s",
                result.expired,
                result.expired_dead_letters,
                result.purged,
                extra={"action": "sweep"},
            )
        return result

    def _expire_leases(self, result: SweeperPassResult) -> None:
        try:
            for _ in range(MAX_BATCHES):
                rows = transport.expire_leases_all(EXPIRE_BATCH)
                result.expired += len(rows)
                for row in rows:
                    if row["new_status"] == DeliveryStatus.DEAD_LETTERED:
                        result.expired_dead_letters += 1
                        log_lease_expired_dead_letter(
                            row["subscription_id"], row["delivery_id"], row["partition_key"]
                        )
                        signals.dead_lettered.send(
                            sender=Sweeper,
                            subscription_id=row["subscription_id"],
                            delivery_id=row["delivery_id"],
                            partition_key=row["partition_key"],
                            reason="LeaseExpired",
                        )
                if len(rows) < EXPIRE_BATCH:
                    return
        except Exception:
            logger.exception("Sweeper: expiring leases failed")
            result.expired = -1

    def _purge_task_results(self) -> int:
        """Tasks API results go with their messages (so with the topic's retention)."""
        # Imported here: the sweeper's module is loaded by code that runs before the models.
        from workqueue.models import TaskResult

        total = 0
        try:
            for _ in range(MAX_BATCHES):
                removed = TaskResult.objects.purge_orphans(PURGE_BATCH)
                total += removed
                if removed < PURGE_BATCH:
                    break
        except Exception:
            logger.exception("Sweeper: purging task results failed")
            return -1
        return total

    def _purge(self, step: str) -> int:
        total = 0
        try:
            for _ in range(MAX_BATCHES):
                removed = transport.purge(step, PURGE_BATCH)
                total += removed
                if removed < PURGE_BATCH:
                    break
        except Exception:
            logger.exception("Sweeper: purging %s failed", step)
            return -1
        return total
