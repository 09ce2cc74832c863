"""``manage.py workqueue_host``: run subscriptions until SIGTERM/SIGINT, then drain.

Exit 0 once stopped; exit 3 when the drain left work behind (handlers that did not stop,
outcomes the database did not record), whose deliveries run again after their lease expires,
as ``workqueue_work`` does: a supervisor can tell it from a clean stop."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from workqueue.conf import get_settings
from workqueue.exceptions import WorkQueueConfigurationError
from workqueue.management.base import QueueCommand
from workqueue.runtime.host import (
    Host,
    HostConfig,
    describe_subscription,
    start_and_stop_logged,
)
from workqueue.runtime.process import (
    StopSignal,
    add_concurrency_argument,
    add_metrics_arguments,
    database_errors_explained,
    describe_drain,
    describe_left_behind,
    exit_now_if_work_left_behind,
    host_disabled,
    metrics_served,
    start_up_objects_frozen,
    stop_on_signals,
)


class Command(QueueCommand):
    help = (
        "Run the work-queue host: the subscriptions in WORKQUEUE['SUBSCRIPTIONS'] (or -s), the "
        "sweeper and periodic re-planning. SIGTERM/SIGINT drain running work, then exit."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "-s",
            "--subscription",
            action="append",
            dest="subscriptions",
            metavar="NAME",
            help="Run this subscription (repeatable; '*' for all). Default: the settings.",
        )
        add_concurrency_argument(
            parser,
            "Handlers at once for every subscription this host runs (1 to 1,000). Default: "
            "each subscription's WORKQUEUE['SUBSCRIPTIONS'] entry, else the '*' entry, else 1.",
        )

        add_metrics_arguments(parser, "this host's counters")

    def handle(self, *args: Any, **options: Any) -> None:
        if host_disabled():
            self.stdout.write("WORKQUEUE_DISABLE_HOST is set; not starting the host.")
            return
        # The metrics server before the host starts: a port already taken fails the command
        # before any claim. The host is built after the freeze, so that what it makes while it
        # runs is walked as usual.
        with (
            stop_on_signals() as stop,
            metrics_served(options["metrics_port"], options["metrics_address"]) as server,
            start_up_objects_frozen(),
        ):
            self._run(stop, server, options)

    def _run(self, stop: StopSignal, server: Any, options: dict[str, Any]) -> None:
        host = Host(
            HostConfig.from_settings(
                get_settings(), options["subscriptions"], concurrency=options["concurrency"]
            ),
            # What the deliveries came to, now and then, where the logging would not say it
            # (a project without LOGGING shows no INFO line): -v 0 keeps the console quiet.
            console=self._console_line if options["verbosity"] >= 1 else None,
        )
        try:
            with database_errors_explained():
                host.start()
        except WorkQueueConfigurationError as exc:
            raise CommandError(str(exc)) from exc
        if not host.planned.is_set():
            # The first plan failed (the database away as the host started, or a fault the
            # log tells): the subscriptions are said once a plan goes through (the host plans
            # again, on a backoff while the database is away), as a readiness check waits for
            # them; a stop meanwhile says nothing more of them.
            self.stdout.write(
                f"Planning failed ({host.planning_failure}); planning again until a plan goes "
                "through"
            )
            self.stdout.flush()
            while not host.planned.is_set() and not stop.wait(0.2):
                pass
        # The host logs its start and stop with what these lines say: where the logging shows
        # them (the README's LOGGING) they are not printed too, or each was said twice.
        logged = start_and_stop_logged()
        if host.planned.is_set():
            if not logged:
                for entry in host.health()["subscriptions"]:
                    self.stdout.write(describe_subscription(entry))
            if server is not None:
                address, port = server.server_address[:2]
                self.stdout.write(f"Metrics: http://{address}:{port}/metrics")
            self.stdout.flush()
        try:
            stop.wait()
            if not logged:
                self.stdout.write(
                    f"{stop.received} received: stopped claiming; "
                    f"{describe_drain(host.config.shutdown_drain_ms)}"
                )
                self.stdout.flush()
        finally:
            host.shutdown(cause=stop.received)
        if not logged:
            self.stdout.write(f"Host stopped ({stop.received}); {describe_left_behind(host)}")
            self.stdout.flush()
        exit_now_if_work_left_behind(host)

    def _console_line(self, line: str) -> None:
        self.stdout.write(line)
        self.stdout.flush()
