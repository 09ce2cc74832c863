"""Operator endpoints for subscriptions: stats, dead letters, partitions, backlog, replay and
discard. Each is a thin call into ``workqueue.operators.operations`` (the same code as the CLI
and the admin), which checks permissions and validates input before touching the queue."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from django.apps import apps
from django.http import HttpRequest, HttpResponse
from ninja import Router
from ninja.renderers import JSONRenderer
from ninja.responses import NinjaJSONEncoder

from workqueue.api.auth import OPERATOR_AUTH
from workqueue.api.schemas import (
    BacklogOut,
    BulkDiscardIn,
    BulkOut,
    BulkReplayIn,
    DeadLetterFilterIn,
    DeadLetterOut,
    DeadLetterPageOut,
    DiscardIn,
    DiscardOut,
    ErrorOut,
    PartitionPageOut,
    PendingDiscardIn,
    ReplayIn,
    ReplayOut,
    StatsOut,
)
from workqueue.exceptions import BulkOperationInterrupted
from workqueue.models import Delivery
from workqueue.operators import operations
from workqueue.operators.display import count_of
from workqueue.operators.permissions import Actor
from workqueue.types import DeadLetterItem

router = Router(tags=["subscriptions"])

READ_ERRORS = {400: ErrorOut, 401: ErrorOut, 403: ErrorOut, 404: ErrorOut}
# 409: the subscription's transport lacks the capability the operation needs (named in
# ``capability``), e.g. replay on a transport without supports_replay; or, for a discard, an
# open transaction holds the delivery's row (``deliveryId``): send the request again shortly.
TRANSPORT_ERRORS = {**READ_ERRORS, 409: ErrorOut}
# 503: the database failed (500: a cloud transport did); after some batches of a bulk operation
# had committed, the answer counts what they did (``matched``, ``examined``, ``batches``), which
# stays done.
BULK_ERRORS = {**TRANSPORT_ERRORS, 500: ErrorOut, 503: ErrorOut}


@router.get(
    "/stats",
    response={200: StatsOut, 401: ErrorOut, 403: ErrorOut},
    by_alias=True,
    operation_id="listSubscriptionStats",
    summary="Counts for every subscription",
)
def all_stats(request: HttpRequest) -> operations.StatsReport:
    """Pending, in-flight, dead-lettered and blocked counts for each subscription the caller
    may read, by name. A subscription whose counts cannot be read is listed in ``failures``."""
    return operations.subscription_stats(actor=request.auth)  # type: ignore[attr-defined]


@router.get(
    "/{name}/stats",
    response={200: StatsOut, **READ_ERRORS},
    by_alias=True,
    operation_id="getSubscriptionStats",
    summary="Counts for one subscription",
)
def stats(request: HttpRequest, name: str) -> operations.StatsReport:
    return operations.subscription_stats(name, actor=request.auth)  # type: ignore[attr-defined]


@router.get(
    "/{name}/dead-letters",
    response={200: DeadLetterPageOut, **READ_ERRORS},
    by_alias=True,
    operation_id="listDeadLetters",
    summary="A page of dead letters",
)
def dead_letters(
    request: HttpRequest, name: str, cursor: str | None = None, page_size: int | None = None
) -> HttpResponse:
    """Dead letters oldest first, ``page_size`` (1-500, default 50) at a time; pass
    ``nextCursor`` back as ``cursor`` for the next page. Payloads are null unless the caller
    has ``workqueue.view_payload``; a page with payloads ends early (with a ``nextCursor``)
    once they reach 4 Mi characters of JSON."""
    page = operations.list_dead_letters(
        name,
        cursor=cursor,
        page_size=page_size,
        actor=request.auth,  # type: ignore[attr-defined]
    )
    # Written here rather than by ninja, which would validate and encode each payload as
    # Python objects: a payload's stored JSON text goes into the page as it is (JSON of
    # empty objects is some 25 times its size decoded; review helper-167).
    outline = _json_text({"supported": page.supported, "nextCursor": page.next_cursor})
    items = "[" + ",".join(_dead_letter_text(item) for item in page.items) + "]"
    return HttpResponse(
        _with_member(outline, "items", items),
        content_type=f"{JSONRenderer.media_type}; charset={JSONRenderer.charset}",
    )


def _dead_letter_text(item: DeadLetterItem) -> str:
    """``item`` as DeadLetterOut's JSON (field names, formats), its payload the stored text."""
    shown = DeadLetterOut.model_validate(_dead_letter(item)).model_dump(
        by_alias=True, exclude={"message": {"payload"}}
    )
    message = _with_member(_json_text(shown.pop("message")), "payload", item.payload_json)
    return _with_member(_json_text(shown), "message", message)


