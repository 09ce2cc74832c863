"""Bulk recovery after an outage: replay or discard every dead letter of a subscription that
matches a filter (reason, partition key, time window, error text), after a dry run that counts
them, in bounded batches, from the CLI, the REST API and the admin, with the permission rules of
the single-delivery operations. Replayed Ordered heads keep their keys' order.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from django.contrib import messages
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections
from django.urls import reverse
from django.utils import timezone

from tests.factories import ApiKeyFactory, SubscriptionFactory
from tests.support.database import psycopg_params
from tests.support.roles import acting_as_granted_role
from tests.support.seeding import seed_deliveries
from workqueue import publish
from workqueue.driver import get_driver
from workqueue.exceptions import BulkOperationStopped, InvalidInputError, PermissionDeniedError
from workqueue.models import Delivery, Subscription
from workqueue.operators import operations
from workqueue.operators.operations import DeadLetterSelection, resolve_dead_letters
from workqueue.operators.permissions import OPERATE, READ, Actor
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")


def dead_letters(subscription: Subscription, *specs: dict[str, Any]) -> list[str]:
    """Publish one message per spec and dead-letter its delivery with the spec's reason and
    error (and partition key); the delivery ids, in the order given."""
    receiver = Receiver(subscription.id)
    ids = []
    for spec in specs:
        publish(subscription.topic.name, {"n": len(ids)}, partition_key=spec.get("key"))
        (claimed,) = receiver.receive(1).deliveries
        reason, error = spec.get("reason", "Poison"), spec.get("error", "ValueError: boom")
        assert receiver.dead_letter(claimed, reason, error).settled
        ids.append(claimed.delivery_id)
    return ids


def statuses(ids: list[str]) -> list[str]:
    found = dict(Delivery.objects.filter(pk__in=ids).values_list("pk", "status"))
    return [found[uuid_of(i)] for i in ids]


def uuid_of(text: str) -> Any:
    import uuid

    return uuid.UUID(str(text))


def outage(subscription: Subscription) -> dict[str, list[str]]:
    """Dead letters of one subscription: an hour-old batch, then this outage's, of two reasons
    and two error texts and keys."""
    old = dead_letters(subscription, {"reason": "MaxAttemptsExceeded", "error": "Timeout: api"})
    get_driver().shift_time(3600, subscription_id=str(subscription.id))
    timeouts = dead_letters(
        subscription,
        *[{"reason": "MaxAttemptsExceeded", "error": "TimeoutError: payments API"}] * 3,
    )
    keyed = dead_letters(
        subscription, {"reason": "MaxAttemptsExceeded", "error": "TimeoutError", "key": "c-7"}
    )
    poison = dead_letters(subscription, *[{"reason": "Poison", "error": "KeyError: 'sku'"}] * 2)
    return {"old": old, "timeouts": timeouts, "keyed": keyed, "poison": poison}


# -- the operation --------------------------------------------------------------------------


def test_a_dry_run_counts_exactly_what_each_filter_selects_and_changes_nothing():
    subscription = SubscriptionFactory()
    rows = outage(subscription)
    everything = [i for ids in rows.values() for i in ids]
    since = timezone.now() - dt.timedelta(minutes=30)

    def count(**selection: Any) -> int:
        outcome = resolve_dead_letters(
            subscription.name, "replay", DeadLetterSelection(**selection), dry_run=True
        )
        assert outcome.dry_run and outcome.examined == len(everything)
        return outcome.matched

    assert count() == 7
    assert count(reason="maxattemptsexceeded") == 5  # any case
    assert count(reason="Poison") == 2
    assert count(partition_key="c-7") == 1
    assert count(partition_key="C-7") == 0  # keys compare exactly
    assert count(dead_lettered_from=since) == 6
    assert count(dead_lettered_before=since) == 1
    assert count(error_contains="timeouterror") == 4
    assert count(reason="MaxAttemptsExceeded", dead_lettered_from=since, error_contains="API") == 3
    assert set(statuses(everything)) == {"DeadLettered"}


def test_the_time_window_takes_its_start_and_leaves_out_its_end():
    """[from, before): a dead letter stamped exactly at ``before`` is the next window's. No test
    put a row on either bound, so ``<=`` for the end went unseen (helper-103)."""
    subscription = SubscriptionFactory()
    (first, second) = dead_letters(subscription, {}, {})
    at = Delivery.objects.get(pk=uuid_of(second)).dead_lettered_at

    def selected(**window: Any) -> int:
        return resolve_dead_letters(
            subscription.name, "replay", DeadLetterSelection(**window), dry_run=True
        ).matched

    at_first = Delivery.objects.get(pk=uuid_of(first)).dead_lettered_at
    assert at_first < at  # two stamps, so each bound has one row on it and one off it
    assert selected(dead_lettered_from=at) == 1
    assert selected(dead_lettered_before=at) == 1
    assert selected(dead_lettered_from=at_first, dead_lettered_before=at) == 1


def test_a_bulk_replay_changes_exactly_the_matching_dead_letters_batch_by_batch_and_records_who():
    subscription = SubscriptionFactory()
    rows = outage(subscription)
    other = SubscriptionFactory(topic=subscription.topic)  # same messages, other subscription
    [other_dead] = dead_letters(other, {"reason": "MaxAttemptsExceeded", "error": "TimeoutError"})
    waiting = publish(subscription.topic.name, {"n": "pending"}).message_id
    operator = User.objects.create_user("night-operator")
    # Operating, and reading: a filter on the error text tells what reading would.
    operator.user_permissions.set(
        Permission.objects.filter(codename__in=["operate_subscription", "view_delivery"])
    )
    operator = User.objects.get(pk=operator.pk)  # permissions are cached per instance

    outcome = resolve_dead_letters(
        subscription.name,
        "replay",
        DeadLetterSelection(error_contains="TimeoutError"),
        note="payments API back up",
        batch_size=2,
        actor=Actor(user=operator),
    )

    assert (outcome.matched, outcome.examined) == (4, 7)
    # Seven dead letters in batches of two: four full or partial batches, each its own call.
    assert outcome.batches == 4
    replayed = rows["timeouts"] + rows["keyed"]
    assert statuses(replayed) == ["Pending"] * 4
    assert statuses(rows["old"] + rows["poison"]) == ["DeadLettered"] * 3
    assert statuses([other_dead]) == ["DeadLettered"]
    assert Delivery.objects.get(message_id=waiting, subscription=subscription).status == "Pending"
    for delivery in Delivery.objects.filter(pk__in=replayed):
        assert (delivery.attempt_count, delivery.is_replay) == (0, True)
        assert delivery.resolved_by == "night-operator"
        assert delivery.resolution_note == "payments API back up"
        assert delivery.dead_letter_reason is None


def test_a_bulk_discard_needs_a_reason_and_discards_only_the_matching_dead_letters():
    subscription = SubscriptionFactory()
    rows = outage(subscription)

    with pytest.raises(InvalidInputError, match="reason is required"):
        resolve_dead_letters(subscription.name, "discard", DeadLetterSelection(reason="Poison"))
    outcome = resolve_dead_letters(
        subscription.name, "discard", DeadLetterSelection(reason="Poison"), note="bad SKUs"
    )

    assert outcome.matched == 2
    assert statuses(rows["poison"]) == ["Discarded"] * 2
    assert set(statuses(rows["old"] + rows["timeouts"] + rows["keyed"])) == {"DeadLettered"}
    assert set(
        Delivery.objects.filter(pk__in=rows["poison"]).values_list("resolution_note", flat=True)
    ) == {"bad SKUs"}


@pytest.mark.parametrize(
    ("selection", "batch_size", "error"),
    [
        (DeadLetterSelection(dead_lettered_from=dt.datetime(2026, 1, 1)), 1000, "UTC offset"),
        (
            DeadLetterSelection(
                dead_lettered_from=dt.datetime(2026, 2, 1, tzinfo=dt.UTC),
                dead_lettered_before=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
            ),
            1000,
            "earlier than",
        ),
        (DeadLetterSelection(partition_key="k" * 201), 1000, "partition_key"),
        (DeadLetterSelection(error_contains="a\x00b"), 1000, "error_contains"),
        (DeadLetterSelection(), 0, "batch_size"),
        (DeadLetterSelection(), 5001, "batch_size"),
    ],
)
def test_bad_selections_are_refused_before_anything_changes(selection, batch_size, error):
    subscription = SubscriptionFactory()
    ids = dead_letters(subscription, {})

    with pytest.raises(InvalidInputError, match=error):
        resolve_dead_letters(subscription.name, "replay", selection, batch_size=batch_size)

    assert statuses(ids) == ["DeadLettered"]


def test_replaying_many_ordered_heads_lets_each_key_resume_in_publish_order():
    subscription = SubscriptionFactory(partition_mode="Ordered", max_attempts=1)
    receiver = Receiver(subscription.id)
    published: dict[str, list[str]] = {}
    for key in ("a", "b", "c"):
        for n in range(3):
            message = publish(subscription.topic.name, {"n": n}, partition_key=key).message_id
            published.setdefault(key, []).append(str(message))
    # Each key's head fails for good: the key is blocked behind it.
    heads = receiver.receive(10).deliveries
    assert sorted(d.partition_key for d in heads) == ["a", "b", "c"]
    for head in heads:
        assert receiver.dead_letter(head, "MaxAttemptsExceeded", "down").settled
    assert receiver.receive(10).deliveries == []

    outcome = resolve_dead_letters(subscription.name, "replay", DeadLetterSelection())

    assert outcome.matched == 3
    completed: dict[str, list[str]] = {}
    for _ in range(20):
        claimed = receiver.receive(10).deliveries
        if not claimed:
            break
        for delivery in claimed:
            completed.setdefault(delivery.partition_key, []).append(str(delivery.message_id))
        assert all(r.settled for r in receiver.complete_many(claimed).values())
    assert completed == published


def test_a_caller_without_operate_may_not_even_dry_run():
    subscription = SubscriptionFactory()
    ids = dead_letters(subscription, {})
    reader = User.objects.create_user("reader")
    reader.user_permissions.set(Permission.objects.filter(codename="view_delivery"))

    with pytest.raises(PermissionDeniedError):
        resolve_dead_letters(
            subscription.name,
            "replay",
            DeadLetterSelection(),
            dry_run=True,
            actor=Actor(user=User.objects.get(pk=reader.pk)),
        )
    assert statuses(ids) == ["DeadLettered"]


# -- the CLI --------------------------------------------------------------------------------


def run(*argv: str) -> str:
    out = io.StringIO()
    call_command("workqueue", *argv, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def test_the_cli_counts_first_then_replays_and_discards_by_filter():
    subscription = SubscriptionFactory()
    rows = outage(subscription)
    since = (timezone.now() - dt.timedelta(minutes=30)).isoformat()

    counted = run(
        "replay-dead-letters",
        "-s",
        subscription.name,
        "--since",
        since,
        "--error-contains",
        "payments",
        "--dry-run",
    )
    assert f"Dry run: 3 of 7 dead letters of {subscription.name} match" in counted
    assert set(statuses(rows["timeouts"])) == {"DeadLettered"}

    replayed = json.loads(
        run(
            "replay-dead-letters",
            "-s",
            subscription.name,
            "--since",
            since,
            "--error-contains",
            "payments",
            "--note",
            "API back",
            "--json",
        )
    )
    assert replayed == {
        "supported": True,
        "action": "replay",
        "dry_run": False,
        "matched": 3,
        "examined": 7,
        "batches": 1,
    }
    assert statuses(rows["timeouts"]) == ["Pending"] * 3

    with pytest.raises(CommandError, match="--discard-reason"):
        run("discard-dead-letters", "-s", subscription.name, "--reason", "Poison")
    discarded = run(
        "discard-dead-letters",
        "-s",
        subscription.name,
        "--reason",
        "Poison",
        "--discard-reason",
        "bad SKUs",
    )
    assert f"Discarded 2 of 4 dead letters of {subscription.name} (1 batch)." in discarded
    assert statuses(rows["poison"]) == ["Discarded"] * 2
    # Nothing to do is not an error (exit 0), as for a single replay.
    nothing = run("replay-dead-letters", "-s", subscription.name, "--key", "nobody")
    assert "Nothing replayed: no dead letter matches." in nothing
    with pytest.raises(CommandError, match="not an ISO 8601 date and time"):
        run("replay-dead-letters", "-s", subscription.name, "--since", "yesterday")


# -- the REST API ---------------------------------------------------------------------------


def post(client: Any, path: str, body: Any, key: Any) -> Any:
    return client.post(
        f"/work-queue{path}",
        data=json.dumps(body),
        content_type="application/json",
        headers={"X-API-Key": key.raw_key},
    )


def test_a_bulk_operation_the_database_refuses_fails_with_its_error_not_a_traceback(pg_conn):
    """A DriverError (here: the role may not run the procedure) left the command as a raw
    traceback; it exits 1 naming the error and what a re-run finds."""
    subscription = SubscriptionFactory()
    ids = dead_letters(subscription, {})
    with (
        acting_as_granted_role(
            pg_conn, "wq_ops", "grant-operator", revoked=["wq_resolve_dead_letters"]
        ),
        pytest.raises(CommandError, match=r"permission denied.*running it again is safe"),
    ):
        run("replay-dead-letters", "-s", subscription.name)

    assert statuses(ids) == ["DeadLettered"]


def test_the_rest_api_replays_and_discards_by_filter_with_the_operate_scope(client):
    """The operate scope acts; filters on what the dead letters hold (error text, key,
    reason) need the read scope too (tests/api/test_operator_api_security.py)."""
    subscription = SubscriptionFactory()
    rows = outage(subscription)
    path = f"/subscriptions/{subscription.name}/dead-letters"
    operator = ApiKeyFactory(scopes=[OPERATE, READ])
    since = (timezone.now() - dt.timedelta(minutes=30)).isoformat()

    refused = post(client, f"{path}/replay", {}, ApiKeyFactory(scopes=[READ]))
    elsewhere = post(
        client, f"{path}/replay", {}, ApiKeyFactory(scopes=[OPERATE], subscriptions=["x"])
    )
    assert (refused.status_code, elsewhere.status_code) == (403, 403)
    assert post(client, f"{path}/replay", {"filter": {"reason": "x"}}, operator).status_code in (
        400,
        422,
    )  # a misspelt filter field is refused, never ignored
    naive = post(
        client, f"{path}/replay", {"filter": {"deadLetteredFrom": "2026-01-01T00:00"}}, operator
    )
    assert naive.status_code == 400 and "UTC offset" in naive.content.decode()

    body = {"filter": {"deadLetteredFrom": since, "errorContains": "payments"}, "dryRun": True}
    counted = post(client, f"{path}/replay", body, operator)
    assert counted.status_code == 200, counted.content
    assert counted.json() == {
        "supported": True,
        "action": "replay",
        "dryRun": True,
        "matched": 3,
        "examined": 7,
        "batches": 1,
    }
    assert set(statuses(rows["timeouts"])) == {"DeadLettered"}

    replayed = post(
        client, f"{path}/replay", {**body, "dryRun": False, "note": "API back"}, operator
    )
    assert replayed.json()["matched"] == 3
    assert statuses(rows["timeouts"]) == ["Pending"] * 3
    history = LogEntry.objects.get(object_id=str(subscription.pk))
    assert "Replayed 3 dead letters through the REST API" in history.change_message

    no_reason = post(
        client, f"{path}/discard", {"filter": {"deadLetterReason": "Poison"}}, operator
    )
    assert no_reason.status_code in (400, 422)
    discarded = post(
        client,
        f"{path}/discard",
        {"filter": {"deadLetterReason": "Poison"}, "reason": "bad SKUs"},
        operator,
    )
    assert discarded.json()["matched"] == 2
    assert statuses(rows["poison"]) == ["Discarded"] * 2


# -- the admin ------------------------------------------------------------------------------


def staff(username: str, *codenames: str) -> User:
    user = User.objects.create_user(username, password="pw", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="workqueue", codename__in=codenames)
    )
    return user


def as_recovery_operator(client: Any, subscription: Subscription, **fields: Any) -> dict[str, Any]:
    """Sign a staff user who may operate subscriptions in; the recovery action's form for
    ``subscription`` with ``fields``."""
    client.force_login(
        staff("operator", "view_subscription", "view_delivery", "operate_subscription")
    )
    return {"action": "recover_dead_letters", "_selected_action": [subscription.pk], **fields}


def test_the_admin_counts_by_a_time_window_without_use_tz(client, settings):
    """Review helper-190: with ``USE_TZ = False`` the admin form's times came without a zone,
    which the operation refuses ("must be a date and time with its UTC offset"): every count
    and apply by a time window failed. They are read in the current time zone, as the CLI
    reads ``--since``."""
    settings.USE_TZ = False
    subscription = SubscriptionFactory()
    ids = dead_letters(subscription, {"reason": "Poison"}, {"reason": "Poison"})
    url = reverse("admin:workqueue_subscription_changelist")
    form = as_recovery_operator(client, subscription, operation="replay", post="count")

    counted = client.post(url, {**form, "since": "2000-01-01 00:00:00"})

    assert counted.context["form"].errors == {}
    assert counted.context["counts"] == [
        (subscription.name, "2 of 2 dead letters would be replayed")
    ]
    assert set(statuses(ids)) == {"DeadLettered"}


def test_the_admin_refuses_a_blank_reason_filter_as_rest_and_the_cli_do(client):
    """Review helper-190: the admin trimmed a reason filter of spaces into no filter, so its
    count, and the Apply after it, took every dead letter; REST and the CLI refuse it."""
    subscription = SubscriptionFactory()
    dead_letters(subscription, {"reason": "Poison"}, {"reason": "MaxAttemptsExceeded"})
    url = reverse("admin:workqueue_subscription_changelist")
    form = as_recovery_operator(client, subscription, operation="discard", note="x")

    counted = client.post(url, {**form, "post": "count", "dead_letter_reason": "   "})

    assert "dead_letter_reason" in counted.context["form"].errors


def test_the_subscription_admin_counts_then_replays_every_matching_dead_letter(client):
    subscription = SubscriptionFactory()
    rows = outage(subscription)
    url = reverse("admin:workqueue_subscription_changelist")
    client.force_login(staff("viewer", "view_subscription", "view_delivery"))
    actions = client.get(url).context["action_form"]  # None: no action is offered at all
    assert actions is None or "recover_dead_letters" not in dict(actions.fields["action"].choices)

    form = as_recovery_operator(client, subscription, dead_letter_reason="Poison")
    page = client.post(url, {**form, "index": "0"})
    assert page.status_code == 200 and "Count (dry run)" in page.content.decode()
    counted = client.post(url, {**form, "operation": "replay", "post": "count"})
    assert counted.status_code == 200
    assert counted.context["form"].errors == {}
    assert counted.context["counts"] == [
        (subscription.name, "2 of 7 dead letters would be replayed")
    ]
    assert set(statuses(rows["poison"])) == {"DeadLettered"}

    fingerprint = counted.context["counted"]

    # Filters edited after the count: Apply would have replayed all 7 while the page said 2.
    widened = client.post(
        url,
        {
            **form,
            "dead_letter_reason": "",
            "operation": "replay",
            "post": "apply",
            "counted": fingerprint,
        },
    )
    assert widened.status_code == 200
    assert "not the ones counted" in str(widened.context["form"].non_field_errors())
    assert set(statuses(rows["poison"] + rows["timeouts"])) == {"DeadLettered"}

    applied = client.post(
        url,
        {**form, "operation": "replay", "post": "apply", "note": "fixed", "counted": fingerprint},
        follow=True,
    )
    assert applied.status_code == 200
    assert statuses(rows["poison"]) == ["Pending"] * 2
    assert set(statuses(rows["timeouts"])) == {"DeadLettered"}
    assert any("2 of 7 dead letters were replayed" in str(m) for m in applied.context["messages"])

    extra = waiting(subscription, 3, key="flood")
    form = {**form, "dead_letter_reason": "", "partition_key": "flood", "note": "flood"}
    pending = {**form, "operation": "discard_pending"}
    fingerprint = client.post(url, {**pending, "post": "count"}).context["counted"]
    discarded = client.post(url, {**pending, "post": "apply", "counted": fingerprint})
    assert discarded.status_code == 302
    assert statuses(extra) == ["Discarded"] * 3
    assert statuses(rows["poison"]) == ["Pending"] * 2  # replayed above: no "flood" key


def test_an_admin_operator_who_may_not_read_counts_by_time_but_not_by_content(client):
    """Review helper-143: the recovery form's count answered a user who may operate but not
    read how many dead letters held an error text, reading them a character at a time."""
    subscription = SubscriptionFactory()
    outage(subscription)
    url = reverse("admin:workqueue_subscription_changelist")
    client.force_login(staff("blind-operator", "view_subscription", "operate_subscription"))
    form = {"action": "recover_dead_letters", "_selected_action": [subscription.pk]}

    probed = client.post(
        url, {**form, "operation": "replay", "post": "count", "error_contains": "payments"}
    )
    everything = client.post(url, {**form, "operation": "replay", "post": "count"})

    [(name, said)] = probed.context["counts"]
    assert name == subscription.name
    assert (
        said.startswith("refused: A filter on what the deliveries hold") and "view_delivery" in said
    )
    assert everything.context["counts"] == [
        (subscription.name, "7 of 7 dead letters would be replayed")
    ]


@pytest.mark.parametrize(
    ("field", "counted_with"),
    [
        ("dead_letter_reason", "Poison"),
        ("partition_key", "k"),
        ("error_contains", "boom"),
        ("since", "2000-01-01T00:00:00+00:00"),
        ("before", "2100-01-01T00:00:00+00:00"),
    ],
)
def test_the_admin_applies_nothing_but_the_selection_it_counted(client, field, counted_with):
    """Every filter is part of what Apply must match: with the time window left out of the
    count's fingerprint, Apply ran on a window that was never counted (audit helper-106)."""
    subscription = SubscriptionFactory()
    ids = dead_letters(subscription, {"reason": "Poison", "key": "k"}, {})
    url = reverse("admin:workqueue_subscription_changelist")
    form = as_recovery_operator(
        client, subscription, operation="discard", note="cleanup", **{field: counted_with}
    )
    counted = client.post(url, {**form, "post": "count"})
    assert counted.context["form"].errors == {}

    changed = client.post(
        url, {**form, field: "", "post": "apply", "counted": counted.context["counted"]}
    )

    assert "not the ones counted" in str(changed.context["form"].non_field_errors())
    assert statuses(ids) == ["DeadLettered"] * 2


