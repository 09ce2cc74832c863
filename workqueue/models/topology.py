"""Topology: transports, topics and subscriptions (ordinary, validated Django models)."""

from __future__ import annotations

import re
import uuid
from typing import Any

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import connections, models, router, transaction
from django.db.models import Q

from workqueue.filters import FilterError, parse_filter
from workqueue.types import (
    HeartbeatMode,
    HostType,
    PartitionMode,
    SubscriptionStatus,
    TopologyStatus,
)

DATABASE_DRIVER = "Database"
MAX_PAYLOAD_BYTES = 262_144

# Topic and subscription names: lower-case words of letters and digits joined by '.', '_' or '-'.
# \A...\Z, not ^...$: RegexValidator searches, and `$` also matches before a trailing newline.
DOTTED_NAME = re.compile(r"\A[a-z0-9]+(?:[._-][a-z0-9]+)*\Z")
TRANSPORT_NAME = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]*\Z")

dotted_name_validator = RegexValidator(
    DOTTED_NAME,
    "Use lower-case words of letters and digits joined by '.', '_' or '-' (e.g. orders.created).",
)
transport_name_validator = RegexValidator(
    TRANSPORT_NAME, "Use letters, digits, '.', '_' or '-', starting with a letter or digit."
)


def _require_json_object(value: Any, field: str) -> None:
    if value is not None and not isinstance(value, dict):
        raise ValidationError({field: "Must be a JSON object."})