def _json_text(value: dict[str, Any]) -> str:
    return json.dumps(value, cls=NinjaJSONEncoder)


def _with_member(object_text: str, name: str, value_text: str | None) -> str:
    """The JSON object ``object_text`` with one more member, ``name``: ``value_text`` (JSON
    text; None is null)."""
    member = f"{json.dumps(name)}:{'null' if value_text is None else value_text}"
    return f"{object_text[:-1]}{',' if object_text != '{}' else ''}{member}}}"


def _dead_letter(item: DeadLetterItem) -> dict[str, Any]:
    """``item`` as DeadLetterOut's fields, its payload left out (None: see dead_letters)."""
    return {
        "delivery_id": item.delivery_id,
        "partition_key": item.partition_key,
        "attempts": item.attempts,
        "reason": item.reason,
        "last_error": item.last_error,
        "dead_lettered_at": item.dead_lettered_at,
        "blocks_key": item.blocks_key,
        "message": {
            "message_id": item.message_id,
            "topic": item.topic,
            "partition_key": item.message_partition_key,
            "attributes": item.attributes,
            "payload": None,
            "payload_ref": item.payload_ref,
            "correlation_id": item.correlation_id,
            "published_at": item.published_at,
        },
    }


@router.get(
    "/{name}/partitions",
    response={200: PartitionPageOut, **TRANSPORT_ERRORS},
    by_alias=True,
    operation_id="listPartitions",
    summary="A page of partition keys that are in flight or blocked",
)
def partitions(
    request: HttpRequest,
    name: str,
    condition: str | None = None,
    cursor: str | None = None,
    page_size: int | None = None,
) -> dict[str, Any]:
    """Keys of an Exclusive or Ordered subscription by key, with their head delivery;
    ``condition`` (Idle, InFlight or Blocked) narrows the list. Each call looks at a bounded
    number of keys, so a page may be short (even empty) and still have a ``nextCursor``:
    follow it until it is null."""
    page = operations.list_partitions(
        name,
        condition=condition,
        cursor=cursor,
        page_size=page_size,
        actor=request.auth,  # type: ignore[attr-defined]
    )
    return {
        "supported": page.supported,
        "items": [asdict(item) for item in page.items],
        "next_cursor": page.next_cursor,
    }


@router.get(
    "/{name}/backlog",
    response={200: BacklogOut, **READ_ERRORS},
    by_alias=True,
    operation_id="getBacklog",
    summary="Claimable and in-flight counts for autoscaling",
)
def backlog(request: HttpRequest, name: str) -> operations.BacklogReport:
    """Each count is capped at 1000 (``capped`` says so)."""
    return operations.backlog(name, actor=request.auth)  # type: ignore[attr-defined]


@router.post(
    "/{name}/deliveries/{delivery_id}/replay",
    response={200: ReplayOut, **TRANSPORT_ERRORS},
    by_alias=True,
    operation_id="replayDeadLetter",
    auth=OPERATOR_AUTH,
    summary="Send a dead letter back to the queue",
)
def replay(
    request: HttpRequest, name: str, delivery_id: str, body: ReplayIn | None = None
) -> operations.ReplayOutcome:
    """Needs ``workqueue:operate`` and ``workqueue.operate_subscription``. The delivery goes back
    to Pending with its attempts reset; an Ordered key's head keeps its place. ``replayed`` is
    false when the delivery is not a dead letter of this subscription."""
    actor: Actor = request.auth  # type: ignore[attr-defined]
    note = body.note if body else None
    outcome = operations.replay(name, delivery_id, note=note, actor=actor)
    if outcome.replayed:
        _log_history(actor, delivery_id, "Replayed", note)
    return outcome