# Tabs: a key may no longer end with a space (SQL Server ignores trailing spaces; review
# helper-160), and the form's trimming took tabs as it took spaces.
@pytest.mark.parametrize("wanted", ["c-7\t", "\t"], ids=["trailing tab", "all whitespace"])
@pytest.mark.parametrize("operation", ["discard", "discard_pending"])
def test_the_admin_filters_by_the_partition_key_exactly_as_given(client, wanted, operation):
    """Audit helper-132: keys are stored and compared exactly as published ("c-7" and "c-7\t"
    are two keys, "\t" is one), as the CLI and REST filter by them; the admin's form trimmed the
    key, so "c-7 " counted and discarded the dead letters (or waiting work) of "c-7", and a key
    of spaces became "any": every one of the subscription's."""
    subscription = SubscriptionFactory(partition_mode="Exclusive")
    if operation == "discard":
        target, other = dead_letters(subscription, {"key": wanted}, {"key": "c-7"})
    else:
        [target], [other] = waiting(subscription, 1, key=wanted), waiting(subscription, 1, "c-7")
    url = reverse("admin:workqueue_subscription_changelist")
    form = as_recovery_operator(
        client, subscription, operation=operation, partition_key=wanted, note="bad importer key"
    )

    counted = client.post(url, {**form, "post": "count"})
    assert counted.context["form"].errors == {}
    [(_, count)] = counted.context["counts"]
    assert count.startswith("1 of 2 ")
    client.post(url, {**form, "post": "apply", "counted": counted.context["counted"]})

    assert statuses([target, other]) == [
        "Discarded",
        "DeadLettered" if operation == "discard" else "Pending",
    ]


