from __future__ import annotations

from workqueue.models.apikeys import ApiKey
from workqueue.models.hosts import HostRecord
from workqueue.models.queue import Deduplication, Delivery, Message, RateLimitBucket, SweepLock
from workqueue.models.schedules import ScheduleRecord
from workqueue.models.tasks import TaskResult
from workqueue.models.topology import Subscription, Topic, Transport

__all__ = [
    "ApiKey",
    "Deduplication",
    "Delivery",
    "HostRecord",
    "Message",
    "RateLimitBucket",
    "ScheduleRecord",
    "Subscription",
    "SweepLock",
    "TaskResult",
    "Topic",
    "Transport",
]
