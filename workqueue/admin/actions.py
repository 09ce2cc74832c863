"""Replay and Discard/Cancel as Delivery admin actions.

Each action declares its permission (``@admin.action(permissions=[...])``), so Django offers it
only when ``has_<name>_permission`` allows; those delegate to ``workqueue.operators.permissions``,
the rules the CLI and the REST API use. The first POST shows an intermediate page asking for the
note (replay) or the required reason (discard); the confirmed POST calls the operator operation
once per selected row and reports how each row ended.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.core.exceptions import ValidationError
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse

from workqueue.admin.display import visible_text
from workqueue.exceptions import (
    DeliveryBusyError,
    PermissionDeniedError,
    UnsupportedByTransportError,
    WorkQueueError,
)
from workqueue.input_limits import KEY_UNITS, key_length
from workqueue.operators import operations
from workqueue.operators.permissions import OPERATE, Actor, require

# The operator API pages at most 500 rows; an admin action acts on no more in one go.
MAX_ROWS = 500
ACTION_TEMPLATE = "workqueue/admin/delivery_action.html"
CANCEL_REQUESTED = "cancel requested (running)"
CANCEL_PENDING = "cancel already requested, still running"
HOLDER_CANCEL_REQUESTED = "completed, its handler still running with the key: told to stop"
HOLDER_CANCEL_PENDING = "completed, its handler still running with the key: already told to stop"


def may_operate(request: HttpRequest) -> bool:
    """True when the request's user may replay and discard (the operators' OPERATE rule)."""
    try:
        require(Actor(user=request.user), OPERATE)
    except PermissionDeniedError:
        return False
    return True


def within_note_length(value: str) -> None:
    """A note, reason or error filter the operations take: counted as they count it (an emoji
    as two), not in characters as ``max_length`` does, so that the form refuses, naming the
    field, what each row's operation would refuse with a bare "failed" (audit helper-132)."""
    if key_length(value) > operations.MAX_NOTE_LENGTH:
        raise ValidationError(f"At most {operations.MAX_NOTE_LENGTH} {KEY_UNITS}.")


class ReplayForm(forms.Form):
    note = forms.CharField(
        required=False,
        max_length=operations.MAX_NOTE_LENGTH,
        validators=[within_note_length],
        widget=forms.Textarea(attrs={"rows": 3, "cols": 60}),
        help_text="Optional; recorded on each delivery with your username.",
    )


class DiscardForm(forms.Form):
    reason = forms.CharField(
        max_length=operations.MAX_NOTE_LENGTH,
        validators=[within_note_length],
        widget=forms.Textarea(attrs={"rows": 3, "cols": 60}),
        help_text="Required; recorded on each delivery with your username.",
    )


class DeliveryActionsMixin:
    """The permission hooks Django looks up for the actions' ``permissions=[...]``."""

    def has_replay_permission(self, request: HttpRequest) -> bool:
        return may_operate(request)

    def has_discard_permission(self, request: HttpRequest) -> bool:
        return may_operate(request)


def _report(
    modeladmin: Any, request: HttpRequest, counts: Counter[str], done: str, *, ok: set[str]
) -> None:
    """One message for the whole action: ``Replayed 2; not a dead letter: 1``."""
    others = [f"{label}: {n}" for label, n in counts.items() if label != done and n]
    text = "; ".join([f"{done} {counts[done]}", *others])
    succeeded = sum(n for label, n in counts.items() if label in ok)
    if succeeded == sum(counts.values()):
        level = messages.SUCCESS
    elif succeeded:
        level = messages.WARNING
    else:
        level = messages.ERROR
    modeladmin.message_user(request, text, level)


def _intermediate_page(
    modeladmin: Any,
    request: HttpRequest,
    queryset: QuerySet,
    *,
    form: forms.Form,
    action: str,
    title: str,
    intro: str,
    submit: str,
) -> TemplateResponse:
    opts = modeladmin.model._meta
    request.current_app = modeladmin.admin_site.name
    context = {
        **modeladmin.admin_site.each_context(request),
        "title": title,
        "subtitle": None,
        "intro": intro,
        "submit_label": submit,
        "form": form,
        "action_name": action,
        "deliveries": [
            {
                "pk": delivery.pk,
                "subscription": delivery.subscription.name,
                "status": delivery.status,
                # Drawn with their invisible and reordering characters escaped: a key published
                # as "\u202e24-remotsuc" read "customer-42" on this page (review helper-143).
                "partition_key": visible_text(delivery.partition_key),
                "attempt_count": delivery.attempt_count,
                "dead_letter_reason": visible_text(delivery.dead_letter_reason),
            }
            for delivery in queryset.select_related("subscription").order_by(
                "subscription__name", "pk"
            )
        ],
        "opts": opts,
        "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        "media": modeladmin.media + form.media,
    }
    return TemplateResponse(request, ACTION_TEMPLATE, context)


def _too_many(modeladmin: Any, request: HttpRequest, queryset: QuerySet) -> bool:
    if queryset.count() <= MAX_ROWS:
        return False
    modeladmin.message_user(
        request,
        f"Select at most {MAX_ROWS} deliveries per action (narrow the list with the filters).",
        messages.ERROR,
    )
    return True


