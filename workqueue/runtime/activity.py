"""What a running host's deliveries came to, said now and then: one INFO line per subscription
(``orders.email: 1,240 completed, 3 retried, 1 dead-lettered in the last 60 s``).

A completed delivery logs only at DEBUG (a line per delivery is too many for a busy host), so
without this a host doing its work says nothing at all. The summary costs the delivery path
nothing: it reads the counters the metrics keep anyway (``metrics.DELIVERIES``), once a second
on a thread of its own, and says something only when they moved, at most once per
``SUMMARY_EVERY_SECONDS``. The first line after a quiet spell comes within a second, so a
hello-world host shows its first delivery at once.

The counters are the process's: a process running one host (as the commands do) sums up
that host.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from workqueue import metrics

logger = logging.getLogger(__name__)

#: The shortest time between two summaries.
SUMMARY_EVERY_SECONDS = 60.0
#: How often the counters are looked at: the longest the first line after a quiet spell waits.
LOOK_EVERY_SECONDS = 1.0

#: The outcomes of ``metrics.DELIVERIES``, in the order a line names them, as it names them.
_OUTCOME_WORDS = {
    "completed": "completed",
    "retried": "retried",
    "dead_lettered": "dead-lettered",
    "discarded": "discarded",
    "released": "handed back",
    "lease_lost": "lost their lease",
    "settle_failed": "not recorded (settle failed)",
}


class ActivitySummary:
    """Call ``run_once()`` every ``LOOK_EVERY_SECONDS``; it logs (and returns) a line per
    subscription whose deliveries finished since the last line, unless that line is less
    than ``every_seconds`` old. ``echo`` also hears each line while this logger would not
    emit INFO (a project without ``LOGGING``): the host command's console."""

    def __init__(
        self,
        *,
        every_seconds: float = SUMMARY_EVERY_SECONDS,
        echo: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._every = every_seconds
        self._echo = echo
        self._clock = clock
        # Counted before this host started (another host of the process, a test) is not its.
        self._counted = _delivery_counts()
        self._since = clock()
        self._said_at = -math.inf

    def run_once(self, *, final: bool = False) -> list[str]:
        """The lines said now; ``final`` (at shutdown) says what is left whatever the time."""
        now = self._clock()
        if not final and now - self._said_at < self._every:
            return []
        counts = _delivery_counts()
        moved: dict[str, dict[str, int]] = {}
        for (subscription, outcome), value in counts.items():
            change = int(value - self._counted.get((subscription, outcome), 0))
            if change > 0:
                moved.setdefault(subscription, {})[outcome] = change
        if not moved:
            return []
        seconds = max(1, round(now - self._since))
        self._counted, self._since, self._said_at = counts, now, now
        lines = []
        for subscription, outcomes in sorted(moved.items()):
            line = f"{subscription}: {_described(outcomes)} in the last {seconds} s"
            logger.info(
                "%s",
                line,
                extra={
                    "action": "deliveries_summary",
                    "subscription": subscription,
                    "outcomes": outcomes,
                    "seconds": seconds,
                },
            )
            if self._echo is not None and not logger.isEnabledFor(logging.INFO):
                self._echo(line)
            lines.append(line)
        return lines


def _described(outcomes: dict[str, int]) -> str:
    known = [outcome for outcome in _OUTCOME_WORDS if outcome in outcomes]
    added = sorted(set(outcomes) - set(_OUTCOME_WORDS))  # an outcome counted since, by its label
    return ", ".join(f"{outcomes[o]:,} {_OUTCOME_WORDS.get(o, o)}" for o in known + added)


def _delivery_counts() -> dict[tuple[str, str], float]:
    """(subscription, outcome) → deliveries this process finished so far."""
    return {
        (sample.labels["subscription"], sample.labels["outcome"]): sample.value
        for family in metrics.DELIVERIES.collect()
        for sample in family.samples
        if sample.name.endswith("_total")
    }
