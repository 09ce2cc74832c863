"""What the queue's management commands share."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand


class QueueCommand(BaseCommand):
    """A queue command, whose system checks read no database.

    From Django 6.1 on, a command's checks hand every database alias to the model checks, and a
    JSONField's check asks its alias for the database's features: on SQL Server that is a
    connection, made before the command can retry it or say in one line what failed (a host
    starting before its database, a job against one that is down died in a traceback instead).
    Django 5.2 ran no database check here either; ``manage.py check --database`` still runs
    them all.
    """

    def get_check_kwargs(self, options: dict[str, Any]) -> dict[str, Any]:
        return {**super().get_check_kwargs(options), "databases": []}