def _log_history(
    modeladmin: Any,
    request: HttpRequest,
    queryset: QuerySet,
    changed: list[Any],
    what: str,
    note: str | None,
) -> None:
    """Record each changed delivery in the admin's history (who, when, the note or reason)."""
    message = f"{what} (note: {note})" if note else what
    for delivery in queryset.filter(pk__in=changed):
        modeladmin.log_change(request, delivery, message)


def _apply_each(
    queryset: QuerySet, operate: Callable[[str, Any], tuple[str, bool]]
) -> tuple[Counter[str], list[Any]]:
    """Run ``operate(subscription name, delivery id)`` on each selected row, which returns an
    outcome label and whether it changed the row. Returns the count of each label (refusals and
    failures included) and the ids of the changed rows."""
    counts: Counter[str] = Counter()
    changed: list[Any] = []
    for subscription_name, delivery_id in queryset.order_by("pk").values_list(
        "subscription__name", "pk"
    ):
        try:
            label, did_change = operate(subscription_name, delivery_id)
        except PermissionDeniedError:
            counts["refused"] += 1
        except UnsupportedByTransportError as exc:
            # Named by the missing capability, so the message says what the transport lacks.
            counts[f"not supported by the transport ({exc.capability})"] += 1
        except DeliveryBusyError:
            counts["held by its handler's open transaction (try again in a moment)"] += 1
        except WorkQueueError:
            counts["failed"] += 1
        else:
            counts[label] += 1
            if did_change:
                changed.append(delivery_id)
    return counts, changed


@admin.action(description="Replay selected dead letters", permissions=["replay"])
def replay_deliveries(modeladmin: Any, request: HttpRequest, queryset: QuerySet) -> Any:
    """Ask for an optional note, then replay each selected dead letter."""
    if _too_many(modeladmin, request, queryset):
        return None
    form = ReplayForm(request.POST if request.POST.get("post") else None)
    if not form.is_valid():
        return _intermediate_page(
            modeladmin,
            request,
            queryset,
            form=form,
            action="replay_deliveries",
            title="Replay dead letters",
            intro="Dead letters go back to Pending with their attempts reset; an Ordered "
            "key's head keeps its place. Rows that are not dead letters are left alone.",
            submit="Replay",
        )
    actor = Actor(user=request.user)

    def replay(subscription_name: str, delivery_id: Any) -> tuple[str, bool]:
        outcome = operations.replay(
            subscription_name, delivery_id, note=form.cleaned_data["note"], actor=actor
        )
        return ("Replayed" if outcome.replayed else "not a dead letter"), outcome.replayed

    counts, changed = _apply_each(queryset, replay)
    _log_history(modeladmin, request, queryset, changed, "Replayed", form.cleaned_data["note"])
    _report(modeladmin, request, counts, "Replayed", ok={"Replayed"})
    return None


@admin.action(description="Discard / cancel selected deliveries", permissions=["discard"])
def discard_deliveries(modeladmin: Any, request: HttpRequest, queryset: QuerySet) -> Any:
    """Ask for the required reason, then discard each Pending or dead-lettered row and ask
    the holder of each running row to stop."""
    if _too_many(modeladmin, request, queryset):
        return None
    form = DiscardForm(request.POST if request.POST.get("post") else None)
    if not form.is_valid():
        return _intermediate_page(
            modeladmin,
            request,
            queryset,
            form=form,
            action="discard_deliveries",
            title="Discard or cancel deliveries",
            intro="Pending and dead-lettered deliveries become Discarded and never run. A "
            "running delivery's holder is asked to stop; it is then Discarded. Completed and "
            "Discarded rows are left alone, but a handler that completed its delivery in its "
            "own transaction and still runs, holding the delivery's partition key, is asked to "
            "stop (the delivery stays Completed; the key is free when it returns).",
            submit="Discard",
        )
    actor = Actor(user=request.user)

    def discard(subscription_name: str, delivery_id: Any) -> tuple[str, bool]:
        outcome = operations.discard(
            subscription_name, delivery_id, reason=form.cleaned_data["reason"], actor=actor
        )
        if outcome.holds_key:
            told = HOLDER_CANCEL_REQUESTED if outcome.discarded else HOLDER_CANCEL_PENDING
            return told, outcome.discarded
        if outcome.cancel_requested:
            return (CANCEL_REQUESTED if outcome.discarded else CANCEL_PENDING), outcome.discarded
        return ("Discarded" if outcome.discarded else "already finished"), outcome.discarded

    counts, changed = _apply_each(queryset, discard)
    _log_history(
        modeladmin,
        request,
        queryset,
        changed,
        "Discarded or cancelled",
        form.cleaned_data["reason"],
    )
    _report(
        modeladmin,
        request,
        counts,
        "Discarded",
        ok={
            "Discarded",
            CANCEL_REQUESTED,
            CANCEL_PENDING,
            HOLDER_CANCEL_REQUESTED,
            HOLDER_CANCEL_PENDING,
        },
    )
    return None
