"""The operator operations. Each validates its input before touching the queue, and returns
plain values from ``workqueue.types``."""

from __future__ import annotations

from dataclasses import dataclass, field

from workqueue import transport
from workqueue.types import SubscriptionStats

STATS_UNAVAILABLE = "Stats are unavailable for this subscription"


@dataclass(frozen=True, slots=True)
class StatsReport:
    subscriptions: list[SubscriptionStats]
    failures: list[dict[str, str]] = field(default_factory=list)


def subscription_stats(subscription_name: str | None = None) -> StatsReport:
    """Counts for one subscription (by name) or for all, sorted by name.

    A subscription whose stats cannot be read is listed under ``failures`` with a fixed
    message; the others are still reported.
    """
    # Imported here: operators read topology lazily so importing them stays cheap.
    from workqueue.models import Subscription

    queryset = Subscription.objects.order_by("name")
    if subscription_name is not None:
        queryset = queryset.filter(name=subscription_name.strip().lower())
    report = StatsReport([])
    for subscription in queryset:
        try:
            row = transport.subscription_stats(str(subscription.id))
        except Exception:
            report.failures.append(
                {"subscription_name": subscription.name, "error": STATS_UNAVAILABLE}
            )
            continue
        if row is None:
            continue
        report.subscriptions.append(
            SubscriptionStats(
                subscription_name=subscription.name,
                pending=row["pending"],
                in_flight=row["in_flight"],
                dead_lettered=row["dead_lettered"],
                blocked_keys=row["blocked_keys"],
                oldest_pending_age_seconds=row["oldest_pending_age_seconds"],
                completed_last_hour=row["completed_last_hour"],
                as_of=row["as_of"],
            )
        )
    return report
