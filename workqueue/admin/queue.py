"""View-only admin for the driver-owned queue tables: messages, deliveries, deduplication rows.

Only the ``wq_*`` procedures write these tables, so the admin offers no add, change or delete
(procrastinate's view-only admin); deliveries change through the Replay and Discard/Cancel
actions, which call the operator operations. Payloads are shown only to users with
``workqueue.view_payload``, and the lists accept only their declared filters and an exact search,
so no query string can probe a column the pages do not show.
"""

from __future__ import annotations

import uuid
from typing import Any

from django.contrib import admin
from django.db.models import Model, Q, QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html

from workqueue.admin.actions import DeliveryActionsMixin, discard_deliveries, replay_deliveries
from workqueue.admin.dashboard import DashboardMixin
from workqueue.admin.display import stored_text, visible_json, visible_text
from workqueue.admin.lookups import DeclaredFiltersAdmin
from workqueue.models import Deduplication, Delivery, Message
from workqueue.operators.display import error_summary, short_id
from workqueue.operators.permissions import Actor, may_view_payload

PAYLOAD_FIELDS = ("payload", "payload_ref")


def _uuid(term: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(term)
    except ValueError:
        return None


class ViewOnlyAdmin(DeclaredFiltersAdmin):
    """Lists and detail pages only; the rows belong to the stored procedures. The lists answer
    only their declared filters and an exact search: no query string probes a payload."""

    show_full_result_count = False
    list_per_page = 100
    #: Fields whose stored text publishers or handlers chose, each drawn on the detail page by
    #: the method named here instead (its invisible and reordering characters escaped:
    #: workqueue.admin.display). Applied after the fields a user may not see are left out.
    shown_as: dict[str, str] = {}

    def shown_fields(self, fields: list[str]) -> list[str]:
        """``fields`` with each one in ``shown_as`` replaced by its drawing method."""
        return [self.shown_as.get(name, name) for name in fields]

    def get_readonly_fields(self, request: HttpRequest, obj: Model | None = None) -> Any:
        return (*super().get_readonly_fields(request, obj), *self.shown_as.values())

    def _text(self, value: str | None, *, lines: bool = False) -> str:
        shown = visible_text(value, lines=lines)
        # A readonly method's None would be drawn as "None".
        return self.get_empty_value_display() if shown is None else shown

    def _json(self, value: Any) -> str:
        if value is None:
            return self.get_empty_value_display()
        return format_html("<pre>{}</pre>", visible_json(value, indent=2))

    def has_add_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def exact_search(self, term: str) -> Q:
        """The rows a search term names exactly (ids, keys and correlation ids are exact)."""
        raise NotImplementedError

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet, search_term: str
    ) -> tuple[QuerySet, bool]:
        # Exact matches only: they use the indexes, and a partition key is compared byte for
        # byte everywhere else too.
        term = search_term.strip()
        if not term:
            return queryset, False
        found = self.exact_search(term)
        if (stored := stored_text(term)) != term:
            # A key copied from these pages, where its invisible characters show as escapes.
            found |= self.exact_search(stored)
        return queryset.filter(found), False


@admin.register(Message)
class MessageAdmin(ViewOnlyAdmin):
    list_display = (
        "id",
        "topic",
        "key",
        "correlation",
        "published_at",
        "published_by",
    )
    list_filter = ("topic",)
    list_select_related = ("topic",)
    ordering = ("-publish_ordinal",)
    search_fields = ("id", "partition_key", "correlation_id")
    search_help_text = "An exact message id, partition key or correlation id."
    shown_as = {
        "partition_key": "key",
        "correlation_id": "correlation",
        "attributes": "message_attributes",
        "payload": "payload_shown",
        "payload_ref": "payload_ref_shown",
    }

    def exact_search(self, term: str) -> Q:
        found = Q(partition_key=term) | Q(correlation_id=term)
        if (term_id := _uuid(term)) is not None:
            found |= Q(pk=term_id)
        return found

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        # The list shows no payload, and reading a hundred of them whole to draw it held up to
        # a gigabyte (JSON of empty objects decodes to some 25 times its size). A message's own
        # page reads its payload when it draws it.
        return super().get_queryset(request).defer(*PAYLOAD_FIELDS)

    def get_fields(self, request: HttpRequest, obj: Model | None = None) -> list[str]:
        fields = [f for f in super().get_fields(request, obj) if f not in self.shown_as.values()]
        if not may_view_payload(Actor(user=request.user)):
            fields = [name for name in fields if name not in PAYLOAD_FIELDS]
        # After the payload is left out: only the fields kept are swapped for their drawing.
        return self.shown_fields(fields)

    @admin.display(description="partition key", ordering="partition_key")
    def key(self, obj: Message) -> str:
        return self._text(obj.partition_key)

    @admin.display(description="correlation id", ordering="correlation_id")
    def correlation(self, obj: Message) -> str:
        return self._text(obj.correlation_id)

    @admin.display(description="attributes")
    def message_attributes(self, obj: Message) -> str:
        return self._json(obj.attributes)

    @admin.display(description="payload")
    def payload_shown(self, obj: Message) -> str:
        # Only listed in get_fields() for users with workqueue.view_payload.
        return self._json(obj.payload)

    @admin.display(description="payload reference")
    def payload_ref_shown(self, obj: Message) -> str:
        # Only listed in get_fields() for users with workqueue.view_payload.
        return self._json(obj.payload_ref)


