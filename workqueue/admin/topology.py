"""Admin for the topology: transports, topics and subscriptions (ordinary, editable models).

The ModelAdmin's form runs the model's ``full_clean()``, so the rules in ``clean()`` (filter
grammar, backoff order, handler key, partition mode fixed once deliveries exist) are shown on the
form next to the field they concern.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html

from workqueue.admin.display import visible_json
from workqueue.admin.lookups import DeclaredFiltersAdmin, RefusesNulLookups
from workqueue.admin.recovery import DeadLetterRecoveryMixin, recover_dead_letters
from workqueue.exceptions import WorkQueueConfigurationError, WorkQueueError
from workqueue.models import Subscription, Topic, Transport
from workqueue.transports.base import without_url_credentials


class TopologyForm(forms.ModelForm):
    """A model form that never fails on a model error for a field it does not show.

    ``clean()`` reports errors by field name; ``BaseForm.add_error`` raises ``ValueError`` for a
    name that is not a form field (for example one an admin made read-only), which would turn a
    validation message into a server error. Such messages are shown above the form instead,
    prefixed with the field's name.
    """

    def add_error(self, field: str | None, error: Any) -> None:
        if field is None and isinstance(error, ValidationError) and hasattr(error, "error_dict"):
            kept: dict[str, list[Any]] = {}
            for name, errors in error.error_dict.items():
                if name == NON_FIELD_ERRORS or name in self.fields:
                    kept.setdefault(name, []).extend(errors)
                    continue
                label = name.replace("_", " ")
                for message in ValidationError(errors).messages:
                    kept.setdefault(NON_FIELD_ERRORS, []).append(
                        ValidationError(f"{label}: {message}")
                    )
            error = ValidationError(kept)
        super().add_error(field, error)


# Change permission, not view: the dry run calls the cloud's API with the server's credentials.
@admin.action(description="Show what provisioning would change (dry run)", permissions=["change"])
def show_provisioning(modeladmin: Any, request: HttpRequest, queryset: QuerySet) -> None:
    """``manage.py workqueue provision --dry-run`` for the selected transports: each resource
    that would be created or updated, or that nothing would change. Creates nothing."""
    # Imported here: the admin reaches operators only when an action runs.
    from workqueue.operators.topology import provision

    for row in queryset.order_by("name"):
        try:
            report = provision(row.name, dry_run=True)
        except WorkQueueError as exc:
            modeladmin.message_user(request, f"{row.name}: {exc}", messages.ERROR)
            continue
        changes = [c for c in report.changes.get(row.name, []) if c.action != "keep"]
        if not changes:
            modeladmin.message_user(request, f"{row.name}: no changes.", messages.SUCCESS)
        for change in changes:
            detail = f" ({change.detail})" if change.detail else ""
            modeladmin.message_user(
                request,
                f"{row.name}: would {change.action} {change.kind} {change.name}{detail}",
                messages.WARNING,
            )


class RefusesDeletesQueueRowsHold:
    """Deleting a topic or subscription that queue rows still refer to is refused (their
    foreign keys protect them). Django's confirmation page (and "Delete selected"'s) would first
    load and list every such row: for a subscription with 200,000 deliveries, 18 s and 700 MB
    of the web process to say no. One existence check per object says it instead, and how to
    retire it."""

    def get_deleted_objects(self, objs: Any, request: HttpRequest) -> Any:
        held = [reason for obj in objs if (reason := _queue_rows_holding(obj)) is not None]
        if held:
            return [], {}, set(), held
        return super().get_deleted_objects(objs, request)  # type: ignore[misc]


def _queue_rows_holding(obj: Topic | Subscription) -> str | None:
    """Why queue rows keep ``obj`` from being deleted, or None when none refer to it."""
    # Imported here: the topology admin reads the queue tables only to refuse a delete.
    from workqueue.models import Deduplication, Delivery, Message

    if isinstance(obj, Subscription):
        if Delivery.objects.filter(subscription=obj).exists():
            return (
                f"Subscription {obj.name}: its deliveries (waiting, running, dead-lettered or "
                "kept for retention). Retire it with `manage.py workqueue retire-subscription "
                f"{obj.name}`, which deals with its work and then deletes it."
            )
        return None
    if Message.objects.filter(topic=obj).exists() or (
        Deduplication.objects.filter(topic=obj).exists()
    ):
        # Waiting work and dead letters keep their messages for ever (review helper-164: "once
        # the sweeper has purged them" sent an operator waiting for nothing).
        return (
            f"Topic {obj.name}: its messages or deduplication records. The sweeper purges a "
            f"message {obj.retention_days} days (its retention) after its deliveries settled, "
            "never while one waits or is dead-lettered. Disable the topic, retire its "
            "subscriptions (`manage.py workqueue retire-subscription NAME` deals with their "
            "work), and delete it once the sweeper has purged the rest."
        )
    return None


@admin.register(Transport)
class TransportAdmin(DeclaredFiltersAdmin):
    # Declared filters only: ``?configuration__endpoint_url__contains=`` would probe, row by
    # row, the credentials the page leaves out (review helper-143).
    form = TopologyForm
    actions = [show_provisioning]
    list_display = ("name", "driver_class", "status", "description")
    list_filter = ("status", "driver_class")
    search_fields = ("name", "description")
    readonly_fields = ("capabilities",)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        # The configuration says where messages go and with which credentials (a cloud
        # transport's endpoint_url and profile): whoever sets it receives every payload sent
        # through the transport, signed with the server's keys, whatever their own payload
        # permission. Superusers only, or code (sync-topology).
        if request.user.is_superuser:
            return self.readonly_fields
        return (*self.readonly_fields, "configuration", "configuration_shown")

    def get_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        fields = list(super().get_fields(request, obj))
        if request.user.is_superuser:
            return [name for name in fields if name != "configuration_shown"]
        # Read, not edited: shown without the credentials a URL in it may carry (a proxy's
        # user and password in endpoint_url), which only those who may set it need to see
        # (review helper-143: every user allowed to view transports read them).
        return [name for name in fields if name != "configuration"]

    @admin.display(description="Configuration")
    def configuration_shown(self, obj: Transport) -> str:
        if obj.configuration is None:
            return self.get_empty_value_display()
        shown = visible_json(without_url_credentials(obj.configuration), indent=2)
        return format_html("<pre>{}</pre>", shown)

    @admin.display(description="Capabilities")
    def capabilities(self, obj: Transport) -> str:
        """What the transport honours (its class's flags); an operator reads why a subscription
        is Unsupported or an operation refused here."""
        try:
            flags = obj.transport_class.capabilities()
        except WorkQueueConfigurationError as exc:
            return str(exc)
        return "; ".join(
            f"{name}: {', '.join(value) if isinstance(value, list) else 'yes' if value else 'no'}"
            for name, value in flags.items()
        )


@admin.register(Topic)
class TopicAdmin(RefusesDeletesQueueRowsHold, RefusesNulLookups):
    form = TopologyForm
    list_display = (
        "name",
        "transport",
        "status",
        "allow_external_publish",
        "max_payload_bytes",
        "retention_days",
    )
    list_filter = ("status", "allow_external_publish", "transport")
    list_select_related = ("transport",)
    search_fields = ("name", "description")


@admin.register(Subscription)
class SubscriptionAdmin(RefusesDeletesQueueRowsHold, DeadLetterRecoveryMixin, RefusesNulLookups):
    form = TopologyForm
    actions = [recover_dead_letters]
    list_display = (
        "name",
        "topic",
        "status",
        "partition_mode",
        "host_type",
        "handler_key",
        "max_attempts",
        "lease_seconds",
    )
    list_filter = ("status", "partition_mode", "host_type", "topic")
    list_select_related = ("topic",)
    search_fields = ("name", "handler_key", "topic__name", "description")
    fieldsets = (
        (None, {"fields": ("name", "topic", "description", "status")}),
        ("Routing", {"fields": ("filter", "partition_mode")}),
        (
            "Execution",
            {
                "fields": (
                    "host_type",
                    "handler_key",
                    "max_attempts",
                    ("backoff_base_seconds", "backoff_max_seconds"),
                    "lease_seconds",
                    "heartbeat_mode",
                    "max_processing_seconds",
                    ("rate_limit_per_second", "rate_limit_burst"),
                )
            },
        ),
        (
            "Binding",
            {"classes": ("collapse",), "fields": ("external_ref", "binding_config")},
        ),
    )