@router.post(
    "/{name}/deliveries/{delivery_id}/discard",
    response={200: DiscardOut, **TRANSPORT_ERRORS},
    by_alias=True,
    operation_id="discardDelivery",
    auth=OPERATOR_AUTH,
    summary="Discard a delivery, or cancel it if it is running",
)
def discard(
    request: HttpRequest, name: str, delivery_id: str, body: DiscardIn
) -> operations.DiscardOutcome:
    """Needs ``workqueue:operate`` and ``workqueue.operate_subscription``. A Pending or dead-
    lettered delivery is discarded; a running one is asked to stop (``cancelRequested``) and
    never runs again (``cancelRequested`` without ``discarded``: it was asked before, and runs
    still). 409 with ``deliveryId`` when its handler holds the delivery in an open
    transaction (completing it inside ``transaction.atomic()``): nothing changed, ask again."""
    actor: Actor = request.auth  # type: ignore[attr-defined]
    outcome = operations.discard(name, delivery_id, reason=body.reason, actor=actor)
    if outcome.discarded:  # also when this call asked for a cancel
        _log_history(actor, delivery_id, "Discarded or cancelled", body.reason)
    return outcome


@router.post(
    "/{name}/dead-letters/replay",
    response={200: BulkOut, **BULK_ERRORS},
    by_alias=True,
    operation_id="replayDeadLetters",
    auth=OPERATOR_AUTH,
    summary="Replay every dead letter matching a filter",
)
def replay_dead_letters(request: HttpRequest, name: str, body: BulkReplayIn) -> Any:
    """Needs ``workqueue:operate`` and ``workqueue.operate_subscription``. Replays the
    subscription's dead letters that match every field of ``filter`` (all of them with an empty
    filter) in batches of 1000, each its own transaction; ``dryRun`` counts them instead.
    Replayed Ordered heads keep their places. A 503 (a 500 when a cloud transport failed) once
    some batches have committed counts what they did (``matched``, ``examined``, ``batches``):
    sending it again goes on with the rest."""
    return _resolve_dead_letters(request, name, "replay", body, body.note, "Replayed")


@router.post(
    "/{name}/dead-letters/discard",
    response={200: BulkOut, **BULK_ERRORS},
    by_alias=True,
    operation_id="discardDeadLetters",
    auth=OPERATOR_AUTH,
    summary="Discard every dead letter matching a filter",
)
def discard_dead_letters(request: HttpRequest, name: str, body: BulkDiscardIn) -> Any:
    """Needs ``workqueue:operate`` and ``workqueue.operate_subscription``. Discards the
    subscription's dead letters that match every field of ``filter`` (all of them with an empty
    filter) in batches of 1000, each its own transaction; ``dryRun`` counts them instead.
    A 503 (a 500 when a cloud transport failed) once some batches have committed counts what
    they did (``matched``, ``examined``, ``batches``): sending it again goes on with the rest."""
    return _resolve_dead_letters(request, name, "discard", body, body.reason, "Discarded")


@router.post(
    "/{name}/pending/discard",
    response={200: BulkOut, **BULK_ERRORS},
    by_alias=True,
    operation_id="discardPending",
    auth=OPERATOR_AUTH,
    summary="Discard every waiting delivery matching a filter",
)
def discard_pending(request: HttpRequest, name: str, body: PendingDiscardIn) -> Any:
    """Needs ``workqueue:operate`` and ``workqueue.operate_subscription``. Discards the
    subscription's Pending deliveries that match every field of ``filter`` (all of them with an
    empty filter), so they never run, in batches of 1000; running deliveries are left alone.
    ``dryRun`` counts them instead. A 503 (a 500 when a cloud transport failed) once some
    batches have committed counts what they did (``matched``, ``examined``, ``batches``):
    sending it again goes on with the rest."""
    actor: Actor = request.auth  # type: ignore[attr-defined]
    selection = operations.PendingSelection(
        partition_key=body.filter.partition_key,
        published_from=body.filter.published_from,
        published_before=body.filter.published_before,
        error_contains=body.filter.error_contains,
    )
    return _logged_bulk(
        lambda: operations.discard_pending(
            name, selection, reason=body.reason, dry_run=body.dry_run, actor=actor
        ),
        actor,
        name,
        "Discarded {} waiting deliveries",
        body.reason,
    )