@admin.register(Delivery)
class DeliveryAdmin(DashboardMixin, DeliveryActionsMixin, ViewOnlyAdmin):
    actions = [replay_deliveries, discard_deliveries]
    change_list_template = "workqueue/admin/delivery_change_list.html"
    list_display = (
        "short_id",
        "subscription",
        "status",
        "key",
        "attempt_count",
        "is_replay",
        "priority",
        "visible_at",
        "reason",
        "last_error_line",
        "cancel_requested_at",
    )
    list_filter = ("status", "subscription", "is_replay")
    list_select_related = ("subscription",)
    # Newest first along the primary key (ids are time-ordered): ordered by order_key, which no
    # index of all deliveries leads with, the first page sorted the whole table (over a second
    # at a few million rows).
    ordering = ("-id",)
    search_fields = ("id", "message__id", "partition_key", "message__correlation_id")
    search_help_text = (
        "An exact delivery id, message id, partition key or correlation id of the message."
    )
    readonly_fields = ("message_link", "message_payload")
    shown_as = {
        "partition_key": "key",
        "dead_letter_reason": "reason",
        "last_error": "error",
        "progress": "progress_shown",
        "resolution_note": "note",
    }

    def exact_search(self, term: str) -> Q:
        found = Q(partition_key=term) | Q(message__correlation_id=term)
        if (term_id := _uuid(term)) is not None:
            found |= Q(pk=term_id) | Q(message_id=term_id)
        return found

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        # The list shows no progress, which a lease holder writes (review helper-173: any size
        # through the procedure, 8 MB a row); a delivery's own page reads it to draw it.
        return super().get_queryset(request).defer("progress")

    def get_fields(self, request: HttpRequest, obj: Model | None = None) -> list[str]:
        # The lease token is for its holder alone; the runtime role may not even read it.
        hidden = {*self.readonly_fields, *self.shown_as.values(), "lease_token"}
        fields = [f for f in super().get_fields(request, obj) if f not in hidden]
        extra = ["message_link"]
        if may_view_payload(Actor(user=request.user)):
            extra.append("message_payload")
        return [*extra, *self.shown_fields([f for f in fields if f != "message"])]

    @admin.display(description="partition key", ordering="partition_key")
    def key(self, obj: Delivery) -> str:
        return self._text(obj.partition_key)

    @admin.display(description="dead-letter reason", ordering="dead_letter_reason")
    def reason(self, obj: Delivery) -> str:
        return self._text(obj.dead_letter_reason)

    @admin.display(description="last error")
    def error(self, obj: Delivery) -> str:
        return self._text(obj.last_error, lines=True)

    @admin.display(description="progress")
    def progress_shown(self, obj: Delivery) -> str:
        return self._json(obj.progress)

    @admin.display(description="resolution note")
    def note(self, obj: Delivery) -> str:
        return self._text(obj.resolution_note, lines=True)

    @admin.display(description="id", ordering="id")
    def short_id(self, obj: Delivery) -> str:
        # The full id is on the detail page and in its title; search takes the full id.
        return format_html('<span title="{}">{}</span>', obj.pk, short_id(obj.pk))

    @admin.display(description="last error")
    def last_error_line(self, obj: Delivery) -> str:
        return visible_text(error_summary(obj.last_error, width=80)) or ""

    @admin.display(description="message")
    def message_link(self, obj: Delivery) -> str:
        url = reverse(f"{self.admin_site.name}:workqueue_message_change", args=[obj.message_id])
        return format_html('<a href="{}">{}</a>', url, obj.message_id)

    @admin.display(description="payload")
    def message_payload(self, obj: Delivery) -> str:
        # Only listed in get_fields() for users with workqueue.view_payload. A claim-check
        # message shows its reference, where the payload is kept, instead.
        message = obj.message
        if message.payload_ref is not None:
            return format_html(
                "<p>Reference (claim check):</p><pre>{}</pre>",
                visible_json(message.payload_ref, indent=2),
            )
        return format_html("<pre>{}</pre>", visible_json(message.payload, indent=2))


@admin.register(Deduplication)
class DeduplicationAdmin(ViewOnlyAdmin):
    list_display = ("key", "topic", "message_id", "status", "expires_at")
    list_filter = ("status", "topic")
    list_select_related = ("topic",)
    ordering = ("-expires_at",)
    search_fields = ("deduplication_key", "message_id")
    search_help_text = "An exact deduplication key or message id."
    shown_as = {"deduplication_key": "key"}

    def get_fields(self, request: HttpRequest, obj: Model | None = None) -> list[str]:
        fields = [f for f in super().get_fields(request, obj) if f not in self.shown_as.values()]
        return self.shown_fields(fields)

    @admin.display(description="deduplication key", ordering="deduplication_key")
    def key(self, obj: Deduplication) -> str:
        return self._text(obj.deduplication_key)

    def exact_search(self, term: str) -> Q:
        found = Q(deduplication_key=term)
        if (term_id := _uuid(term)) is not None:
            found |= Q(message_id=term_id)
        return found
