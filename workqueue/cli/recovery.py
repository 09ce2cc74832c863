"""Bulk recovery verbs: replay or discard every dead letter of a subscription that matches a
filter, after a dry run that counts them."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
from typing import Any

from django.core.management.base import BaseCommand
from django.utils import timezone

from workqueue.cli import Verb
from workqueue.cli.operators import _operation_errors, _subscription_argument
from workqueue.cli.output import to_json


def instant(text: str) -> dt.datetime:
    """An ISO 8601 date and time; without an offset it is read in the project's TIME_ZONE."""
    try:
        value = dt.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an ISO 8601 date and time, e.g. 2026-12-01T02:00:00Z"
        ) from None
    return value if value.tzinfo is not None else timezone.make_aware(value)


def _filter_arguments(parser: argparse.ArgumentParser, rows: str, timed: str) -> None:
    """The options every bulk verb shares: ``rows`` names what it acts on ("dead letters"),
    ``timed`` the moment --since and --until bound ("dead-lettered")."""
    parser.add_argument(
        "--key", dest="partition_key", default=None, help=f"Only {rows} of this partition key."
    )
    parser.add_argument(
        "--since", type=instant, default=None, help=f"Only {rows} {timed} at or after this time."
    )
    parser.add_argument(
        "--until", type=instant, default=None, help=f"Only {rows} {timed} before this time."
    )
    parser.add_argument(
        "--error-contains",
        default=None,
        help=f"Only {rows} whose last (failed attempt's) error contains this text.",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help=f"Count the matching {rows}; change nothing."
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=1000,
        help=f"{rows.capitalize()} per transaction (1..5000; default 1000).",
    )


class _ResolveDeadLettersVerb(Verb):
    action: str
    past_tense: str
    #: The option whose text is recorded on each changed delivery.
    note_option: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        _subscription_argument(parser)
        parser.add_argument(
            "--reason",
            dest="dead_letter_reason",
            default=None,
            help="Only dead letters with this reason (e.g. MaxAttemptsExceeded).",
        )
        _filter_arguments(parser, "dead letters", "dead-lettered")

    def run(self, command: BaseCommand, options: dict[str, Any]) -> None:
        from workqueue.operators.operations import DeadLetterSelection, resolve_dead_letters

        selection = DeadLetterSelection(
            reason=options["dead_letter_reason"],
            partition_key=options["partition_key"],
            dead_lettered_from=options["since"],
            dead_lettered_before=options["until"],
            error_contains=options["error_contains"],
        )
        outcome = _operation_errors(
            lambda: resolve_dead_letters(
                options["subscription"],
                self.action,
                selection,
                dry_run=options["dry_run"],
                note=options[self.note_option],
                batch_size=options["batch_size"],
            ),
            in_batches=True,
        )
        if options["json"]:
            command.stdout.write(to_json(dataclasses.asdict(outcome)))
        elif outcome.dry_run:
            command.stdout.write(
                f"Dry run: {outcome.matched} of {outcome.examined} dead letters of "
                f"{options['subscription']} match and would be {self.past_tense}."
            )
        elif outcome.matched == 0:
            # Nothing to do is not an error, as for a single replay or discard.
            command.stdout.write(f"Nothing {self.past_tense}: no dead letter matches.")
        else:
            command.stdout.write(
                f"{self.past_tense.capitalize()} {outcome.matched} of {outcome.examined} dead "
                f"letters of {options['subscription']} ({_batches(outcome.batches)})."
            )


class ReplayDeadLettersVerb(_ResolveDeadLettersVerb):
    name = "replay-dead-letters"
    help = (
        "Replay every dead letter of a subscription matching the filters (all of them without "
        "any); --dry-run counts them first."
    )
    action = "replay"
    past_tense = "replayed"
    note_option = "note"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("--note", default=None, help="Recorded on each replayed delivery.")


class DiscardDeadLettersVerb(_ResolveDeadLettersVerb):
    name = "discard-dead-letters"
    help = (
        "Discard every dead letter of a subscription matching the filters (all of them "
        "without any); --dry-run counts them first."
    )
    action = "discard"
    past_tense = "discarded"
    note_option = "discard_reason"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument(
            "--discard-reason",
            required=True,
            help="Why they are discarded; recorded on each delivery.",
        )


class DiscardPendingVerb(Verb):
    name = "discard-pending"
    help = (
        "Discard every waiting (Pending) delivery of a subscription matching the filters, so "
        "it never runs; running ones are left alone. --dry-run counts them first."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        _subscription_argument(parser)
        _filter_arguments(parser, "waiting deliveries", "published")
        parser.add_argument(
            "--discard-reason",
            required=True,
            help="Why they are discarded; recorded on each delivery.",
        )

    def run(self, command: BaseCommand, options: dict[str, Any]) -> None:
        from workqueue.operators.operations import PendingSelection, discard_pending

        selection = PendingSelection(
            partition_key=options["partition_key"],
            published_from=options["since"],
            published_before=options["until"],
            error_contains=options["error_contains"],
        )
        outcome = _operation_errors(
            lambda: discard_pending(
                options["subscription"],
                selection,
                reason=options["discard_reason"],
                dry_run=options["dry_run"],
                batch_size=options["batch_size"],
            ),
            in_batches=True,
        )
        if options["json"]:
            command.stdout.write(to_json(dataclasses.asdict(outcome)))
        elif outcome.dry_run:
            command.stdout.write(
                f"Dry run: {outcome.matched} of {outcome.examined} waiting deliveries of "
                f"{options['subscription']} match and would be discarded."
            )
        else:
            command.stdout.write(
                f"Discarded {outcome.matched} of {outcome.examined} waiting deliveries of "
                f"{options['subscription']} ({_batches(outcome.batches)})."
            )


def _batches(count: int) -> str:
    return f"{count} batch" if count == 1 else f"{count} batches"


RECOVERY_VERBS = [ReplayDeadLettersVerb, DiscardDeadLettersVerb, DiscardPendingVerb]
