"""Retiring a subscription: disable it, let its running work finish (or discard what waits),
purge its settled deliveries through the procedures, then delete its row.

A subscription's row cannot be deleted while deliveries refer to it (``ProtectedError``), and
retention purges settled ones only after the topic's ``retention_days``; this does it now, in
the order that keeps the rule that nothing unsettled is lost silently: Pending and
dead-lettered deliveries are discarded only when asked (``discard_pending``), with the actor
and reason recorded, and running ones are waited for, never cut short.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db.models import Count, ProtectedError

from workqueue import transport
from workqueue.exceptions import WorkQueueError
from workqueue.operators.operations import _name, _subscription, _transport_of
from workqueue.operators.permissions import CLI, OPERATE, Actor, require
from workqueue.transports import BaseTransport
from workqueue.types import DeliveryStatus, SubscriptionStatus

BATCH_SIZE = 1000
POLL_SECONDS = 0.2


class RetireRefusedError(WorkQueueError):
    """The subscription cannot be retired yet; the message says why and what to do. What was
    done before the refusal (disabling it) stays done."""


@dataclass(frozen=True, slots=True)
class RetireReport:
    subscription_name: str
    dry_run: bool
    #: Its deliveries by status when the command started.
    deliveries: dict[str, int]
    disabled: bool = False
    discarded: int = 0
    purged: int = 0
    deleted: bool = False


def retire_subscription(
    name: str,
    *,
    dry_run: bool = False,
    discard_pending: bool = False,
    wait_seconds: float = 30.0,
    actor: Actor = CLI,
    say: Callable[[str], None] = lambda line: None,
) -> RetireReport:
    """Retire the subscription ``name`` (see the module's docstring); ``say`` hears each step.

    Raises ``RetireRefusedError`` when it has Pending or dead-lettered deliveries and
    ``discard_pending`` is off, or deliveries still run after ``wait_seconds``.
    """
    name = _name(name)
    require(actor, OPERATE, subscription=name)
    subscription = _subscription(name, actor)
    found = _transport_of(subscription)
    if not found.keeps_deliveries_in_database:
        return _retire_elsewhere(subscription, found, dry_run, discard_pending, say)
    before = _counts(subscription)
    waiting = before[DeliveryStatus.PENDING] + before[DeliveryStatus.DEAD_LETTERED]
    if waiting and not discard_pending:
        raise RetireRefusedError(_waiting_advice(name, before))
    report = RetireReport(name, dry_run, before)
    if dry_run:
        _describe_plan(subscription, before, discard_pending, say)
        return report

    disabled = subscription.status != SubscriptionStatus.DISABLED
    if disabled:
        # Publishing fans out no new deliveries to a Disabled subscription, and hosts stop
        # claiming it when they next re-plan (WORKQUEUE["RECONCILE_INTERVAL_MS"]).
        subscription.status = SubscriptionStatus.DISABLED
        subscription.save(update_fields=["status"])
        say(f"Disabled {name}: no new deliveries; hosts stop claiming it at their next re-plan.")
    discarded = 0
    reason = f"Subscription {name} retired"
    deadline = time.monotonic() + wait_seconds
    while True:
        if discard_pending:
            # Again after each wait: a host that had not re-planned yet may have claimed a row
            # that then went back to Pending, or was dead-lettered.
            discarded += _drain(
                lambda: transport.retire_discard(
                    str(subscription.id), actor.name, reason, BATCH_SIZE
                )
            )
        now = _counts(subscription)
        if not now[DeliveryStatus.IN_FLIGHT]:
            break
        if time.monotonic() >= deadline:
            if discarded:
                say(f"Discarded {discarded} Pending or dead-lettered deliveries.")
            raise RetireRefusedError(
                f"{now[DeliveryStatus.IN_FLIGHT]} deliveries of {name} were still running after "
                f"{wait_seconds:g} s. It stays Disabled; run the command again once they finish "
                f"(`manage.py workqueue backlog -s {name}` shows them), or raise --wait-seconds."
            )
        time.sleep(POLL_SECONDS)
    if discarded:
        say(f"Discarded {discarded} Pending or dead-lettered deliveries.")
    if now[DeliveryStatus.PENDING] + now[DeliveryStatus.DEAD_LETTERED]:
        raise RetireRefusedError(
            f"{name} received deliveries before it was disabled. It stays Disabled: "
            + _waiting_advice(name, now)
        )
    purged = _drain(lambda: transport.retire_purge(str(subscription.id), BATCH_SIZE))
    say(f"Purged {purged} settled deliveries.")
    try:
        subscription.delete()
    except ProtectedError:
        raise RetireRefusedError(
            f"{name} gained deliveries while it was being retired; run the command again."
        ) from None
    say(f"Deleted subscription {name}.")
    return RetireReport(name, dry_run, before, disabled, discarded, purged, deleted=True)


def _retire_elsewhere(
    subscription: Any,
    found: BaseTransport,
    dry_run: bool,
    discard_pending: bool,
    say: Callable[[str], None],
) -> RetireReport:
    """Retire a subscription whose deliveries live in its transport (an SQS queue): counted
    there, refused while anything waits or runs (nothing is discarded: the transport cannot
    discard waiting work in bulk), then disabled and deleted. Its cloud resources stay, as
    provisioning never deletes; the operator is told."""
    name = subscription.name
    if discard_pending:
        found.require(
            "supports_bulk_discard_pending",
            "Discarding the waiting deliveries of a retired subscription",
            subscription.topic.transport.name,
        )
    stats = found.subscription_stats(str(subscription.id)) or {}
    before = dict.fromkeys(DeliveryStatus.values, 0)
    before[DeliveryStatus.PENDING] = stats.get("pending") or 0
    before[DeliveryStatus.IN_FLIGHT] = stats.get("in_flight") or 0
    before[DeliveryStatus.DEAD_LETTERED] = stats.get("dead_lettered") or 0
    if before[DeliveryStatus.PENDING] + before[DeliveryStatus.DEAD_LETTERED]:
        raise RetireRefusedError(_waiting_advice(name, before, can_discard=False))
    if before[DeliveryStatus.IN_FLIGHT]:
        raise RetireRefusedError(
            f"{before[DeliveryStatus.IN_FLIGHT]} deliveries of {name} are running. Run the "
            "command again once they finish (`manage.py workqueue backlog -s NAME` shows them)."
        )
    left = (
        f"Its resources on the {found.name} transport are not deleted (provisioning never "
        "deletes, and messages published meanwhile still arrive there): remove them in "
        f"{found.name} once nothing publishes to them."
    )
    if dry_run:
        if subscription.status != SubscriptionStatus.DISABLED:
            say(f"Would disable {name}.")
        say(f"Would delete subscription {name}. {left} Dry run: nothing was changed.")
        return RetireReport(name, dry_run, before)
    disabled = subscription.status != SubscriptionStatus.DISABLED
    if disabled:
        subscription.status = SubscriptionStatus.DISABLED
        subscription.save(update_fields=["status"])
        say(f"Disabled {name}: hosts stop receiving it at their next re-plan.")
    subscription.delete()
    say(f"Deleted subscription {name}. {left}")
    return RetireReport(name, dry_run, before, disabled, deleted=True)


def _counts(subscription: Any) -> dict[str, int]:
    """Its deliveries by status; a Completed one whose handler completed it in its own
    transaction and runs on, holding its key, counts as running (InFlight): retiring waits for
    it as for any running handler (review helper-199)."""
    from workqueue.models import Delivery
    from workqueue.models.queue import HOLDING_ITS_KEY_AFTER_COMPLETING

    rows = (
        Delivery.objects.filter(subscription=subscription)
        .values_list("status")
        .annotate(n=Count("id"))
        .order_by()
    )
    counts = dict.fromkeys(DeliveryStatus.values, 0)
    counts.update(dict(rows))
    if counts[DeliveryStatus.COMPLETED]:
        holding = Delivery.objects.filter(
            HOLDING_ITS_KEY_AFTER_COMPLETING, subscription=subscription
        ).count()
        counts[DeliveryStatus.COMPLETED] -= holding
        counts[DeliveryStatus.IN_FLIGHT] += holding
    return counts


def _drain(step: Callable[[], int]) -> int:
    total = 0
    while done := step():
        total += done
    return total


def _waiting_advice(name: str, counts: dict[str, int], *, can_discard: bool = True) -> str:
    return (
        f"{name} has {counts[DeliveryStatus.PENDING]} Pending and "
        f"{counts[DeliveryStatus.DEAD_LETTERED]} dead-lettered deliveries. To finish them, leave "
        "it Active, stop what publishes to it, let hosts drain it (`manage.py workqueue backlog "
        f"-s {name}` reaches 0), replay or discard its dead letters, then retire it"
        + (
            "; or pass --discard-pending to discard them (recorded as Discarded by you)."
            if can_discard
            else "."
        )
    )


def _describe_plan(
    subscription: Any, counts: dict[str, int], discard_pending: bool, say: Callable[[str], None]
) -> None:
    name = str(subscription)
    if subscription.status != SubscriptionStatus.DISABLED:
        say(f"Would disable {name}.")
    waiting = counts[DeliveryStatus.PENDING] + counts[DeliveryStatus.DEAD_LETTERED]
    if discard_pending and waiting:
        say(f"Would discard {waiting} Pending or dead-lettered deliveries.")
    if counts[DeliveryStatus.IN_FLIGHT]:
        say(f"Would wait for {counts[DeliveryStatus.IN_FLIGHT]} running deliveries.")
    settled = counts[DeliveryStatus.COMPLETED] + counts[DeliveryStatus.DISCARDED]
    say(f"Would purge {settled + (waiting if discard_pending else 0)} settled deliveries.")
    say(f"Would delete subscription {name}. Dry run: nothing was changed.")