def test_the_admin_refuses_a_blank_error_filter_and_matches_one_with_its_spaces(client):
    """A blank error filter is refused in the admin as from the CLI and REST, not read as
    none; one with spaces is matched with them (trimmed, " API " matched "RAPID" too)."""
    subscription = SubscriptionFactory()
    ids = dead_letters(subscription, {"error": "TimeoutError: the API "}, {"error": "RAPIDError"})
    url = reverse("admin:workqueue_subscription_changelist")
    form = as_recovery_operator(client, subscription, operation="discard", note="cleanup")

    blank = client.post(url, {**form, "error_contains": "  ", "post": "count"})
    spaced = client.post(url, {**form, "error_contains": " API ", "post": "count"})

    assert "blank" in str(blank.context["form"].errors["error_contains"])
    assert spaced.context["counts"] == [
        (subscription.name, "1 of 2 dead letters would be discarded")
    ]
    # The CLI's and REST's way in, likewise.
    selection = DeadLetterSelection(error_contains=" API ")
    assert resolve_dead_letters(subscription.name, "replay", selection, dry_run=True).matched == 1
    # A reason is a name, matched whole: its spaces are not part of it (review helper-135).
    by_reason = DeadLetterSelection(reason=" Poison ")
    assert resolve_dead_letters(subscription.name, "replay", by_reason, dry_run=True).matched == 2
    assert statuses(ids) == ["DeadLettered"] * 2


