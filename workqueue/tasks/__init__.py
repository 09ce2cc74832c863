"""Django's Tasks API on the work queue: ``TASKS = {"default": {"BACKEND":
"workqueue.tasks.WorkQueueBackend"}}``. See the README, "Using Django's Tasks API"."""

from __future__ import annotations

from workqueue.tasks.backend import TaskEnqueueError, WorkQueueBackend

__all__ = ["TaskEnqueueError", "WorkQueueBackend"]
