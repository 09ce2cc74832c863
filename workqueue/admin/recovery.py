"""Bulk recovery from the Subscription admin: replay or discard every dead letter of the
selected subscriptions that matches a filter, after a dry run that counts them. It acts on all
matching dead letters in the database, not on a page of the list (the same operation as
``manage.py workqueue replay-dead-letters`` and ``POST .../dead-letters/replay``)."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse

from workqueue.admin.actions import may_operate
from workqueue.exceptions import PermissionDeniedError, WorkQueueError
from workqueue.operators import operations
from workqueue.operators.permissions import Actor

TEMPLATE = "workqueue/admin/dead_letter_recovery.html"


class DeadLetterRecoveryForm(forms.Form):
    # Not "action": the admin's own POST field of that name names the action being run.
    operation = forms.ChoiceField(
        choices=[("replay", "Replay (back to Pending)"), ("discard", "Discard")],
        widget=forms.RadioSelect,
        initial="replay",
    )
    dead_letter_reason = forms.CharField(
        required=False, max_length=100, help_text="e.g. MaxAttemptsExceeded; empty: any."
    )
    partition_key = forms.CharField(required=False, max_length=200, help_text="Empty: any.")
    dead_lettered_from = forms.DateTimeField(
        required=False, help_text="Dead-lettered at or after (server time zone)."
    )
    dead_lettered_before = forms.DateTimeField(required=False, help_text="Dead-lettered before.")
    error_contains = forms.CharField(
        required=False, max_length=operations.MAX_NOTE_LENGTH, help_text="Any case."
    )
    note = forms.CharField(
        required=False,
        max_length=operations.MAX_NOTE_LENGTH,
        widget=forms.Textarea(attrs={"rows": 2, "cols": 60}),
        help_text="Recorded on each delivery with your username; required to discard.",
    )

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if data.get("operation") == "discard" and not (data.get("note") or "").strip():
            self.add_error("note", "Say why the dead letters are discarded.")
        return data

    def selection(self) -> operations.DeadLetterSelection:
        data = self.cleaned_data
        return operations.DeadLetterSelection(
            reason=data["dead_letter_reason"] or None,
            partition_key=data["partition_key"] or None,
            dead_lettered_from=data["dead_lettered_from"],
            dead_lettered_before=data["dead_lettered_before"],
            error_contains=data["error_contains"] or None,
        )


class DeadLetterRecoveryMixin:
    """The permission hook Django looks up for the action's ``permissions=["recover"]``."""

    def has_recover_permission(self, request: HttpRequest) -> bool:
        return may_operate(request)


@admin.action(description="Replay or discard dead letters by filter…", permissions=["recover"])
def recover_dead_letters(modeladmin: Any, request: HttpRequest, queryset: QuerySet) -> Any:
    """First POST: the filter form. "Count" runs a dry run and shows the counts on the same
    page; "Apply" replays or discards every matching dead letter of each selected
    subscription, in bounded batches, and records the operation in each one's history."""
    bound = request.POST.get("post") in ("count", "apply")
    form = DeadLetterRecoveryForm(request.POST if bound else None)
    subscriptions = list(queryset.order_by("name").values_list("name", flat=True))
    counts: list[tuple[str, str]] = []
    if bound and form.is_valid():
        dry_run = request.POST["post"] == "count"
        data = form.cleaned_data
        actor = Actor(user=request.user)
        results = []
        for name in subscriptions:
            try:
                outcome = operations.resolve_dead_letters(
                    name,
                    data["operation"],
                    form.selection(),
                    dry_run=dry_run,
                    note=data["note"] or None,
                    actor=actor,
                )
            except PermissionDeniedError:
                results.append((name, "refused: you may not operate this subscription"))
                continue
            except WorkQueueError as exc:
                results.append((name, f"failed: {exc}"))
                continue
            verb = "would be" if dry_run else "were"
            done = "replayed" if data["operation"] == "replay" else "discarded"
            results.append((name, f"{outcome.matched} of {outcome.examined} {verb} {done}"))
            if not dry_run and outcome.matched:
                note = f" (note: {data['note']})" if data["note"] else ""
                subscription = queryset.get(name=name)
                modeladmin.log_change(
                    request,
                    subscription,
                    f"{done.capitalize()} {outcome.matched} dead letters{note}",
                )
        if not dry_run:
            summary = "; ".join(f"{name}: {text}" for name, text in results)
            failed = any(text.startswith(("refused", "failed")) for _, text in results)
            modeladmin.message_user(
                request, summary, messages.WARNING if failed else messages.SUCCESS
            )
            return None
        counts = results
    opts = modeladmin.model._meta
    request.current_app = modeladmin.admin_site.name
    context = {
        **modeladmin.admin_site.each_context(request),
        "title": "Replay or discard dead letters",
        "subtitle": None,
        "form": form,
        "subscriptions": subscriptions,
        "selected": queryset.values_list("pk", flat=True),
        "counts": counts,
        "opts": opts,
        "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        "media": modeladmin.media + form.media,
    }
    return TemplateResponse(request, TEMPLATE, context)
