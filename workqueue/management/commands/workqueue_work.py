"""``manage.py workqueue_work -s NAME --once``: container-job mode.

Exit 0 when the host ran (empty queue, budget spent, duration reached, signal, paused
subscription); exit 2 when a requested subscription could not run (unknown,
HandlerNotRegistered, Unsupported, or Error as the run ended: a consumer that could not start,
claims that kept failing) or the configuration is wrong (planning failed included); exit 3 when
it ran but its drain left work behind (handlers that did not stop, outcomes the database did
not record), whose deliveries run again after their lease expires: a job reported successful
would hide a delivery held unfinished.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from workqueue.conf import get_settings
from workqueue.exceptions import WorkQueueConfigurationError
from workqueue.management.base import QueueCommand
from workqueue.runtime.host import Host, HostConfig, describe_subscription
from workqueue.runtime.process import (
    StopSignal,
    add_concurrency_argument,
    database_errors_explained,
    describe_drain,
    describe_left_behind,
    exit_now_if_work_left_behind,
    host_disabled,
    start_up_objects_frozen,
    stop_on_signals,
)


class Command(QueueCommand):
    help = "Process a subscription's deliveries once (for container jobs), then exit."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("-s", "--subscription", required=True, help="Name, or '*' for all.")
        parser.add_argument(
            "--once",
            action="store_true",
            required=True,
            help="Run until --max deliveries were received, the queue stays empty for "
            "--idle-exit-ms or --max-duration-ms passes; then drain and exit (required: the "
            "long-running host is workqueue_host).",
        )
        parser.add_argument(
            "--max", type=int, default=1, help="Deliveries to receive (≥ 1; default 1)."
        )
        add_concurrency_argument(
            parser,
            "Handlers at once (1 to 1,000). Default: the subscription's "
            "WORKQUEUE['SUBSCRIPTIONS'] entry, else the '*' entry, else 1.",
        )
        parser.add_argument(
            "--max-duration-ms",
            type=int,
            default=None,
            metavar="MS",
            help="Stop receiving after this long (≥ 1000), then drain and exit. Default: no limit.",
        )
        parser.add_argument(
            "--idle-exit-ms",
            type=int,
            default=5000,
            metavar="MS",
            help="Exit once nothing has been receivable for this long (default 5000).",
        )
        parser.add_argument(
            "--shutdown-drain-ms",
            type=int,
            default=30000,
            metavar="MS",
            help="On stopping, wait this long for running handlers, abort those left and wait "
            "as long again (default 30000).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if host_disabled():
            self.stdout.write("WORKQUEUE_DISABLE_HOST is set; not running.")
            return
        if not options["subscription"].strip():
            # An unset variable in a job template ($SUBSCRIPTION): it named nothing, ran
            # nothing and exited 0, as a job with nothing to do does.
            raise CommandError(
                "-s/--subscription is blank: name a subscription, or '*' for all.", returncode=2
            )
        if options["max"] < 1:
            raise CommandError("--max must be at least 1.")
        if options["max_duration_ms"] is not None and options["max_duration_ms"] < 1000:
            raise CommandError("--max-duration-ms must be at least 1000.")
        for option in ("idle_exit_ms", "shutdown_drain_ms"):
            if options[option] < 0:
                flag = "--" + option.replace("_", "-")
                raise CommandError(f"{flag} must be 0 or more.", returncode=2)
        config = HostConfig.from_settings(
            get_settings(),
            [options["subscription"]],
            concurrency=options["concurrency"],
            idle_poll_min_ms=250,
            idle_poll_max_ms=2000,
            shutdown_drain_ms=options["shutdown_drain_ms"],
            sweeper_interval_ms=0,
            reconcile_interval_ms=0,
        )
        # Built after the freeze, so that what the host makes while it runs is walked as usual.
        with stop_on_signals() as stop, start_up_objects_frozen():
            self._run(config, stop, options)

    def _run(self, config: HostConfig, stop: StopSignal, options: dict[str, Any]) -> None:
        host = Host(config)
        try:
            with database_errors_explained():
                result = host.run_once(
                    max_deliveries=options["max"],
                    idle_exit_ms=options["idle_exit_ms"],
                    max_duration_ms=options["max_duration_ms"],
                    stop_requested=stop,
                    on_started=self._print_plan,
                    on_stopping=lambda reason: self._print_stopping(
                        reason, host, config.shutdown_drain_ms
                    ),
                )
        except WorkQueueConfigurationError as exc:
            raise CommandError(str(exc), returncode=2) from exc
        why = f" ({stop.received})" if result.reason == "Shutdown" and stop.received else ""
        self.stdout.write(f"processed={result.processed} reason={result.reason}{why}")
        if host.left_work_behind:
            self.stdout.write(f"Stopped: {describe_left_behind(host)}")
        if result.planning_failure is not None:
            raise CommandError(
                f"Could not plan the subscriptions: {result.planning_failure}", returncode=2
            )
        failed = result.could_not_run
        if failed:
            details = "; ".join(f"{s['name']}: {s['state']} ({s['reason']})" for s in failed)
            raise CommandError(f"Could not run: {details}", returncode=2)
        exit_now_if_work_left_behind(host)

    def _print_stopping(self, reason: str, host: Host, shutdown_drain_ms: int) -> None:
        # An idle job announced a drain of up to twice 30 s with nothing to drain.
        running = sum(entry["in_flight"] for entry in host.health()["subscriptions"])
        drain = describe_drain(shutdown_drain_ms) if running else "no handler is running."
        self.stdout.write(f"Stopping ({reason}): {drain}")
        self.stdout.flush()

    def _print_plan(self, host: Host) -> None:
        for entry in host.health()["subscriptions"]:
            self.stdout.write(describe_subscription(entry))
        self.stdout.flush()