# -- a million dead letters -----------------------------------------------------------------


@pytest.mark.slow
def test_a_dry_run_over_a_million_dead_letters_counts_them_in_bounded_batches(pg_conn):
    subscription = SubscriptionFactory()
    pg_conn.execute(
        """
        WITH m AS (
            INSERT INTO workqueue_message (id, publish_ordinal, topic_id, payload)
            SELECT gen_random_uuid(), nextval('wq_publish_ordinal_seq'), %(topic)s, '{}'::jsonb
              FROM generate_series(1, 1000000)
            RETURNING id, publish_ordinal
        )
        INSERT INTO workqueue_delivery (id, message_id, subscription_id, status, order_key,
                                        attempt_count, is_replay, visible_at,
                                        dead_letter_reason, last_error, dead_lettered_at)
        SELECT gen_random_uuid(), m.id, %(sub)s, 'DeadLettered', m.publish_ordinal, 5, false,
               now(),
               CASE WHEN m.publish_ordinal %% 10 = 0 THEN 'Poison' ELSE 'MaxAttemptsExceeded' END,
               'boom', now()
          FROM m
        """,
        {"topic": subscription.topic_id, "sub": subscription.id},
    )
    pg_conn.execute("ANALYZE workqueue_delivery")

    began = time.perf_counter()
    outcome = resolve_dead_letters(
        subscription.name,
        "discard",
        DeadLetterSelection(reason="Poison"),
        dry_run=True,
        note="count only",
    )
    elapsed = time.perf_counter() - began

    assert outcome.examined == 1_000_000 and outcome.batches == 1001
    assert 99_000 <= outcome.matched <= 101_000
    print(f"dry run over 1,000,000 dead letters: {elapsed:.1f} s in {outcome.batches} batches")
    assert operations.subscription_stats(subscription.name).subscriptions[0].dead_lettered == (
        1_000_000
    )


