"""Bulk recovery from the Subscription admin: replay or discard every dead letter of the
selected subscriptions that matches a filter, or discard their matching waiting deliveries,
after a dry run that counts them. It acts on all
matching dead letters in the database, not on a page of the list (the same operation as
``manage.py workqueue replay-dead-letters`` and ``POST .../dead-letters/replay``)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils import timezone

from workqueue.admin.actions import may_operate, within_note_length
from workqueue.exceptions import (
    BulkOperationInterrupted,
    PermissionDeniedError,
    UnsupportedByTransportError,
    WorkQueueError,
    one_line,
)
from workqueue.operators import operations
from workqueue.operators.display import count_of
from workqueue.operators.permissions import Actor

TEMPLATE = "workqueue/admin/dead_letter_recovery.html"


class DeadLetterRecoveryForm(forms.Form):
    # Not "action": the admin's own POST field of that name names the action being run.
    operation = forms.ChoiceField(
        choices=[
            ("replay", "Replay dead letters (back to Pending)"),
            ("discard", "Discard dead letters"),
            ("discard_pending", "Discard waiting (Pending) deliveries; running ones are left"),
        ],
        widget=forms.RadioSelect,
        initial="replay",
    )
    # Untrimmed, so that a blank one is refused (below), not read as no filter.
    dead_letter_reason = forms.CharField(
        required=False,
        strip=False,
        max_length=100,
        help_text="Dead letters only: e.g. MaxAttemptsExceeded; empty: any.",
    )
    # Untrimmed, both filters: keys are compared exactly as published ("c-7 " is not "c-7", and
    # " " is a key), and text trimmed matches more than was asked for (audit helper-132).
    partition_key = forms.CharField(
        required=False, strip=False, max_length=200, help_text="Empty: any."
    )
    since = forms.DateTimeField(
        required=False,
        help_text="Dead-lettered (waiting deliveries: published) at or after this time, in "
        "the server's time zone.",
    )
    before = forms.DateTimeField(required=False, help_text="... and before this time.")
    error_contains = forms.CharField(
        required=False,
        strip=False,
        max_length=operations.MAX_NOTE_LENGTH,
        validators=[within_note_length],
        help_text="Text the last error contains, any case.",
    )
    note = forms.CharField(
        required=False,
        max_length=operations.MAX_NOTE_LENGTH,
        validators=[within_note_length],
        widget=forms.Textarea(attrs={"rows": 2, "cols": 60}),
        help_text="Recorded on each delivery with your username; required to discard.",
    )

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        operation = data.get("operation")
        if operation != "replay" and not (data.get("note") or "").strip():
            self.add_error("note", "Say why they are discarded.")
        if operation == "discard_pending" and data.get("dead_letter_reason"):
            self.add_error("dead_letter_reason", "Waiting deliveries have no dead-letter reason.")
        for name, what in (("error_contains", "error"), ("dead_letter_reason", "reason")):
            if (text := data.get(name)) and not text.strip():
                # As the CLI and REST refuse it: read as no filter, it would match every
                # delivery (the reason's was trimmed into none: review helper-190).
                self.add_error(
                    name, f"The {what} filter is blank: leave it empty to match any {what}."
                )
        for name in ("since", "before"):
            if (when := data.get(name)) is not None and timezone.is_naive(when):
                # USE_TZ = False gives times without a zone, which the operations refuse:
                # read in the current time zone, as the CLI reads --since (helper-190).
                data[name] = timezone.make_aware(when)
        return data

    def selection_fingerprint(self) -> str:
        """What the operation would act on (operation and filters, not the note): a count's
        fingerprint, which Apply must match, so the rows applied are the rows counted."""
        data = self.cleaned_data
        chosen = [
            data.get(name)
            for name in ("operation", "dead_letter_reason", "partition_key", "error_contains")
        ] + [data[name].isoformat() if data.get(name) else None for name in ("since", "before")]
        return hashlib.sha256(json.dumps(chosen).encode()).hexdigest()[:32]

    def run(self, subscription_name: str, *, dry_run: bool, actor: Actor) -> Any:
        """The chosen operation on one subscription (its permission checked there)."""
        data = self.cleaned_data
        if data["operation"] == "discard_pending":
            selection = operations.PendingSelection(
                partition_key=data["partition_key"] or None,
                published_from=data["since"],
                published_before=data["before"],
                error_contains=data["error_contains"] or None,
            )
            return operations.discard_pending(
                subscription_name, selection, reason=data["note"], dry_run=dry_run, actor=actor
            )
        return operations.resolve_dead_letters(
            subscription_name,
            data["operation"],
            operations.DeadLetterSelection(
                reason=data["dead_letter_reason"] or None,
                partition_key=data["partition_key"] or None,
                dead_lettered_from=data["since"],
                dead_lettered_before=data["before"],
                error_contains=data["error_contains"] or None,
            ),
            dry_run=dry_run,
            note=data["note"] or None,
            actor=actor,
        )


class DeadLetterRecoveryMixin:
    """The permission hook Django looks up for the action's ``permissions=["recover"]``."""

    def has_recover_permission(self, request: HttpRequest) -> bool:
        return may_operate(request)