class Transport(models.Model):
    """Where a topic's messages live. ``Database`` keeps them in this database's queue tables."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=100, unique=True, validators=[transport_name_validator])
    description = models.TextField(blank=True, default="")
    driver_class = models.CharField(max_length=100, default=DATABASE_DRIVER)
    configuration = models.JSONField(null=True, blank=True)
    status = models.CharField(
        max_length=20, choices=TopologyStatus.choices, default=TopologyStatus.ACTIVE
    )

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=Q(status__in=TopologyStatus.values), name="wq_transport_status_valid"
            ),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def is_database(self) -> bool:
        return self.driver_class == DATABASE_DRIVER

    def clean(self) -> None:
        _require_json_object(self.configuration, "configuration")
        if self.driver_class != DATABASE_DRIVER:
            raise ValidationError(
                {"driver_class": f"Only the '{DATABASE_DRIVER}' transport is available."}
            )


class Topic(models.Model):
    """A named stream of messages; each publish fans out to the topic's subscriptions."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=200, unique=True, validators=[dotted_name_validator])
    description = models.TextField(blank=True, default="")
    transport = models.ForeignKey(Transport, on_delete=models.PROTECT, related_name="topics")
    is_fifo = models.BooleanField(default=False)
    allow_external_publish = models.BooleanField(
        default=False, help_text="Allow publishing through the REST API (with an API key)."
    )
    max_payload_bytes = models.PositiveIntegerField(
        default=MAX_PAYLOAD_BYTES,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_PAYLOAD_BYTES)],
    )
    default_deduplication_ttl_seconds = models.PositiveIntegerField(
        default=86_400, validators=[MinValueValidator(60), MaxValueValidator(2_592_000)]
    )
    retention_days = models.PositiveIntegerField(default=7, validators=[MinValueValidator(1)])
    binding_config = models.JSONField(null=True, blank=True)
    status = models.CharField(
        max_length=20, choices=TopologyStatus.choices, default=TopologyStatus.ACTIVE
    )

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=Q(max_payload_bytes__gt=0, max_payload_bytes__lte=MAX_PAYLOAD_BYTES),
                name="wq_topic_max_payload_range",
            ),
            models.CheckConstraint(
                condition=Q(default_deduplication_ttl_seconds__gte=60),
                name="wq_topic_dedup_ttl_min",
            ),
            models.CheckConstraint(condition=Q(retention_days__gte=1), name="wq_topic_retention"),
            models.CheckConstraint(
                condition=Q(status__in=TopologyStatus.values), name="wq_topic_status_valid"
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        _require_json_object(self.binding_config, "binding_config")


class Subscription(models.Model):
    """A consumer's view of a topic: its own delivery per message, claim rules and retry policy."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    topic = models.ForeignKey(Topic, on_delete=models.PROTECT, related_name="subscriptions")
    name = models.CharField(max_length=200, unique=True, validators=[dotted_name_validator])
    description = models.TextField(blank=True, default="")
    filter = models.JSONField(
        null=True,
        blank=True,
        help_text='Attribute filter, e.g. {"logic": "and", "filters": '
        '[{"field": "region", "operator": "eq", "value": "eu"}]}. Empty matches every message.',
    )
    partition_mode = models.CharField(
        max_length=20, choices=PartitionMode.choices, default=PartitionMode.NONE
    )
    max_attempts = models.PositiveIntegerField(default=5, validators=[MinValueValidator(1)])
    backoff_base_seconds = models.PositiveIntegerField(default=10)
    backoff_max_seconds = models.PositiveIntegerField(default=900)
    lease_seconds = models.PositiveIntegerField(default=60, validators=[MinValueValidator(5)])
    heartbeat_mode = models.CharField(
        max_length=20, choices=HeartbeatMode.choices, default=HeartbeatMode.AUTO
    )
    max_processing_seconds = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)]
    )
    host_type = models.CharField(max_length=20, choices=HostType.choices, default=HostType.WORKER)
    handler_key = models.CharField(max_length=200, blank=True, default="")
    external_ref = models.CharField(max_length=500, blank=True, default="")
    binding_config = models.JSONField(null=True, blank=True)
    status = models.CharField(
        max_length=20, choices=SubscriptionStatus.choices, default=SubscriptionStatus.ACTIVE
    )

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(condition=Q(max_attempts__gte=1), name="wq_sub_attempts_min"),
            models.CheckConstraint(condition=Q(lease_seconds__gte=5), name="wq_sub_lease_min"),
            models.CheckConstraint(
                condition=Q(backoff_max_seconds__gte=models.F("backoff_base_seconds")),
                name="wq_sub_backoff_order",
            ),
            models.CheckConstraint(
                condition=Q(max_processing_seconds__isnull=True) | Q(max_processing_seconds__gt=0),
                name="wq_sub_max_processing_pos",
            ),
            models.CheckConstraint(
                condition=Q(partition_mode__in=PartitionMode.values), name="wq_sub_mode_valid"
            ),
            models.CheckConstraint(
                condition=Q(status__in=SubscriptionStatus.values), name="wq_sub_status_valid"
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        errors: dict[str, str] = {}
        try:
            parsed = parse_filter(self.filter)
        except FilterError as exc:
            errors["filter"] = str(exc)
        else:
            self.filter = parsed.to_json() if parsed is not None else None
        if self.backoff_max_seconds < self.backoff_base_seconds:
            errors["backoff_max_seconds"] = (
                "Must be at least backoff_base_seconds "
                f"({self.backoff_base_seconds}); raise it or lower the base."
            )
        if self.host_type == HostType.WORKER and not self.handler_key.strip():
            errors["handler_key"] = "A work-queue host subscription needs the handler key to run."
        transport = self.topic.transport if self.topic_id else None
        if transport is not None and transport.is_database and self.host_type != HostType.WORKER:
            errors["host_type"] = "External consumers are not available on the Database transport."
        try:
            _require_json_object(self.binding_config, "binding_config")
        except ValidationError as exc:
            errors.update({k: v[0] for k, v in exc.message_dict.items()})
        mode_error = self.partition_mode_change_error()
        if mode_error:
            errors["partition_mode"] = mode_error
        if errors:
            raise ValidationError(errors)

    def partition_mode_change_error(self) -> str | None:
        """Say why the partition mode may not change, or None when the change is allowed.

        Deliveries already written under one mode carry (or lack) partition keys for it, so the
        mode is fixed once the subscription has any delivery.
        """
        if self._state.adding:
            return None
        stored = type(self).objects.filter(pk=self.pk).values_list("partition_mode", flat=True)
        previous = stored.first()
        if previous is None or previous == self.partition_mode:
            return None
        if self.deliveries.exists():
            return (
                f"The partition mode cannot change from {previous} to {self.partition_mode} "
                "once the subscription has deliveries; create a new subscription instead."
            )
        return None

    def save(self, *args: Any, **kwargs: Any) -> None:
        if self._state.adding:
            super().save(*args, **kwargs)
            return
        using = kwargs.get("using") or router.db_for_write(type(self), instance=self)
        with transaction.atomic(using=using):
            # Publishes hold the topic's topology lock shared while they fan out; taking it
            # exclusive here means deliveries being written right now are seen by the check.
            # Imported here: models must not depend on the driver at import time.
            from workqueue.driver import get_driver

            get_driver(using).call(
                "wq_lock_topology", {"topic_id": self.topic_id}, connection=connections[using]
            )
            error = self.partition_mode_change_error()
            if error:
                raise ValidationError({"partition_mode": error})
            super().save(*args, **kwargs)
