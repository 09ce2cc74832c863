"""Operator verbs: each parses its arguments, calls ``workqueue.operators`` and renders."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import shlex
import uuid
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from workqueue.cli import Verb
from workqueue.cli.output import table, to_json
from workqueue.logtext import log_text


class StatsVerb(Verb):
    name = "stats"
    help = "Per-subscription counts: pending, in flight, dead letters, blocked keys, ..."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        from workqueue.operators.operations import STATS_COUNT_MAX

        parser.add_argument(
            "-s",
            "--subscription",
            action="append",
            help="Only this subscription (repeat for several); all of them by default.",
        )
        parser.add_argument(
            "--cap",
            type=int,
            help=f"Count each figure up to N (1 to {STATS_COUNT_MAX}; default: the "
            "STATS_COUNT_CAP setting). A figure that stops there is marked with a note.",
        )

    def run(self, command: BaseCommand, options: dict[str, Any]) -> None:
        from workqueue.operators.operations import StatsReport, subscription_stats

        report = StatsReport([])
        for name in sorted(set(options["subscription"] or [None]), key=str):
            part = _operation_errors(lambda name=name: subscription_stats(name, cap=options["cap"]))
            report.subscriptions.extend(part.subscriptions)
            report.failures.extend(part.failures)
        self._write(command, options, report)
        if report.failures:
            # Scripts and monitors read the exit code: a report with rows missing failed.
            raise CommandError(
                f"Stats of {len(report.failures)} subscription(s) could not be read."
            )

    def _write(self, command: BaseCommand, options: dict[str, Any], report: Any) -> None:
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
                "-" if s.completed_last_hour is None else s.completed_last_hour,
                "-" if s.rate_limit_per_second is None else f"{s.rate_limit_per_second:g}/s",
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
            "RATE LIMIT",
        )
        command.stdout.write(table(rows, headers))
        capped = [s.subscription_name for s in report.subscriptions if s.capped]
        if capped:
            from workqueue.operators.operations import STATS_COUNT_MAX

            command.stdout.write(
                f"Counting stopped at the cap for {', '.join(capped)}: those figures are at "
                f"least what they say (--cap counts further, up to {STATS_COUNT_MAX})."
            )
        for failure in report.failures:
            command.stderr.write(f"{failure['subscription_name']}: {failure['error']}")


def _operation_errors(run: Any, *, in_batches: bool = False) -> Any:
    """Turn the operators' expected errors into CommandError (stderr, non-zero exit).
    ``in_batches``: the operation commits batch by batch (a bulk replay or discard)."""
    from workqueue.exceptions import (
        BulkOperationInterrupted,
        BulkOperationStopped,
        DeliveryBusyError,
        DriverError,
        InvalidInputError,
        NotFoundError,
        PermissionDeniedError,
        TransportUnavailableError,
        UnsupportedByTransportError,
    )

    try:
        return run()
    except (
        BulkOperationInterrupted,  # says what its committed batches did and what a re-run does
        DeliveryBusyError,
        InvalidInputError,
        NotFoundError,
        PermissionDeniedError,
        UnsupportedByTransportError,
    ) as exc:
        raise CommandError(str(exc)) from exc
    except (DriverError, TransportUnavailableError) as exc:
        if not in_batches:
            raise CommandError(str(exc)) from exc
        # Say what a re-run finds.
        # A failure after a batch committed is a BulkOperationInterrupted (above): here the
        # first batch failed (on the database, before changing anything; a cloud transport's
        # batch, made item by item, may have changed some).
        raise CommandError(
            f"{exc} (the first batch failed; running it again is safe, and --dry-run counts "
            "what is left)"
        ) from exc
    except KeyboardInterrupt as stop:
        if not in_batches:
            raise
        if isinstance(stop, BulkOperationStopped):  # after a batch committed: its counts
            raise CommandError(str(stop), returncode=130) from None
        raise CommandError(
            "Interrupted before a batch was known to be applied; running it again is safe, "
            "and --dry-run counts what is left.",
            returncode=130,
        ) from None


def _write_page_json(command: BaseCommand, page: Any) -> None:
    items = [dataclasses.asdict(i) for i in page.items]
    command.stdout.write(to_json({"items": items, "next_cursor": page.next_cursor}))


def _write_dead_letters_json(command: BaseCommand, page: Any) -> None:
    # Each payload decoded under "payload", in its place among the fields.
    items = [
        dict(_decoded_payload(name, value) for name, value in dataclasses.asdict(item).items())
        for item in page.items
    ]
    command.stdout.write(to_json({"items": items, "next_cursor": page.next_cursor}))


def _decoded_payload(name: str, value: Any) -> tuple[str, Any]:
    if name != "payload_json":
        return name, value
    return "payload", None if value is None else json.loads(value)


def _write_next_page_hint(command: BaseCommand, page: Any) -> None:
    if page.next_cursor:
        command.stdout.write(f"next page: --cursor {page.next_cursor}")


def _subscription_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-s", "--subscription", required=True)


class DeadLettersVerb(Verb):
    name = "dead-letters"
    help = "List a subscription's dead letters (oldest first), a page at a time."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        _subscription_argument(parser)
        parser.add_argument("--cursor", default=None)
        parser.add_argument("--page-size", type=int, default=None)

    def run(self, command: BaseCommand, options: dict[str, Any]) -> None:
        from workqueue.operators.operations import list_dead_letters

        page = _operation_errors(
            lambda: list_dead_letters(
                options["subscription"],
                cursor=options["cursor"],
                page_size=options["page_size"],
                # The table shows none: not read.
                payloads=options["json"],
            )
        )
        if options["json"]:
            _write_dead_letters_json(command, page)
            return
        from workqueue.operators.display import error_summary

        rows = [
            (
                i.delivery_id,
                # The message's key, which --key filters by: a subscription without partitions
                # keeps none on its deliveries.
                i.message_partition_key or "",
                i.attempts,
                i.reason or "",
                "yes" if i.blocks_key else "",
                i.dead_lettered_at,
                error_summary(i.last_error, width=80),
            )
            for i in page.items
        ]
        headers = (
            "DELIVERY",
            "KEY",
            "ATTEMPTS",
            "REASON",
            "BLOCKS KEY",
            "DEAD LETTERED AT",
            "LAST ERROR",
        )
        command.stdout.write(table(rows, headers))
        if page.items:
            # Ready to paste: the full id of the first dead letter in the next command. Quoted
            # for a shell: on a cloud queue the id is the message's own, which whoever may
            # send to the queue wrote (review helper-142: "x; curl ... | sh" ran on paste).
            command.stdout.write(
                "replay: "
                + shlex.join(
                    [
                        *("manage.py", "workqueue", "replay", "-s", options["subscription"]),
                        *("--delivery", log_text(str(page.items[0].delivery_id))),
                    ]
                )
            )
        _write_next_page_hint(command, page)


class PartitionsVerb(Verb):
    name = "partitions"
    help = "List a partitioned subscription's busy or blocked keys."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        _subscription_argument(parser)
        parser.add_argument("--condition", choices=["Idle", "InFlight", "Blocked"], default=None)
        parser.add_argument("--cursor", default=None)
        parser.add_argument("--page-size", type=int, default=None)

    def run(self, command: BaseCommand, options: dict[str, Any]) -> None:
        from workqueue.operators.operations import list_partitions

        page = _operation_errors(
            lambda: list_partitions(
                options["subscription"],
                condition=options["condition"],
                cursor=options["cursor"],
                page_size=options["page_size"],
            )
        )
        if options["json"]:
            _write_page_json(command, page)
            return
        now = timezone.now()
        rows = [
            (
                i.partition_key,
                i.condition,
                i.head_delivery_id,
                i.waiting_items,
                i.lease_owner or "-",
                _lease_end(i.lease_expires_at, now),
            )
            for i in page.items
        ]
        command.stdout.write(
            table(rows, ("KEY", "CONDITION", "HEAD DELIVERY", "WAITING", "HOLDER", "LEASE"))
        )
        _write_next_page_hint(command, page)


def _lease_end(expires_at: dt.datetime | None, now: dt.datetime) -> str:
    """When a lease ends, from this machine's clock: one long passed means a holder that
    stopped renewing (killed, cut off); lease expiry will hand its delivery back."""
    if expires_at is None:
        return "-"
    seconds = round((expires_at - now).total_seconds())
    if seconds >= 0:
        return f"ends in {seconds} s"
    return f"passed {-seconds // 60} min ago" if seconds <= -120 else f"passed {-seconds} s ago"


def _delivery_arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--delivery", help="The delivery's id.")
    which.add_argument(
        "--message",
        help="Its message's id instead (a Tasks API task's result id is its message id).",
    )


def _chosen_delivery(options: dict[str, Any]) -> str:
    """The delivery ``--delivery`` names, or the subscription's delivery of ``--message``
    (written back into ``options["delivery"]`` for the lines that name it)."""
    if options["message"] is None:
        return options["delivery"]
    from workqueue.models import Delivery
    from workqueue.operators.operations import _name, _subscription
    from workqueue.operators.permissions import CLI

    try:
        message_id = uuid.UUID(options["message"])
    except ValueError:
        raise CommandError(f"--message {options['message']!r} is not a message id.") from None
    # Checked and found as the operation itself will: a name it refuses, or no such one.
    subscription = _operation_errors(lambda: _subscription(_name(options["subscription"]), CLI))
    found = (
        Delivery.objects.filter(subscription=subscription, message_id=message_id)
        .values_list("id", flat=True)
        .first()
    )
    if found is None:
        raise CommandError(
            f"Subscription {options['subscription']} has no delivery of message "
            f"{options['message']}."
        )
    options["delivery"] = str(found)
    return options["delivery"]


class ReplayVerb(Verb):
    name = "replay"
    help = "Send a dead letter back to Pending (attempts reset; an Ordered head keeps its place)."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        _subscription_argument(parser)
        _delivery_arguments(parser)
        parser.add_argument("--note", default=None)

    def run(self, command: BaseCommand, options: dict[str, Any]) -> None:
        from workqueue.operators.operations import replay

        delivery = _chosen_delivery(options)
        outcome = _operation_errors(
            lambda: replay(options["subscription"], delivery, note=options["note"])
        )
        if options["json"]:
            command.stdout.write(to_json(dataclasses.asdict(outcome)))
        elif outcome.replayed:
            command.stdout.write(f"Replayed {options['delivery']}")
        else:
            # Not an error, as in the REST API (200, replayed false): replaying twice, or
            # after another operator did, leaves the same state, so scripts may retry freely.
            command.stdout.write(
                f"Nothing replayed: {options['delivery']} is not a dead letter of "
                f"{options['subscription']} (now, or any more)."
            )


class DiscardVerb(Verb):
    name = "discard"
    help = "Discard a Pending or dead-lettered delivery, or cancel a running one."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        _subscription_argument(parser)
        _delivery_arguments(parser)
        parser.add_argument("--reason", required=True)

    def run(self, command: BaseCommand, options: dict[str, Any]) -> None:
        from workqueue.operators.operations import discard

        delivery = _chosen_delivery(options)
        outcome = _operation_errors(
            lambda: discard(options["subscription"], delivery, reason=options["reason"])
        )
        if options["json"]:
            command.stdout.write(to_json(dataclasses.asdict(outcome)))
        elif outcome.holds_key:
            asked = "Cancel requested" if outcome.discarded else "A cancel was already requested"
            command.stdout.write(
                f"{asked}: {options['delivery']} completed in its handler's own transaction, "
                "and the handler still runs, holding the delivery's partition key. Its host tells "
                "it to stop; the key is free when it returns (or its lease runs out). The "
                "delivery stays Completed."
            )
        elif outcome.cancel_requested and not outcome.discarded:
            command.stdout.write(
                f"A cancel was already requested: {options['delivery']} is still running; it "
                "becomes Discarded when its handler returns, or when its lease runs out."
            )
        elif outcome.cancel_requested:
            command.stdout.write(
                f"Cancel requested: {options['delivery']} is running; its host stops it and "
                "it becomes Discarded."
            )
        elif outcome.discarded:
            command.stdout.write(f"Discarded {options['delivery']}")
        else:
            # Not an error, as in the REST API (200, discarded false); see ReplayVerb.
            command.stdout.write(
                f"Nothing discarded: {options['delivery']} is not a Pending, running or "
                f"dead-lettered delivery of {options['subscription']}."
            )


class BacklogVerb(Verb):
    name = "backlog"
    help = "Claimable and in-flight deliveries of a subscription (each capped at 1000)."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        _subscription_argument(parser)

    def run(self, command: BaseCommand, options: dict[str, Any]) -> None:
        from workqueue.operators.operations import backlog

        report = _operation_errors(lambda: backlog(options["subscription"]))
        if options["json"]:
            command.stdout.write(to_json(dataclasses.asdict(report)))
            return
        rows = [(report.claimable, report.in_flight, report.total, "yes" if report.capped else "")]
        command.stdout.write(table(rows, ("CLAIMABLE", "IN FLIGHT", "TOTAL", "CAPPED")))


class ValidateBindingsVerb(Verb):
    name = "validate-bindings"
    help = "Report configuration that would stop work from flowing (Errors and Warnings)."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--transport", default=None)

    def run(self, command: BaseCommand, options: dict[str, Any]) -> None:
        from workqueue.operators.operations import validate_bindings

        issues = _operation_errors(lambda: validate_bindings(options["transport"]))
        if options["json"]:
            command.stdout.write(to_json([dataclasses.asdict(i) for i in issues]))
        elif issues:
            command.stdout.write(
                table(
                    [(i.severity, i.subject, i.message) for i in issues],
                    ("SEVERITY", "SUBJECT", "MESSAGE"),
                )
            )
        else:
            command.stdout.write("No problems found.")
        if any(i.severity == "Error" for i in issues):
            raise CommandError("validate-bindings found errors.")


class MetricsVerb(Verb):
    name = "metrics"
    help = (
        "Print the Prometheus metrics once: the queue's gauges read from the database (this "
        "one-shot process has no runtime counters of its own). Exits 1 when they could not "
        "be read."
    )

    def run(self, command: BaseCommand, options: dict[str, Any]) -> None:
        from workqueue import metrics

        text, read = metrics.render_once()
        command.stdout.write(text.decode(), ending="")
        if not read:
            raise CommandError(
                "The queue's gauges could not be read from the database (the error is logged "
                "by workqueue.metrics); only this process's own counters were printed."
            )


OPERATOR_VERBS = [
    StatsVerb,
    MetricsVerb,
    DeadLettersVerb,
    PartitionsVerb,
    ReplayVerb,
    DiscardVerb,
    BacklogVerb,
    ValidateBindingsVerb,
]
