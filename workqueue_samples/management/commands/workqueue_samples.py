"""``manage.py workqueue_samples seed``: create the sample topology (idempotent)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from workqueue.exceptions import WorkQueueError
from workqueue.management.base import QueueCommand
from workqueue_samples.demo import run_demo
from workqueue_samples.topology import seed


class Command(QueueCommand):
    help = (
        "seed: create the sample topology (topic samples.hello, three subscriptions; topic "
        "samples.guestbook, one); "
        "demo: seed, publish sample work and process it."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=["seed", "demo"])

    def handle(self, *args: Any, **options: Any) -> None:
        if options["action"] == "demo":
            try:
                run_demo(self.stdout.write)
            except WorkQueueError as exc:
                raise CommandError(str(exc)) from exc
            return
        created = seed()
        self.stdout.write("created " + ", ".join(created) if created else "already seeded")
