"""Topology verbs: apply the topology declared in code; retire a subscription."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from workqueue.cli import Verb
from workqueue.cli.output import to_json

_MARK = {"create": "+", "update": "~", "delete": "-", "refuse": "!", "keep": " "}


class SyncTopologyVerb(Verb):
    name = "sync-topology"
    help = (
        "Create and update the topics and subscriptions declared in WORKQUEUE['TOPOLOGY'] and "
        "print the difference (validated as in the admin; all or nothing)."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--dry-run", action="store_true", help="Validate and print the difference only."
        )
        parser.add_argument(
            "--prune",
            action="store_true",
            help="Also delete rows that are not declared (never one with deliveries or messages).",
        )

    def run(self, command: BaseCommand, options: dict[str, Any]) -> None:
        from workqueue.exceptions import WorkQueueConfigurationError
        from workqueue.operators.topology import TopologySyncError, sync_topology

        try:
            report = sync_topology(dry_run=options["dry_run"], prune=options["prune"])
        except (TopologySyncError, WorkQueueConfigurationError) as exc:
            raise CommandError(str(exc)) from exc
        if options["json"]:
            command.stdout.write(
                to_json(
                    {
                        "dry_run": report.dry_run,
                        "changes": [dataclasses.asdict(c) for c in report.changes],
                        "warnings": _handler_key_slips(),
                    }
                )
            )
        elif options["verbosity"] > 0:  # 0: a test's fixture applying it, say
            for change in report.changes:
                command.stdout.write(_describe(change))
            written = len(report.writes)
            if not written:
                command.stdout.write("No changes: the database matches the declared topology.")
            elif report.dry_run:
                command.stdout.write(f"Dry run: {written} change(s) validated, nothing written.")
            else:
                command.stdout.write(f"Applied {written} change(s).")
            for line in _handler_key_slips():
                command.stderr.write(line)
        if report.refused:
            raise CommandError(
                f"{len(report.refused)} undeclared row(s) could not be pruned; see above."
            )


def _describe(change: Any) -> str:
    line = f"{_MARK[change.action]} {change.kind} {change.name}"
    if change.action == "create":
        fields = ", ".join(f"{k}={new!r}" for k, (_, new) in change.fields.items())
        return f"{line} (new{': ' + fields if fields else ''})"
    if change.action == "update":
        return (
            line
            + ": "
            + "; ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in change.fields.items())
        )
    return f"{line}: {change.note}"


class RetireSubscriptionVerb(Verb):
    name = "retire-subscription"
    help = (
        "Disable a subscription, wait for its running deliveries, discard what waits (with "
        "--discard-pending), purge its settled deliveries and delete it."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("subscription", metavar="NAME")
        parser.add_argument(
            "--dry-run", action="store_true", help="Say what would be done; change nothing."
        )
        parser.add_argument(
            "--discard-pending",
            action="store_true",
            help="Discard its Pending and dead-lettered deliveries instead of refusing.",
        )
        parser.add_argument(
            "--wait-seconds",
            type=float,
            default=30.0,
            help="How long to wait for running deliveries (default 30).",
        )

    def run(self, command: BaseCommand, options: dict[str, Any]) -> None:
        from workqueue.exceptions import (
            InvalidInputError,
            NotFoundError,
            TransportUnavailableError,
            UnsupportedByTransportError,
        )
        from workqueue.operators.retire import RetireRefusedError, retire_subscription

        if options["wait_seconds"] < 0:
            raise CommandError("--wait-seconds must be 0 or more.")
        say = (lambda line: None) if options["json"] else command.stdout.write
        try:
            report = retire_subscription(
                options["subscription"],
                dry_run=options["dry_run"],
                discard_pending=options["discard_pending"],
                wait_seconds=options["wait_seconds"],
                say=say,
            )
        except (
            RetireRefusedError,
            NotFoundError,
            InvalidInputError,
            UnsupportedByTransportError,
            TransportUnavailableError,
        ) as exc:
            raise CommandError(str(exc)) from exc
        if options["json"]:
            command.stdout.write(to_json(dataclasses.asdict(report)))


class ProvisionVerb(Verb):
    name = "provision"
    help = (
        "Create or update the cloud resources (SNS topics, SQS queues, subscriptions) of the "
        "topics and subscriptions on cloud transports; idempotent."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--transport", help="Only this transport (by name).")
        parser.add_argument(
            "--dry-run", action="store_true", help="Print what would change; create nothing."
        )

    def run(self, command: BaseCommand, options: dict[str, Any]) -> None:
        from workqueue.exceptions import NotFoundError, WorkQueueError
        from workqueue.operators.topology import provision

        try:
            report = provision(options["transport"], dry_run=options["dry_run"])
        except (NotFoundError, WorkQueueError) as exc:
            raise CommandError(str(exc)) from exc
        if options["json"]:
            command.stdout.write(
                to_json(
                    {
                        "dry_run": report.dry_run,
                        "changes": {
                            name: [dataclasses.asdict(c) for c in found]
                            for name, found in report.changes.items()
                        },
                    }
                )
            )
            _refuse_if_any_refused(report)
            return
        for name, found in report.changes.items():
            for change in found:
                detail = f" ({change.detail})" if change.detail else ""
                command.stdout.write(f"{_MARK[change.action]} {change.kind} {change.name}{detail}")
            if not found:
                command.stdout.write(f"Nothing to provision for {name}.")
            elif all(c.action == "keep" for c in found):
                command.stdout.write(f"No changes: the resources of {name} match its topology.")
        if report.writes and report.dry_run:
            command.stdout.write(f"Dry run: {report.writes} change(s), nothing created.")
        elif report.writes:
            command.stdout.write(f"Applied {report.writes} change(s).")
        _refuse_if_any_refused(report)


def _refuse_if_any_refused(report: Any) -> None:
    """Exit non-zero when a resource was refused (its reason is printed above)."""
    refused = [c for found in report.changes.values() for c in found if c.action == "refuse"]
    if refused:
        raise CommandError(f"{len(refused)} resource(s) were not provisioned; see above.")


TOPOLOGY_VERBS = [SyncTopologyVerb, RetireSubscriptionVerb, ProvisionVerb]


def _handler_key_slips() -> list[str]:
    """A warning for each declared subscription whose handler key no handler of this project
    registers while one nearly does (check W004's rule: a key unlike every registered one may
    be another codebase's), said where the typo was applied (helper-158: only a separate
    ``check --database`` said it). The handler modules that import are read; one that does
    not (a web-only image without a worker's library) is the check's and the hosts' to report."""
    from workqueue.conf import get_settings
    from workqueue.operators.topology import declared_topology
    from workqueue.runtime.handlers import (
        app_handler_modules,
        handler_module_problems,
        handler_registry,
    )

    handler_module_problems((*app_handler_modules(), *get_settings().HANDLER_MODULES))
    slips = []
    for name, fields in declared_topology().get("subscriptions", {}).items():
        key = fields.get("handler_key")
        if not isinstance(key, str) or handler_registry.get(key) is not None:
            continue
        near = handler_registry.near(key)
        if near:
            slips.append(
                f"Warning: subscription {name!r} runs handler key {key!r}, which no handler of "
                f"this project registers; did you mean {' or '.join(map(repr, near))}?"
            )
    return slips
