"""The publish and apikey verbs."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from workqueue.cli import Verb
from workqueue.cli.output import table, to_json
from workqueue.driver.base import SCHEDULE_RECORD_TABLE

BATCH = 100


class PublishVerb(Verb):
    name = "publish"
    help = "Publish a message (or --count copies) to a topic."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--topic", required=True)
        # One of the two, as the usage line says: without either, a message of payload null
        # was published, and a forgotten --payload went unnoticed until a handler read it.
        body = parser.add_mutually_exclusive_group(required=True)
        body.add_argument(
            "--payload", default=None, help='JSON, e.g. \'{"name": "Ada"}\' (or null).'
        )
        body.add_argument(
            "--payload-ref",
            default=None,
            help="A claim-check reference instead of --payload, as JSON: "
            '\'{"uri": "s3://bucket/key", "content_type": "application/json", "size_bytes": 12, '
            '"checksum": "sha256:..."}\' (only uri is required; contentType etc. work too).',
        )
        parser.add_argument("--partition-key", default=None)
        parser.add_argument(
            "--attribute",
            action="append",
            default=[],
            metavar="NAME=VALUE",
            help="A message attribute (repeatable); subscription filters match on these.",
        )
        parser.add_argument("--dedup-key", default=None)
        parser.add_argument(
            "--not-before",
            default=None,
            help="Not delivered before this ISO 8601 time with an offset, e.g. "
            "2030-01-01T09:00:00+00:00 (at most the topic's retention ahead).",
        )
        parser.add_argument(
            "--delay", type=int, default=None, help="Not delivered before SECONDS from now."
        )
        parser.add_argument(
            "--priority",
            type=int,
            default=0,
            help="-100..100; higher is delivered first among due messages (default 0).",
        )
        parser.add_argument("--count", type=int, default=1)

    def run(self, command: BaseCommand, options: dict[str, Any]) -> None:
        from workqueue.exceptions import InvalidInputError, WorkQueueError
        from workqueue.publishing import publish_many, rejections_reported_by_caller
        from workqueue.runtime.process import unmigrated_problem

        payload = _json_option(options, "payload")
        payload_ref = _json_option(options, "payload_ref")
        count = options["count"]
        if count < 1:
            raise CommandError("--count must be at least 1.")
        message = {
            "payload": payload,
            "payload_ref": payload_ref,
            "partition_key": options["partition_key"],
            "attributes": _attributes(options["attribute"]),
            "deduplication_key": options["dedup_key"],
            "not_before": options["not_before"],
            "delay_seconds": options["delay"],
            "priority": options["priority"],
        }
        results = []
        started = time.monotonic()
        progress = _Progress(count, command.stderr) if count >= 1000 else None
        for offset in range(0, count, BATCH):
            try:
                with rejections_reported_by_caller():
                    results += publish_many(
                        options["topic"], [message] * min(BATCH, count - offset)
                    )
            except InvalidInputError as exc:
                # A value the database cannot store: refused before anything was published.
                raise CommandError(str(exc)) from None
            except WorkQueueError as exc:
                # The database refused the batch (a missing grant, say): nothing of it stored.
                # Its procedure missing because nobody ran `migrate` is told as that.
                done = f" ({len(results)} of {count} were published before it)" if results else ""
                raise CommandError(
                    unmigrated_problem(exc) or f"Publishing failed: {exc}{done}"
                ) from None
            if progress:
                progress.update(len(results))
        elapsed = max(time.monotonic() - started, 1e-9)
        if progress:
            progress.finish()
        rejected = [r for r in results if r.status == "Rejected"]
        if options["json"]:
            command.stdout.write(
                to_json(
                    [
                        {
                            "message_id": r.message_id,
                            "status": r.status,
                            "error": None if r.error is None else r.error.code,
                        }
                        for r in results
                    ]
                )
            )
        elif count == 1:
            if not rejected:  # a rejection is the error below, and nothing else
                command.stdout.write(f"{results[0].status} {results[0].message_id}")
        else:
            accepted = sum(r.accepted for r in results)
            command.stdout.write(
                f"Published {count}: {accepted} accepted, {count - accepted - len(rejected)} "
                f"duplicate, {len(rejected)} rejected in {elapsed:.2f}s "
                f"({count / elapsed:,.0f}/s)"
            )
        if rejected:
            first = rejected[0].error
            how_many = f"{len(rejected)} rejected: " if count > 1 else "Rejected: "
            raise CommandError(f"{how_many}{first.code}: {first.message}")


def _attributes(pairs: list[str]) -> dict[str, str] | None:
    attributes: dict[str, str] = {}
    for pair in pairs:
        name, equals, value = pair.partition("=")
        if not equals:
            raise CommandError(f"--attribute {pair!r} must be NAME=VALUE, e.g. region=eu.")
        if name in attributes:
            raise CommandError(f"--attribute {name} is given twice; give each name once.")
        attributes[name] = value
    # Publishing checks names and values, and rejects bad ones as InvalidAttributes.
    return attributes or None


def _json_option(options: dict[str, Any], name: str) -> Any:
    text = options[name]
    if text is None:
        return None
    option = f"--{name.replace('_', '-')}"
    try:
        return json.loads(text)
    except RecursionError:
        raise CommandError(f"{option} is JSON nested too deeply to read.") from None
    except ValueError as exc:
        raise CommandError(f"{option} is not valid JSON: {exc}") from None


class _Progress:
    """A one-line progress bar on stderr, redrawn in place."""

    def __init__(self, total: int, stream: Any) -> None:
        self.total = total
        self.stream = stream
        self.started = time.monotonic()

    def update(self, done: int) -> None:
        width = 30
        filled = int(width * done / self.total)
        rate = done / max(time.monotonic() - self.started, 1e-9)
        self.stream.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} {rate:,.0f}/s",
            ending="",
        )
        self.stream.flush()

    def finish(self) -> None:
        self.stream.write("")


class SchedulesVerb(Verb):
    name = "schedules"
    help = (
        "The recurring publishes of WORKQUEUE['SCHEDULES']: each one's publishable slot, "
        "whether a host has published it, and the next slot (database clock)."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--publish",
            action="store_true",
            help="First publish each schedule's due slot, as a host's scheduler does (once per "
            "slot across every host and run): for deployments without a long-running host, "
            "run it from cron every minute.",
        )

    def run(self, command: BaseCommand, options: dict[str, Any]) -> None:
        from django.db.models import Q

        from workqueue.conf import get_settings
        from workqueue.driver import get_driver
        from workqueue.exceptions import WorkQueueConfigurationError
        from workqueue.models import Deduplication, Message, ScheduleRecord
        from workqueue.scheduling import CronSearchError, load_schedules, recorded_slot_time
        from workqueue.types import DeduplicationStatus

        conf = get_settings()
        try:
            schedules = load_schedules(conf.SCHEDULES)
        except WorkQueueConfigurationError as exc:
            raise CommandError(str(exc)) from None
        if options["publish"]:
            from workqueue.runtime.scheduler import Scheduler

            refused = Scheduler(schedules).run_once().refused
        now = get_driver(conf.DATABASE_ALIAS).database_now()
        try:
            slots = {s.name: s.latest_slot(now) for s in schedules}
            next_slots = {s.name: s.next_slot_time(now) for s in schedules}
        except CronSearchError as exc:
            raise CommandError(str(exc)) from None
        own_ids = [i for slot in slots.values() if slot for i in slot.own_message_ids]
        # The unkeyed id of earlier releases (the last of a slot's) counts on the schedule's
        # own topic only: anyone may compute it and publish it elsewhere (audit helper-137).
        # The keyed ones count on any: a slot published before its schedule moved topic ran.
        own_messages = Q()
        for schedule in schedules:
            if slot := slots[schedule.name]:
                *keyed, unkeyed = slot.own_message_ids
                own_messages |= Q(id__in=keyed) | Q(topic__name=schedule.topic, id=unkeyed)
        published = (
            {
                str(message_id)
                for message_id in Message.objects.using(conf.DATABASE_ALIAS)
                .filter(own_messages)
                .values_list("id", flat=True)
            }
            if own_messages
            else set()
        )
        # Retention may purge a slot's message long before the slot stops being publishable (a
        # monthly slot, seven days' retention): the key the slot's publish confirmed still
        # says so, and keeps every host from publishing it again.
        keys = Q()
        for schedule in schedules:
            if slot := slots[schedule.name]:
                keys |= Q(topic__name=schedule.topic, deduplication_key=slot.deduplication_key)
        if keys:
            published.update(
                str(message_id)
                for message_id in Deduplication.objects.using(conf.DATABASE_ALIAS)
                .filter(keys, status=DeduplicationStatus.CONFIRMED, expires_at__gt=now)
                .filter(message_id__in=own_ids)
                .values_list("message_id", flat=True)
            )
        # A slot at or before the latest one a schedule published (under any definition) is
        # not published again (review helper-188).
        records = {
            name: (recorded_slot_time(at), digest)
            for name, at, digest in ScheduleRecord.objects.using(conf.DATABASE_ALIAS)
            .filter(name__in=list(slots))
            .values_list("name", "last_slot", "definition")
        }
        rows = []
        for s in schedules:
            slot = slots[s.name]
            skipped = _why_skipped(s, slot, published, records.get(s.name), now)
            rows.append(
                {
                    "name": s.name,
                    "cron": s.cron,
                    "timezone": s.timezone,
                    "topic": s.topic,
                    "slot": slot.at if slot else None,
                    # A task schedule's result is read by it (get_result): the id it was
                    # published under (a fallback key's, during a rotation), else the one it
                    # will be; none for a slot that is not published.
                    "message_id": None if skipped else _slot_message_id(slot, published),
                    "published": not skipped
                    and _counts_as_published(s, slot, published, records.get(s.name)),
                    "skipped": skipped,
                    "next_slot": next_slots[s.name],
                }
            )
        self._write(command, options, rows)
        if options["publish"] and refused:
            raise CommandError(
                "Not published: "
                + "; ".join(f"{name} ({why})" for name, why in sorted(refused.items()))
                + " (the errors are logged; the next run tries again)."
            )

    def _write(self, command: BaseCommand, options: dict[str, Any], rows: list[Any]) -> None:
        if options["json"]:
            command.stdout.write(to_json(rows))
            return
        command.stdout.write(
            table(
                [
                    (
                        r["name"],
                        r["cron"],
                        r["timezone"],
                        r["topic"],
                        r["slot"],
                        "yes"
                        if r["published"]
                        else ("skipped" if r["skipped"] else ("no" if r["slot"] else "")),
                        r["next_slot"],
                    )
                    for r in rows
                ],
                ("NAME", "CRON", "TIMEZONE", "TOPIC", "SLOT", "PUBLISHED", "NEXT SLOT"),
            )
        )
        for r in rows:
            if r["skipped"]:
                command.stdout.write(f"{r['name']}: skipped: {r['skipped']}")


def _counts_as_published(
    schedule: Any, slot: Any, published: set[str], record: tuple[Any, str] | None
) -> bool:
    """Whether ``slot`` was published: one of its ids is, or its schedule's record holds it
    under the definition it has now (its message and key purged since)."""
    if slot is None:
        return False
    if not published.isdisjoint(slot.own_message_ids):
        return True
    return record is not None and record == (slot.at, schedule.digest)


def _why_skipped(
    schedule: Any, slot: Any, published: set[str], record: tuple[Any, str] | None, now: Any
) -> str | None:
    """Why ``slot``, not published under any of its ids, never will be (its schedule's record
    holds it or a later slot: the scheduler's rule); None if it is published or may be."""
    if slot is None or record is None or not published.isdisjoint(slot.own_message_ids):
        return None
    last, digest = record
    if last is None or slot.at > last or (slot.at == last and digest == schedule.digest):
        return None
    if last > now:
        return (
            f"its record holds slot {last.isoformat()}, later than the database clock: no slot "
            f"is published until then (delete its row of {SCHEDULE_RECORD_TABLE} if that slot "
            "never ran)"
        )
    if slot.at < last:
        return f"a later slot, {last.isoformat()}, was published under an earlier definition"
    return "it was published under an earlier definition"


def _slot_message_id(slot: Any, published: set[str]) -> str | None:
    if slot is None:
        return None
    return next((i for i in slot.own_message_ids if i in published), slot.message_id)


class ApiKeyVerb(Verb):
    name = "apikey"
    help = "Create, list or revoke REST API keys."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        actions = parser.add_subparsers(dest="action", required=True)
        create = actions.add_parser("create", help="Create a key; it is printed once.")
        create.add_argument("--user", required=True, help="Owner's username; the key acts as it.")
        create.add_argument(
            "--scopes",
            nargs="+",
            required=True,
            help="workqueue:publish workqueue:read workqueue:operate",
        )
        create.add_argument("--topics", nargs="*", default=[])
        create.add_argument("--subscriptions", nargs="*", default=[])
        create.add_argument("--expires-days", type=int, default=None)
        create.add_argument("--name", default="")
        listing = actions.add_parser("list", help="List keys (prefix, owner, scopes, state).")
        for sub in (create, listing):
            sub.add_argument("--json", action="store_true", help="Print JSON for machines.")
        revoke = actions.add_parser("revoke", help="Revoke a key by its prefix.")
        revoke.add_argument("prefix", help="Its prefix, wq_<prefix> as logs show it, or the key.")

    def run(self, command: BaseCommand, options: dict[str, Any]) -> None:
        from django.contrib.auth import get_user_model

        from workqueue.models import ApiKey

        action = options["action"]
        if action == "create":
            User = get_user_model()
            owner = User._default_manager.filter(**{User.USERNAME_FIELD: options["user"]}).first()
            if owner is None:
                raise CommandError(f"No user is named {options['user']!r}.")
            try:
                key, raw = ApiKey.objects.issue(
                    owner,
                    options["scopes"],
                    name=options["name"],
                    topics=options["topics"],
                    subscriptions=options["subscriptions"],
                    expires_days=options["expires_days"],
                )
            except ValueError as exc:
                raise CommandError(str(exc)) from None
            if options["json"]:
                command.stdout.write(to_json({"key": raw, "prefix": key.prefix}))
            else:
                command.stdout.write(raw)
                print(
                    f"Key {key.prefix} created for {owner.get_username()}; it is shown only "
                    "once: store it now.",
                    file=sys.stderr,
                )
        elif action == "list":
            keys = ApiKey.objects.select_related("owner")
            if options["json"]:
                command.stdout.write(
                    to_json(
                        [
                            {
                                "prefix": k.prefix,
                                "owner": k.owner.get_username(),
                                "scopes": k.scopes,
                                "topics": k.topics,
                                "subscriptions": k.subscriptions,
                                "active": k.is_active,
                                "state": k.state,
                                "expires_at": k.expires_at,
                                "last_used_at": k.last_used_at,
                            }
                            for k in keys
                        ]
                    )
                )
                return
            rows = [
                (
                    k.prefix,
                    k.owner.get_username(),
                    " ".join(k.scopes),
                    " ".join(k.topics) or "any",
                    " ".join(k.subscriptions) or "any",
                    k.state,
                    k.last_used_at,
                )
                for k in keys
            ]
            command.stdout.write(
                table(
                    rows,
                    ("PREFIX", "OWNER", "SCOPES", "TOPICS", "SUBSCRIPTIONS", "STATE", "LAST USED"),
                )
            )
        else:
            key, prefix = ApiKey.objects.named(options["prefix"])
            if key is None:
                # Never the text given: it may be a secret (a key's, or another's).
                named = f"has the prefix {prefix!r}" if prefix else "is named by the text given"
                raise CommandError(
                    f"No API key {named}: give the prefix `apikey list` shows (8 hex digits), "
                    "wq_<prefix> as the audit trail shows it, or the whole key."
                )
            key.revoke()
            command.stdout.write(f"Revoked {key.prefix}.")


PUBLISHING_VERBS = [PublishVerb, SchedulesVerb, ApiKeyVerb]
