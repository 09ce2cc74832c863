"""The work queue's own handlers, found by the host's autodiscovery like any app's: the Tasks
API handler (``workqueue.tasks``), so ``workqueue_host`` runs tasks with no configuration."""

from __future__ import annotations

from workqueue.tasks.handler import TaskHandler

__all__ = ["TaskHandler"]
