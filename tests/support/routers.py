"""A database router for projects that keep the work queue on a database alias of its own."""

from __future__ import annotations

from typing import Any

QUEUE_ALIAS = "queue"


class WorkQueueAliasRouter:
    """Reads and writes the ``workqueue`` app's models on ``QUEUE_ALIAS``."""

    def db_for_read(self, model: type, **hints: Any) -> str | None:
        return QUEUE_ALIAS if model._meta.app_label == "workqueue" else None

    db_for_write = db_for_read

    def allow_relation(self, first: Any, second: Any, **hints: Any) -> bool:
        return True  # one database behind both aliases
