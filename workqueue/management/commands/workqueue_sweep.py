"""``manage.py workqueue_sweep [--once]``: the sweeper alone."""

from __future__ import annotations

import logging
import time
from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db import close_old_connections

from workqueue.conf import get_settings
from workqueue.management.base import QueueCommand
from workqueue.runtime.process import (
    StopSignal,
    add_metrics_arguments,
    database_errors_explained,
    metrics_served,
    stop_on_signals,
)
from workqueue.runtime.service import OutageLog
from workqueue.runtime.sweeper import Sweeper, SweeperPassResult, pause_after

logger = logging.getLogger("workqueue.runtime.sweeper")


class Command(QueueCommand):
    help = (
        "Expire passed leases and purge settled rows past retention, periodically or, with "
        "--once, until caught up."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--once",
            action="store_true",
            help=(
                "Sweep and exit: one pass, and more while a pass stops at its limit with rows "
                "left, ending within SWEEPER_INTERVAL_MS (at least 1 s) of the start, so a job "
                "run at that interval does not overlap itself."
            ),
        )
        add_metrics_arguments(parser, "this sweeper's counters")

    def handle(self, *args: Any, **options: Any) -> None:
        sweeper = Sweeper()
        interval = max(get_settings().SWEEPER_INTERVAL_MS, 1000) / 1000
        if options["once"]:
            if options["metrics_port"] is not None:
                raise CommandError(
                    "--metrics-port serves a sweeper that keeps running; a --once run ends "
                    "before a scrape would find it. Leave out one of the two."
                )
            # No signal handlers of its own, as before: a single sweep may run on any thread
            # (call_command from a job), and Ctrl-C ends it as it ends any command.
            with database_errors_explained():
                self._sweep(sweeper, interval, StopSignal(), until=time.monotonic() + interval)
            return
        with (
            stop_on_signals() as stop,
            metrics_served(options["metrics_port"], options["metrics_address"]) as server,
        ):
            if server is not None:
                address, port = server.server_address[:2]
                self.stdout.write(f"Metrics: http://{address}:{port}/metrics")
            self._sweep(sweeper, interval, stop, until=None)

    def _sweep(
        self, sweeper: Sweeper, interval: float, stop: StopSignal, until: float | None
    ) -> None:
        """Pass after pass, an interval apart or sooner while behind, until ``stop`` is set;
        with ``until``, only while behind and not past that time."""
        failures = OutageLog("Sweeper", logger)
        while True:
            began = time.monotonic()
            if until is None:
                # As between a host's passes: a connection a database restart broke is closed
                # and opened afresh, not failed on for the process's whole life.
                close_old_connections()
            try:
                result = sweeper.run_once()
            except Exception as exc:
                if until is not None:
                    raise  # a --once job fails, and says why
                # As a host's sweeper does: a database restart must not end the sweeping.
                failures.failed(exc)
                if stop.wait(interval):
                    return
                continue
            failures.passed()
            self._report(result)
            if until is not None and result.failed_steps:
                # A job whose steps fail every time (a grant missing after an upgrade, a
                # statement timeout) must not report success while leases stop expiring.
                raise CommandError(
                    f"Sweeping failed: {', '.join(result.failed_steps)} (the errors are "
                    "logged above)."
                )
            took = time.monotonic() - began
            pause = pause_after(result, took, interval)
            # Another pass only if it can end in time, taking as long as this one did: a job
            # run every interval must not still be sweeping when the next one starts.
            if until is not None and (not result.behind or time.monotonic() + pause + took > until):
                return
            if stop.wait(pause):
                return

    def _report(self, result: SweeperPassResult) -> None:
        if result.skipped:
            self.stdout.write("skipped: another sweeper holds the lock")
        else:
            purged = " ".join(f"{k}={v}" for k, v in result.purged.items())
            left = " (rows left: another pass follows)" if result.behind else ""
            self.stdout.write(
                f"expired={result.expired} dead_lettered={result.expired_dead_letters} "
                f"{purged}{left}"
            )
        self.stdout.flush()
