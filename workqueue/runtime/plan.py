"""A subscription's settings as one running consumer sees them (a snapshot of the row)."""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import Any

from workqueue.types import MAX_PAYLOAD_BYTES

logger = logging.getLogger(__name__)

# (subscription id, filter) pairs already reported as invalid by this process: a host re-plans
# every RECONCILE_INTERVAL_MS and would otherwise log the same problem each time.
_reported_filters: set[tuple[str, str]] = set()
_reported_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class SubscriptionPlan:
    subscription_id: str
    name: str
    topic_id: str
    topic_name: str
    handler_key: str
    partition_mode: str
    lease_seconds: int
    heartbeat_mode: str
    max_attempts: int
    backoff_base_seconds: int
    backoff_max_seconds: int
    max_processing_seconds: int | None
    #: Claims take tokens from the subscription's shared bucket first (its rate and burst are
    #: read by the database on each take, so changing them needs no restart).
    rate_limited: bool
    #: The subscription's transport (``Transport.driver_class``): where its consumer claims.
    driver_class: str = "Database"
    #: The topic's largest message: what deliveries claimed ahead may hold in memory each.
    max_payload_bytes: int = MAX_PAYLOAD_BYTES

    @classmethod
    def from_subscription(cls, subscription: Any) -> SubscriptionPlan:
        _report_invalid_filter(subscription)
        return cls(
            subscription_id=str(subscription.id),
            name=subscription.name,
            topic_id=str(subscription.topic_id),
            topic_name=subscription.topic.name,
            handler_key=subscription.handler_key.strip(),
            partition_mode=subscription.partition_mode,
            lease_seconds=subscription.lease_seconds,
            heartbeat_mode=subscription.heartbeat_mode,
            max_attempts=subscription.max_attempts,
            backoff_base_seconds=subscription.backoff_base_seconds,
            backoff_max_seconds=subscription.backoff_max_seconds,
            max_processing_seconds=subscription.max_processing_seconds,
            rate_limited=subscription.rate_limit_per_second is not None,
            driver_class=subscription.topic.transport.driver_class,
            max_payload_bytes=subscription.topic.max_payload_bytes,
        )


def heartbeat_interval_seconds(lease_seconds: float) -> float:
    """Renew well before expiry, and at least every 30 s whatever the lease length."""
    return min(lease_seconds / 3, 30.0)


def _report_invalid_filter(subscription: Any) -> None:
    """Log, once per process and filter, that a subscription to be run holds an invalid filter:
    the fan-out gives it no deliveries, and nothing else would tell its operators why."""
    problem = subscription.filter_problem()
    if problem is None:
        return
    key = (str(subscription.id), json.dumps(subscription.filter, sort_keys=True))
    with _reported_lock:
        if key in _reported_filters:
            return
        _reported_filters.add(key)
    logger.error(
        "Subscription %s matches no message: its stored filter is invalid (%s). Correct the "
        "filter in the admin; `manage.py workqueue validate-bindings` lists every subscription "
        "in this state.",
        subscription.name,
        problem,
    )
