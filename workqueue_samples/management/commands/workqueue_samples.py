"""``manage.py workqueue_samples seed``: create the sample topology (idempotent)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from workqueue_samples.topology import seed


class Command(BaseCommand):
    help = "Seed the sample topology: topic samples.hello and its three subscriptions."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=["seed"])

    def handle(self, *args: Any, **options: Any) -> None:
        created = seed()
        self.stdout.write("created " + ", ".join(created) if created else "already seeded")
