"""``manage.py workqueue_sweep [--once]``: the sweeper alone."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from workqueue.conf import get_settings
from workqueue.runtime.process import stop_on_signals
from workqueue.runtime.sweeper import Sweeper


class Command(BaseCommand):
    help = "Expire passed leases and purge settled rows past retention, once or periodically."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--once", action="store_true", help="Run one pass and exit.")

    def handle(self, *args: Any, **options: Any) -> None:
        sweeper = Sweeper()
        if options["once"]:
            self._report(sweeper.run_once())
            return
        interval = max(get_settings().SWEEPER_INTERVAL_MS, 1000) / 1000
        with stop_on_signals() as stop:
            while True:
                self._report(sweeper.run_once())
                if stop.wait(interval):
                    return

    def _report(self, result: Any) -> None:
        if result.skipped:
            self.stdout.write("skipped: another sweeper holds the lock")
        else:
            purged = " ".join(f"{k}={v}" for k, v in result.purged.items())
            self.stdout.write(
                f"expired={result.expired} dead_lettered={result.expired_dead_letters} {purged}"
            )
        self.stdout.flush()