# -- discarding waiting work ----------------------------------------------------------------


def waiting(subscription: Subscription, count: int, key: str | None = None) -> list[str]:
    ids = []
    for n in range(count):
        message = publish(subscription.topic.name, {"n": n}, partition_key=key).message_id
        ids.append(str(Delivery.objects.get(message_id=message, subscription=subscription).pk))
    return ids


@pytest.mark.parametrize("mode", ["None", "Exclusive"])
def test_discarding_waiting_work_takes_exactly_the_matching_pending_rows_and_never_a_running_one(
    mode,
):
    subscription = SubscriptionFactory(partition_mode=mode)
    old = waiting(subscription, 3, key="flood")
    get_driver().shift_time(3600, subscription_id=str(subscription.id))
    flood = waiting(subscription, 5, key="flood")
    keep = waiting(subscription, 2, key="other") + waiting(subscription, 2)
    receiver = Receiver(subscription.id)
    [running] = receiver.receive(1).deliveries  # the oldest "flood" row (keys are free)
    since = timezone.now() - dt.timedelta(minutes=30)
    selection = operations.PendingSelection(partition_key="flood", published_from=since)

    counted = operations.discard_pending(
        subscription.name, selection, reason="flood", dry_run=True, batch_size=2
    )
    assert counted.matched == 5 and set(statuses(flood)) == {"Pending"}
    outcome = operations.discard_pending(
        subscription.name, selection, reason="publisher bug", batch_size=2
    )

    assert outcome.matched == 5
    assert statuses(flood) == ["Discarded"] * 5
    assert set(statuses(keep)) == {"Pending"}
    assert statuses([running.delivery_id]) == ["InFlight"]  # one of the old ones: untouched
    assert set(statuses([i for i in old if i != running.delivery_id])) == {"Pending"}
    assert set(Delivery.objects.filter(pk__in=flood).values_list("resolution_note", flat=True)) == {
        "publisher bug"
    }
    assert receiver.complete(running).settled


def test_a_colleagues_dry_run_does_not_make_a_bulk_discard_leave_matching_work_to_run():
    """Review helper-183: one responder counts (a REST dryRun, the admin's Count, --dry-run)
    while another applies. The dry run changes nothing, yet it locked every row it walked, and
    the real discard skips locked rows as being claimed: it reported them examined but not
    matched ("Discarded 0 of 3") and left them Pending, so the flood it was meant to stop ran.
    (The dry run's transaction is held open here to widen the moment its batch holds them.)"""
    subscription = SubscriptionFactory()
    for n in range(3):
        publish(subscription.topic.name, {"n": n})
    with psycopg.connect(autocommit=False, **psycopg_params()) as colleague:
        [counted] = colleague.execute(
            "SELECT examined, changed FROM wq_discard_pending(%s, false, NULL, NULL, NULL, "
            "NULL, NULL, NULL, NULL, 1000, true, 'colleague', 'counting')",
            [subscription.id],
        ).fetchall()
        assert counted == (3, 3)  # the colleague's count: 3 would be discarded

        outcome = operations.discard_pending(
            subscription.name, operations.PendingSelection(), reason="flood"
        )
        colleague.rollback()

    left = Delivery.objects.filter(subscription=subscription, status="Pending").count()
    assert (outcome.matched, left) == (3, 0), (
        f"discarded {outcome.matched} of {outcome.examined}; {left} left Pending to run"
    )


def test_a_colleagues_dry_run_over_dead_letters_holds_up_neither_a_discard_nor_a_bulk_run():
    """Review helper-183: the dry run of a bulk dead-letter replay or discard locked every
    dead letter of its batch while it ran, changing nothing: a discard of one of them beside
    it waited 2 s and answered a lock timeout (409), and a real bulk run waited for it.
    (The dry run's transaction is held open here to widen the moment its batch holds them.)"""
    subscription = SubscriptionFactory()
    first, second, third = dead_letters(subscription, {}, {}, {})
    with psycopg.connect(autocommit=False, **psycopg_params()) as colleague:
        [counted] = colleague.execute(
            "SELECT examined, changed FROM wq_resolve_dead_letters(%s, 'Discard', NULL, NULL, "
            "NULL, NULL, NULL, NULL, 1000, true, 'colleague', 'counting')",
            [subscription.id],
        ).fetchall()
        assert counted == (3, 3)  # the colleague's count: 3 would be discarded

        began = time.monotonic()
        discarded = operations.discard(subscription.name, first, reason="poison")
        replayed = resolve_dead_letters(
            subscription.name, "replay", DeadLetterSelection(), note="after the fix"
        )
        waited = time.monotonic() - began
        colleague.rollback()

    assert discarded.discarded and replayed.matched == 2
    assert statuses([first, second, third]) == ["Discarded", "Pending", "Pending"]
    assert waited < 1.5, f"waited {waited:.1f} s behind a dry run"


