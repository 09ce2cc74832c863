"""Operator verbs: each parses its arguments, calls ``workqueue.operators`` and renders."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from workqueue.cli import Verb
from workqueue.cli.output import table, to_json


class StatsVerb(Verb):
    name = "stats"
    help = "Per-subscription counts: pending, in flight, dead letters, blocked keys, ..."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("-s", "--subscription", default=None)

    def run(self, command: BaseCommand, options: dict[str, Any]) -> None:
        from workqueue.operators.operations import subscription_stats

        report = subscription_stats(options["subscription"])
        if options["subscription"] and not report.subscriptions and not report.failures:
            raise CommandError(f"No subscription is named {options['subscription']!r}.")
        if options["json"]:
            command.stdout.write(
                to_json(
                    {
                        "subscriptions": [dataclasses.asdict(s) for s in report.subscriptions],
                        "failures": report.failures,
                    }
                )
            )
            return
        rows = [
            (
                s.subscription_name,
                s.pending,
                s.in_flight,
                s.dead_lettered,
                "-" if s.blocked_keys is None else s.blocked_keys,
                "-" if s.oldest_pending_age_seconds is None else s.oldest_pending_age_seconds,
                s.completed_last_hour,
            )
            for s in report.subscriptions
        ]
        headers = (
            "SUBSCRIPTION",
            "PENDING",
            "IN FLIGHT",
            "DEAD LETTERED",
            "BLOCKED KEYS",
            "OLDEST PENDING (S)",
            "COMPLETED (1H)",
        )
        command.stdout.write(table(rows, headers))
        for failure in report.failures:
            command.stderr.write(f"{failure['subscription_name']}: {failure['error']}")


OPERATOR_VERBS = [StatsVerb]