@admin.action(
    description="Replay or discard dead letters, or discard waiting work, by filter…",
    permissions=["recover"],
)
def recover_dead_letters(modeladmin: Any, request: HttpRequest, queryset: QuerySet) -> Any:
    """First POST: the filter form. "Count" runs a dry run and shows the counts on the same
    page; "Apply" replays or discards every matching dead letter (or discards every matching
    waiting delivery) of each selected subscription, in bounded batches, and records the
    operation in each one's history."""
    bound = request.POST.get("post") in ("count", "apply")
    form = DeadLetterRecoveryForm(request.POST if bound else None)
    subscriptions = list(queryset.order_by("name").values_list("name", flat=True))
    counts: list[tuple[str, str]] = []
    counted = ""
    if (
        bound
        and form.is_valid()
        and request.POST["post"] == "apply"
        and request.POST.get("counted") != form.selection_fingerprint()
    ):
        # Filters edited after the count (or never counted): what Apply would change is not
        # what the page showed.
        form.add_error(
            None,
            "The operation or filters are not the ones counted: press Count (dry run), check "
            "the counts, then Apply.",
        )
    if bound and form.is_valid():
        dry_run = request.POST["post"] == "count"
        data = form.cleaned_data
        actor = Actor(user=request.user)
        verb = "would be" if dry_run else "were"
        done = "replayed" if data["operation"] == "replay" else "discarded"
        rows = "waiting deliveries" if data["operation"] == "discard_pending" else "dead letters"
        note = f" (note: {data['note']})" if data["note"] else ""
        results = []
        for name in subscriptions:
            try:
                outcome = form.run(name, dry_run=dry_run, actor=actor)
            except PermissionDeniedError as exc:
                # Which permission is missing: operating, or reading for a filter on content.
                results.append((name, f"refused: {exc}"))
                continue
            except UnsupportedByTransportError as exc:
                results.append((name, f"not supported: {exc}"))
                continue
            except BulkOperationInterrupted as stopped:
                # The batches before the failure committed: say how much they did, and record
                # it, as for a whole operation.
                batches = count_of(stopped.batches, "batch", "batches")
                then = (
                    "nothing was changed: Count again to count them all"
                    if dry_run
                    else f"they stay {done}: Count and Apply again for what is left"
                )
                results.append(
                    (
                        name,
                        f"stopped by an error after {stopped.matched} of {stopped.examined} "
                        f"{rows} {verb} {done} (in {batches}; {then}): "
                        f"{one_line(stopped.__cause__ or stopped)}",
                    )
                )
                if not dry_run and stopped.matched:
                    modeladmin.log_change(
                        request,
                        queryset.get(name=name),
                        f"{done.capitalize()} {stopped.matched} {rows}, stopped by an error "
                        f"after {batches}{note}",
                    )
                continue
            except WorkQueueError as exc:
                results.append((name, f"failed: {exc}"))
                continue
            results.append((name, f"{outcome.matched} of {outcome.examined} {rows} {verb} {done}"))
            if not dry_run and outcome.matched:
                subscription = queryset.get(name=name)
                modeladmin.log_change(
                    request, subscription, f"{done.capitalize()} {outcome.matched} {rows}{note}"
                )
        if not dry_run:
            summary = "; ".join(f"{name}: {text}" for name, text in results)
            failed = any(
                text.startswith(("refused", "stopped", "failed", "not supported"))
                for _, text in results
            )
            modeladmin.message_user(
                request, summary, messages.WARNING if failed else messages.SUCCESS
            )
            return None
        counts = results
        counted = form.selection_fingerprint()
    opts = modeladmin.model._meta
    request.current_app = modeladmin.admin_site.name
    context = {
        **modeladmin.admin_site.each_context(request),
        "title": "Replay or discard dead letters, or discard waiting work",
        "subtitle": None,
        "form": form,
        "subscriptions": subscriptions,
        "selected": queryset.values_list("pk", flat=True),
        "counts": counts,
        "counted": counted,
        "opts": opts,
        "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        "media": modeladmin.media + form.media,
    }
    return TemplateResponse(request, TEMPLATE, context)