def test_a_bulk_run_changes_a_dead_letter_only_as_its_batch_examined_it():
    """A dead letter replayed, run and dead-lettered again (another reason) while a bulk run
    reads its batch is another dead letter: the run that matched the first one must not
    change the second, which its filter does not match."""
    subscription = SubscriptionFactory()
    [delivery] = dead_letters(subscription, {"reason": "Poison", "error": "KeyError: 'sku'"})
    with psycopg.connect(autocommit=False, **psycopg_params()) as host:
        # Replayed, claimed and dead-lettered again, not committed yet.
        host.execute(
            "SELECT affected_rows FROM wq_replay(%s, %s, 'ops', 'fixed')",
            [subscription.id, delivery],
        )
        [(claimed, token)] = host.execute(
            "SELECT delivery_id, lease_token FROM wq_claim(%s, 'another-host', 1, NULL) "
            "WHERE kind = 'Claimed'",
            [subscription.id],
        ).fetchall()
        host.execute(
            "SELECT affected_rows FROM wq_dead_letter(%s, %s, 'MaxAttemptsExceeded', 'Timeout')",
            [claimed, token],
        )

        def discard_poison() -> operations.BulkOutcome:
            try:
                return resolve_dead_letters(
                    subscription.name, "discard", DeadLetterSelection(reason="Poison"), note="p"
                )
            finally:
                get_driver().close()  # this thread's connection
                connections.close_all()

        with ThreadPoolExecutor(1) as pool:
            bulk = pool.submit(discard_poison)
            time.sleep(0.5)  # the bulk run reads the Poison dead letter, committed
            host.commit()
            outcome = bulk.result(timeout=10)

    assert outcome.matched == 0
    assert Delivery.objects.get(pk=uuid_of(delivery)).dead_letter_reason == "MaxAttemptsExceeded"
    assert statuses([delivery]) == ["DeadLettered"]


def test_discarding_waiting_work_takes_the_windows_start_not_its_end_and_any_case_of_error():
    """[from, before) and error text in any case, as for dead letters: no test of waiting work
    gave a window's end or error text, so ``<=`` and a case-sensitive match went unseen (audit
    helper-106)."""
    subscription = SubscriptionFactory()
    first, second = waiting(subscription, 1) + waiting(subscription, 1)
    receiver = Receiver(subscription.id)
    # Both failed once and wait for their retry, each with its error.
    for claimed, error in zip(
        receiver.receive(2).deliveries,
        ["TimeoutError: payments API", "KeyError: 'sku'"],
        strict=True,
    ):
        assert receiver.retry(claimed, 0, error).settled
    at_first, at = (
        Delivery.objects.get(pk=uuid_of(i)).message.published_at for i in (first, second)
    )
    assert at_first < at  # so each bound has one row on it and one off it

    def selected(**selection: Any) -> int:
        return operations.discard_pending(
            subscription.name, operations.PendingSelection(**selection), reason="x", dry_run=True
        ).matched

    assert selected(published_from=at) == 1
    assert selected(published_before=at) == 1
    assert selected(published_from=at_first, published_before=at) == 1
    assert selected(error_contains="timeouterror: PAYMENTS") == 1
    assert statuses([first, second]) == ["Pending"] * 2


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "for-real"])
@pytest.mark.parametrize("path", ["pending/discard", "dead-letters/discard", "dead-letters/replay"])
def test_a_key_limited_to_other_subscriptions_cannot_operate_on_this_ones_work_in_bulk(
    client, path, dry_run
):
    """Each bulk operation asks for the subscription's limit, not only for the scope: only
    replay-by-filter was tried with a limited key (audit helper-106 took the limit out of the
    waiting-work discard and no test failed)."""
    subscription = SubscriptionFactory()
    dead = dead_letters(subscription, {})
    pending = waiting(subscription, 1)
    key = ApiKeyFactory(
        scopes=[OPERATE], subscriptions=["mine.sub"], topics=[subscription.topic.name]
    )
    body = {"filter": {}, "dryRun": dry_run, ("note" if "replay" in path else "reason"): "x"}

    refused = post(client, f"/subscriptions/{subscription.name}/{path}", body, key)

    assert refused.status_code == 403, refused.content
    assert statuses(dead) == ["DeadLettered"] and statuses(pending) == ["Pending"]
    assert not LogEntry.objects.exists()


@pytest.mark.parametrize("path", ["pending/discard", "dead-letters/discard"])
def test_a_bulk_discard_through_rest_is_in_the_subscriptions_admin_history(client, path):
    """Each row records who and why; the subscription's history names the whole operation and
    its door, as a replay's does (audit helper-106: left out of both discards, unseen)."""
    subscription = SubscriptionFactory()
    dead_letters(subscription, {})
    waiting(subscription, 1)
    key = ApiKeyFactory(scopes=[OPERATE])

    discarded = post(
        client, f"/subscriptions/{subscription.name}/{path}", {"filter": {}, "reason": "bad"}, key
    )

    assert discarded.json()["matched"] == 1
    history = LogEntry.objects.get(object_id=str(subscription.pk))
    assert f"through the REST API with API key wq_{key.prefix}" in history.change_message
    assert "Discarded 1" in history.change_message and "(note: bad)" in history.change_message


@pytest.mark.parametrize("procedure", ["wq_discard_pending", "wq_resolve_dead_letters"])
def test_a_bulk_batch_is_held_to_5000_rows_by_the_procedure_whatever_its_caller_asks(
    pg_conn, procedure
):
    """The bound that keeps a batch's transaction short lives in the procedure, for a caller
    of the granted role that skips the Python check (audit helper-106: taken out of both,
    unseen)."""
    subscription = SubscriptionFactory()
    seed_deliveries(
        pg_conn,
        subscription,
        5_100,
        status="Pending" if procedure == "wq_discard_pending" else "DeadLettered",
    )
    call = {
        "wq_discard_pending": "SELECT examined, last_delivery_id FROM wq_discard_pending("
        "p_subscription_id => %s, p_keyed => false, p_partition_key => NULL, "
        "p_published_from => NULL, p_published_before => NULL, p_error_contains => NULL, "
        "p_after_priority => NULL, p_after_visible_at => NULL, p_after_delivery_id => NULL, "
        "p_batch_size => 1000000, p_dry_run => true, p_actor => 'me', p_reason => 'x')",
        "wq_resolve_dead_letters": "SELECT examined, last_delivery_id FROM "
        "wq_resolve_dead_letters(p_subscription_id => %s, p_action => 'Replay', "
        "p_reason => NULL, p_partition_key => NULL, p_dead_lettered_from => NULL, "
        "p_dead_lettered_before => NULL, p_error_contains => NULL, "
        "p_after_delivery_id => NULL, p_batch_size => 1000000, p_dry_run => true, "
        "p_actor => 'me', p_note => 'x')",
    }[procedure]

    examined, resume_at = pg_conn.execute(call, [subscription.id]).fetchone()

    assert examined == 5_000 and resume_at is not None


