"""``manage.py workqueue_host``: run subscriptions until SIGTERM/SIGINT, then drain."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from workqueue.conf import get_settings
from workqueue.exceptions import WorkQueueConfigurationError
from workqueue.runtime.host import Host, HostConfig
from workqueue.runtime.process import exit_now_if_abandoned, host_disabled, stop_on_signals


class Command(BaseCommand):
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
        parser.add_argument("--concurrency", type=int, default=None)

    def handle(self, *args: Any, **options: Any) -> None:
        if host_disabled():
            self.stdout.write("WORKQUEUE_DISABLE_HOST is set; not starting the host.")
            return
        stop = stop_on_signals()
        overrides = {}
        if options["concurrency"] is not None:
            overrides["concurrency"] = options["concurrency"]
        host = Host(HostConfig.from_settings(get_settings(), options["subscriptions"], **overrides))
        try:
            host.start()
        except WorkQueueConfigurationError as exc:
            raise CommandError(str(exc)) from exc
        for entry in host.health()["subscriptions"]:
            reason = f" ({entry['reason']})" if entry["reason"] else ""
            self.stdout.write(f"{entry['name']}: {entry['state']}{reason}")
        self.stdout.flush()
        try:
            stop.wait()
        finally:
            host.shutdown()
        exit_now_if_abandoned(host)