def _resolve_dead_letters(
    request: HttpRequest,
    name: str,
    action: str,
    body: BulkReplayIn | BulkDiscardIn,
    note: str | None,
    done: str,
) -> Any:
    """Replay or discard (``action``) the dead letters ``body`` selects, logged as ``done``
    ("Replayed") with ``note``."""
    actor: Actor = request.auth  # type: ignore[attr-defined]
    return _logged_bulk(
        lambda: operations.resolve_dead_letters(
            name, action, _selection(body.filter), dry_run=body.dry_run, note=note, actor=actor
        ),
        actor,
        name,
        f"{done} {{}} dead letters",
        note,
    )


def _selection(body: DeadLetterFilterIn) -> operations.DeadLetterSelection:
    return operations.DeadLetterSelection(
        reason=body.dead_letter_reason,
        partition_key=body.partition_key,
        dead_lettered_from=body.dead_lettered_from,
        dead_lettered_before=body.dead_lettered_before,
        error_contains=body.error_contains,
    )


def _logged_bulk(
    run: Callable[[], operations.BulkOutcome],
    actor: Actor,
    subscription_name: str,
    done: str,
    note: str | None,
) -> operations.BulkOutcome:
    """Run a bulk operation and record what it changed (``done``, "Replayed {} dead letters",
    given the count) in the subscription's history. One a failure stopped partway is recorded
    too, with what its committed batches changed, which stays changed; then it fails."""
    try:
        outcome = run()
    except BulkOperationInterrupted as stopped:
        if stopped.matched and not stopped.dry_run:
            batches = count_of(stopped.batches, "batch", "batches")
            what = f"{done.format(stopped.matched)}, stopped by an error after {batches},"
            _log_bulk(actor, subscription_name, what, note)
        raise
    if outcome.matched and not outcome.dry_run:
        _log_bulk(actor, subscription_name, done.format(outcome.matched), note)
    return outcome


def _log_bulk(actor: Actor, subscription_name: str, what: str, note: str | None) -> None:
    """One entry in the admin's history of the subscription for a whole bulk operation (each
    delivery records the actor and note itself)."""
    if actor.user is None or not apps.is_installed("django.contrib.admin"):
        return
    from django.contrib.admin.models import CHANGE, LogEntry

    from workqueue.models import Subscription

    door = f"the REST API with {actor.label}" if actor.label else "the REST API"
    LogEntry.objects.log_actions(
        user_id=actor.user.pk,
        queryset=Subscription.objects.filter(name=subscription_name.strip().lower()),
        action_flag=CHANGE,
        change_message=f"{what} through {door}" + (f" (note: {note})" if note else ""),
    )


def _log_history(actor: Actor, delivery_id: str, what: str, note: str | None) -> None:
    """Record an operation in the admin's history of the delivery, as the admin's own actions
    are: by the acting user, naming the door (the API key) in the message. The admin's history
    exists only with ``django.contrib.admin`` installed."""
    if actor.user is None or not apps.is_installed("django.contrib.admin"):
        return
    # Imported here: the admin's models load only in projects that install the admin.
    from django.contrib.admin.models import CHANGE, LogEntry

    door = f"the REST API with {actor.label}" if actor.label else "the REST API"
    LogEntry.objects.log_actions(
        user_id=actor.user.pk,
        queryset=Delivery.objects.filter(pk=delivery_id),
        action_flag=CHANGE,
        change_message=f"{what} through {door}" + (f" (note: {note})" if note else ""),
    )