@pytest.mark.parametrize(
    "argv",
    [
        ["discard-dead-letters", "--error-contains", " "],
        ["discard-dead-letters", "--reason", ""],
        ["discard-pending", "--error-contains", ""],
    ],
)
def test_a_blank_filter_is_refused_not_read_as_no_filter(argv):
    """``--error-contains "$PATTERN"`` with the variable unset discarded every dead letter: a
    filter given blank was taken as no filter at all."""
    subscription = SubscriptionFactory()
    ids = dead_letters(subscription, {"error": "TimeoutError"}, {"error": "KeyError"})
    waiting_ids = waiting(subscription, 2, key="k")
    verb, *filters = argv

    with pytest.raises(CommandError, match="blank"):
        run(verb, "-s", subscription.name, *filters, "--discard-reason", "cleanup")

    assert statuses(ids) == ["DeadLettered"] * 2
    assert statuses(waiting_ids) == ["Pending"] * 2


@pytest.mark.parametrize("path", ["dead-letters/discard", "pending/discard"])
def test_a_blank_filter_in_a_rest_body_is_refused_not_read_as_no_filter(path, client):
    """An empty ``errorContains`` in a REST body discarded every dead letter or waiting
    delivery."""
    subscription = SubscriptionFactory()
    ids = dead_letters(subscription, {"error": "TimeoutError"}, {"error": "KeyError"})
    waiting_ids = waiting(subscription, 2, key="k")

    refused = post(
        client,
        f"/subscriptions/{subscription.name}/{path}",
        {"filter": {"errorContains": ""}, "reason": "cleanup"},
        ApiKeyFactory(scopes=[OPERATE]),
    )

    assert refused.status_code == 400, refused.content
    assert statuses(ids) == ["DeadLettered"] * 2
    assert statuses(waiting_ids) == ["Pending"] * 2


def test_discarding_waiting_work_from_the_cli_and_rest_needs_a_reason_and_the_operate_scope(
    client,
):
    subscription = SubscriptionFactory()
    flood = waiting(subscription, 4, key="flood")
    keep = waiting(subscription, 1, key="other")

    with pytest.raises(CommandError, match="--discard-reason"):
        run("discard-pending", "-s", subscription.name, "--key", "flood")
    counted = run(
        "discard-pending",
        "-s",
        subscription.name,
        "--key",
        "flood",
        "--dry-run",
        "--discard-reason",
        "x",
    )
    assert f"Dry run: 4 of 5 waiting deliveries of {subscription.name} match" in counted

    path = f"/subscriptions/{subscription.name}/pending/discard"
    body = {"filter": {"partitionKey": "flood"}, "reason": "publisher bug"}
    assert post(client, path, body, ApiKeyFactory(scopes=[READ])).status_code == 403
    assert post(client, path, {"filter": {}}, ApiKeyFactory(scopes=[OPERATE])).status_code in (
        400,
        422,
    )
    discarded = post(client, path, body, ApiKeyFactory(scopes=[OPERATE, READ]))
    assert discarded.status_code == 200, discarded.content
    assert discarded.json()["matched"] == 4
    assert statuses(flood) == ["Discarded"] * 4 and statuses(keep) == ["Pending"]


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "discard"])
def test_a_bulk_discard_in_small_batches_examines_every_waiting_delivery_once(pg_conn, dry_run):
    """Batches walk priorities and due times in ranges (helper-96's quadratic walk, mended):
    across priorities, rows sharing a due time, and batches ending inside such a group, each
    waiting delivery is examined exactly once, in (priority, due time, id) order."""
    subscription = SubscriptionFactory()
    seed_deliveries(pg_conn, subscription, 300)
    # Three priorities, and due times in groups of up to 13 rows sharing one instant.
    pg_conn.execute(
        "UPDATE workqueue_delivery SET priority = mod(order_key, 3) - 1, "
        "visible_at = timestamptz '2026-01-01' + (order_key / 13) * interval '1 second' "
        "WHERE subscription_id = %s",
        [subscription.id],
    )
    expected = [
        str(i)
        for (i,) in pg_conn.execute(
            "SELECT id FROM workqueue_delivery WHERE subscription_id = %s "
            "ORDER BY priority, visible_at, id",
            [subscription.id],
        ).fetchall()
    ]
    cursor: tuple[Any, Any, Any] = (None, None, None)
    lasts, examined, changed = [], 0, 0
    while True:
        [row] = pg_conn.execute(
            "SELECT * FROM wq_discard_pending(%s, false, NULL, NULL, NULL, NULL, %s, %s, %s, "
            "7, %s, 'ops', 'test')",
            [subscription.id, *cursor, dry_run],
        ).fetchall()
        examined += row[0]
        changed += row[1]
        if row[0]:
            cursor = (row[2], row[3], row[4])
            lasts.append(str(row[4]))
        if row[0] < 7:
            break

    assert (examined, changed) == (300, 300)
    # Each batch ended where the whole walk's order says its last row is.
    assert lasts == [expected[min(i + 6, 299)] for i in range(0, 300, 7)]


# -- a failure partway ----------------------------------------------------------------------


def connection_dropped_before(
    monkeypatch: pytest.MonkeyPatch, pg_conn: Any, procedure: str, call: int
) -> None:
    """From now on the driver's connection is dropped (its backend terminated, as a failover
    does) just before the ``call``-th call of ``procedure``: the batches before it committed."""
    driver = get_driver()
    original = driver.call
    calls = 0

    def dropping(name: str, params: Any = None, **kw: Any) -> Any:
        nonlocal calls
        if name == procedure:
            calls += 1
            if calls == call:
                (pid,) = driver.execute("SELECT pg_backend_pid()", [])[0]
                pg_conn.execute("SELECT pg_terminate_backend(%s, 5000)", [pid])
        return original(name, params, **kw)

    monkeypatch.setitem(vars(driver), "call", dropping)


DROPPED = "terminating connection due to administrator command"


def test_a_bulk_command_stopped_by_a_dropped_connection_says_what_its_batches_did(
    monkeypatch, pg_conn
):
    """The batches before the failure stay committed; the command said so, but not how many
    rows they changed (reviewer h124). Here the keyless index's batches all committed and the
    keyed index's first one failed: the count is of both."""
    subscription = SubscriptionFactory(partition_mode="Exclusive")
    keyless = waiting(subscription, 3)
    keyed = waiting(subscription, 2, key="k")
    connection_dropped_before(monkeypatch, pg_conn, "wq_discard_pending", call=3)
    argv = ("discard-pending", "-s", subscription.name, "--discard-reason", "flood")

    with pytest.raises(CommandError) as stopped:
        run(*argv, "--batch-size", "2")

    assert str(stopped.value) == (
        "Stopped by an error after 2 batches, in which 3 of the 3 waiting deliveries examined "
        "were discarded: those stay discarded. Running it again is safe and goes on with what "
        f"is left (a dry run counts it). The error: {DROPPED}"
    )
    interrupted = stopped.value.__cause__
    assert (interrupted.action, interrupted.dry_run) == ("discard", False)
    assert (interrupted.matched, interrupted.examined, interrupted.batches) == (3, 3, 2)
    assert statuses(keyless) == ["Discarded"] * 3 and statuses(keyed) == ["Pending"] * 2
    assert f"Discarded 2 of 2 waiting deliveries of {subscription.name}" in run(*argv)


def test_a_bulk_command_interrupted_with_ctrl_c_says_how_much_its_batches_did(monkeypatch, pg_conn):
    """Review helper-183: a failure after committed batches was told with their counts, an
    operator's Ctrl-C only with "the batches applied before it stay applied": not how many
    dead letters were discarded, which is what the operator decides the next step by."""
    subscription = SubscriptionFactory()
    seed_deliveries(pg_conn, subscription, 5, status="DeadLettered")
    driver = get_driver()
    original = driver.call
    calls = 0

    def interrupted_in_the_third_batch(name: str, params: Any = None, **kw: Any) -> Any:
        nonlocal calls
        if name == "wq_resolve_dead_letters":
            calls += 1
            if calls == 3:
                raise KeyboardInterrupt
        return original(name, params, **kw)

    monkeypatch.setitem(vars(driver), "call", interrupted_in_the_third_batch)
    argv = ("discard-dead-letters", "-s", subscription.name, "--discard-reason", "poison")

    with pytest.raises(CommandError) as stopped:
        run(*argv, "--batch-size", "2")

    assert stopped.value.returncode == 130
    assert str(stopped.value) == (
        "Interrupted after 2 batches, in which 4 of the 4 dead letters examined were "
        "discarded: those stay discarded. Running it again is safe and goes on with what is "
        "left (a dry run counts it). The batch under way at the interrupt may have been "
        "applied too."
    )
    discarded = Delivery.objects.filter(subscription=subscription, status="Discarded")
    assert discarded.count() == 4

    # A Python caller of the operation reads the same counts from the interrupt, as from
    # BulkOperationInterrupted (they were in its text only).
    calls = 0
    other = SubscriptionFactory()
    seed_deliveries(pg_conn, other, 4, status="DeadLettered")
    with pytest.raises(BulkOperationStopped) as interrupt:
        resolve_dead_letters(other.name, "replay", DeadLetterSelection(), note="back", batch_size=1)
    assert isinstance(interrupt.value, KeyboardInterrupt)
    counts = vars(interrupt.value)
    assert counts == {
        "action": "replay",
        "dry_run": False,
        "matched": 2,
        "examined": 2,
        "batches": 2,
    }


def test_a_bulk_command_whose_first_batch_fails_says_so(monkeypatch, pg_conn):
    """A failure after a batch committed counts what was done (above); one in the first batch
    said "the batches applied before this error stay applied", of batches there were none
    (helper-126)."""
    subscription = SubscriptionFactory()
    kept = waiting(subscription, 3)
    connection_dropped_before(monkeypatch, pg_conn, "wq_discard_pending", call=1)

    with pytest.raises(CommandError) as stopped:
        run("discard-pending", "-s", subscription.name, "--discard-reason", "flood")

    assert str(stopped.value) == (
        f"{DROPPED} (the first batch failed; running it again is safe, and --dry-run counts "
        "what is left)"
    )
    assert statuses(kept) == ["Pending"] * 3


def test_a_bulk_replay_through_rest_stopped_by_a_dropped_connection_counts_what_it_did(
    client, monkeypatch, pg_conn
):
    """Its first batch of 1000 committed, then the connection dropped: the caller heard only
    "unavailable, try again" and the subscription's history had nothing (reviewer h124). The
    answer counts the batches that committed, without the database's text."""
    subscription = SubscriptionFactory()
    seed_deliveries(pg_conn, subscription, 1500, status="DeadLettered")
    key = ApiKeyFactory(scopes=[OPERATE])
    connection_dropped_before(monkeypatch, pg_conn, "wq_resolve_dead_letters", call=2)

    stopped = post(
        client, f"/subscriptions/{subscription.name}/dead-letters/replay", {"note": "INC-512"}, key
    )

    assert stopped.status_code == 503
    assert stopped.json() == {
        "detail": "The work queue's database is unavailable; try again shortly.",
        "matched": 1000,
        "examined": 1000,
        "batches": 1,
    }
    assert Delivery.objects.filter(subscription=subscription, status="Pending").count() == 1000
    history = LogEntry.objects.get(object_id=str(subscription.pk))
    assert history.change_message == (
        "Replayed 1000 dead letters, stopped by an error after 1 batch, through the REST API "
        f"with API key wq_{key.prefix} (note: INC-512)"
    )


def test_an_admin_bulk_replay_stopped_by_a_dropped_connection_says_and_records_what_it_did(
    client, monkeypatch, pg_conn
):
    """The admin said "failed" with no count and recorded nothing, though 1000 dead letters
    were replayed (reviewer h124); one history entry per bulk operation is promised."""
    subscription = SubscriptionFactory()
    seed_deliveries(pg_conn, subscription, 1500, status="DeadLettered")
    url = reverse("admin:workqueue_subscription_changelist")
    form = as_recovery_operator(client, subscription, operation="replay", note="INC-512")
    counted = client.post(url, {**form, "post": "count"}).context["counted"]
    connection_dropped_before(monkeypatch, pg_conn, "wq_resolve_dead_letters", call=2)

    applied = client.post(url, {**form, "post": "apply", "counted": counted}, follow=True)

    [message] = applied.context["messages"]
    assert message.level == messages.WARNING
    assert str(message) == (
        f"{subscription.name}: stopped by an error after 1000 of 1000 dead letters were "
        "replayed (in 1 batch; they stay replayed: Count and Apply again for what is left): "
        f"{DROPPED}"
    )
    assert Delivery.objects.filter(subscription=subscription, status="Pending").count() == 1000
    history = LogEntry.objects.get(object_id=str(subscription.pk))
    assert history.change_message == (
        "Replayed 1000 dead letters, stopped by an error after 1 batch (note: INC-512)"
    )
