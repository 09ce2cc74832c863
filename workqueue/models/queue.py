"""Queue tables: messages, deliveries and the deduplication ledger.

The ORM and the admin read these tables; every write is a ``wq_*`` stored procedure (see
``workqueue/sql``). Constraints and partial indexes are declared here so that Django's migrations
create them on every vendor.
"""

from __future__ import annotations

import uuid

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now

from workqueue.models.fields import ByteExactKeyField
from workqueue.models.readonly import DriverOwnedModel, DriverOwnedQuerySet
from workqueue.models.topology import Subscription, Topic
from workqueue.types import DeduplicationStatus, DeliveryStatus

OPEN_STATUSES = [DeliveryStatus.PENDING, DeliveryStatus.IN_FLIGHT, DeliveryStatus.DEAD_LETTERED]
TERMINAL_STATUSES = [DeliveryStatus.COMPLETED, DeliveryStatus.DISCARDED]
#: Completed in its handler's own transaction by a handler that runs on, holding the delivery's
#: partition key (wq_complete_holding_key) until it returns or its lease runs out.
HOLDING_ITS_KEY_AFTER_COMPLETING = Q(status=DeliveryStatus.COMPLETED, lease_expires_at__gt=Now())
#: A delivery whose handler runs: InFlight, or completed and holding its key.
HANDLER_RUNS = Q(status=DeliveryStatus.IN_FLIGHT) | HOLDING_ITS_KEY_AFTER_COMPLETING


class Message(DriverOwnedModel):
    """One published message. Its id is globally unique and chosen by the publisher."""

    id = models.UUIDField(primary_key=True, editable=False)
    # Global publish order, assigned from a database sequence by wq_publish; copied into each
    # delivery's order_key so Ordered subscriptions run a key's messages in this order.
    publish_ordinal = models.BigIntegerField(unique=True, editable=False)
    # Not indexed alone: wq_msg_purge_ix (topic, published_at) leads with it. No database
    # constraint (a check per inserted row): the trigger wq_topic_delete_guard refuses to delete
    # a topic that still has messages (migration 0025).
    topic = models.ForeignKey(
        Topic,
        on_delete=models.PROTECT,
        related_name="messages",
        db_index=False,
        db_constraint=False,
    )
    partition_key = ByteExactKeyField(max_length=200, null=True, blank=True)
    attributes = models.JSONField(null=True, blank=True)
    payload = models.JSONField(null=True, blank=True)
    payload_ref = models.JSONField(null=True, blank=True)
    correlation_id = models.CharField(max_length=200, null=True, blank=True)
    published_at = models.DateTimeField(db_default=Now())
    published_by = models.CharField(
        max_length=150, null=True, blank=True, help_text="Username of the publishing user."
    )
    # The application's word, as p_external: whether an API key published it over the REST
    # API. Such work never becomes a Tasks API task (Subscription's handler rules).
    published_externally = models.BooleanField(
        db_default=False, help_text="Published over the REST API with an API key."
    )

    class Meta:
        ordering = ["publish_ordinal"]
        indexes = [models.Index(fields=["topic", "published_at"], name="wq_msg_purge_ix")]
        permissions = [("view_payload", "Can view message payloads (may hold personal data)")]

    def __str__(self) -> str:
        return str(self.id)


class DeliveryManager(models.Manager.from_queryset(DriverOwnedQuerySet)):  # type: ignore[misc]
    """Loads deliveries without their lease token: the runtime and operator roles may not read
    that column (``grant-runtime``), and nothing outside the procedures needs it."""

    def get_queryset(self) -> DriverOwnedQuerySet:
        return super().get_queryset().defer("lease_token")


class Delivery(DriverOwnedModel):
    """One subscription's copy of one message; its id is stable across attempts."""

    objects = DeliveryManager()

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # Not indexed alone: the (message, subscription) unique constraint leads with it. No
    # database constraint either: only wq_publish / wq_publish_many insert deliveries, in the
    # transaction that inserts their message, and retention purges a message only once no
    # delivery refers to it. The constraint's check locked the message row once per delivery
    # (a WAL record each), about a sixth of a publish's database time and more per fan-out.
    message = models.ForeignKey(
        Message,
        on_delete=models.PROTECT,
        related_name="deliveries",
        db_index=False,
        db_constraint=False,
    )
    # Deliberately in no index of its own or as a leading column of a full index: every query
    # by subscription must take one of the partial indexes below. A full index led by the
    # subscription is a trap when statistics lag a burst (a new subscription looks like one
    # row): the planner picks it and sorts the whole backlog on every claim.
    # No database constraint either (a check per inserted row, one more per subscription of a
    # fan-out): the trigger wq_subscription_delete_guard refuses to delete a subscription that
    # still has deliveries (migration 0025).
    subscription = models.ForeignKey(
        Subscription,
        on_delete=models.PROTECT,
        related_name="deliveries",
        db_index=False,
        db_constraint=False,
    )
    status = models.CharField(
        max_length=20, choices=DeliveryStatus.choices, db_default=DeliveryStatus.PENDING
    )
    # Filled only for Exclusive and Ordered subscriptions; None-mode deliveries never hold a key.
    partition_key = ByteExactKeyField(max_length=200, null=True, blank=True)
    order_key = models.BigIntegerField()
    attempt_count = models.IntegerField(db_default=0)
    is_replay = models.BooleanField(db_default=False)
    # When the delivery may next be claimed: publish time, a scheduled due time
    # (not_before / delay_seconds) or a retry's backoff.
    visible_at = models.DateTimeField(db_default=Now(), verbose_name="due at")
    # Higher is claimed first among a subscription's due deliveries (-100..100, the Tasks API's
    # range); within one partition key publish order still decides.
    priority = models.SmallIntegerField(db_default=0)
    lease_owner = models.CharField(max_length=200, null=True, blank=True)
    lease_token = models.UUIDField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    progress = models.JSONField(null=True, blank=True)
    last_error = models.TextField(null=True, blank=True)
    dead_letter_reason = models.CharField(max_length=100, null=True, blank=True)
    dead_lettered_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(
        null=True, blank=True, help_text="When it became Completed or Discarded."
    )
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    resolved_by = models.CharField(max_length=150, null=True, blank=True)
    resolution_note = models.CharField(max_length=1000, null=True, blank=True)

    class Meta:
        verbose_name_plural = "deliveries"
        constraints = [
            models.UniqueConstraint(
                fields=["message", "subscription"], name="wq_delivery_message_sub_uq"
            ),
            # The real single-flight guarantee for Exclusive and Ordered subscriptions: a second
            # InFlight row for the same (subscription, key) cannot exist, whatever the race.
            models.UniqueConstraint(
                fields=["subscription", "partition_key"],
                condition=Q(status=DeliveryStatus.IN_FLIGHT, partition_key__isnull=False),
                name="wq_delivery_inflight_key_uq",
            ),
            # The status's five values, the priority's range and a count of attempts never
            # below 0 are the database's own rules, kept by the procedure files: on PostgreSQL
            # the three columns' types are domains (a table's CHECK constraint was planned again
            # at every statement that wrote a delivery), on SQL Server the CHECK constraints
            # wq_delivery_status_valid, wq_delivery_attempts_nonneg and
            # wq_delivery_priority_range that earlier migrations made. (An AlterField of these
            # fields would replace a domain with a plain type: keep them as they are.)
        ]
        indexes = [
            # Claims read Pending rows by priority, then oldest due first, keyed and keyless
            # ones apart: the keyless batch of a partitioned subscription must not walk past its
            # keyed backlog (nor the window of keyed rows past keyless ones). A claim visits the
            # priorities present one at a time, each a range of due rows, so rows scheduled for
            # later are never read (see wq_claim).
            models.Index(
                fields=["subscription", "priority", "visible_at"],
                include=["partition_key", "order_key"],
                condition=Q(status=DeliveryStatus.PENDING, partition_key__isnull=False),
                name="wq_dlv_claim_keyed_pri_ix",
            ),
            models.Index(
                fields=["subscription", "priority", "visible_at"],
                condition=Q(status=DeliveryStatus.PENDING, partition_key__isnull=True),
                name="wq_dlv_claim_keyless_pri_ix",
            ),
            models.Index(
                fields=["subscription", "partition_key", "order_key"],
                include=["status"],
                condition=Q(partition_key__isnull=False, status__in=OPEN_STATUSES),
                name="wq_dlv_partition_head_ix",
            ),
            models.Index(
                fields=["status", "lease_expires_at"],
                condition=Q(status=DeliveryStatus.IN_FLIGHT),
                name="wq_dlv_lease_ix",
            ),
            # Completed deliveries that still hold their partition key: their handler completed
            # in its own transaction and runs on (wq_complete_holding_key). A claim of the key
            # looks here; the rows are few, and leave when the handler returns.
            models.Index(
                fields=["subscription", "partition_key"],
                condition=Q(status=DeliveryStatus.COMPLETED, lease_expires_at__isnull=False),
                name="wq_dlv_key_held_ix",
            ),
            models.Index(
                fields=["subscription", "status"],
                condition=Q(status__in=[DeliveryStatus.IN_FLIGHT, DeliveryStatus.DEAD_LETTERED]),
                name="wq_dlv_open_ix",
            ),
            # Dead letters in delivery id order: the keyset that listing them and resolving
            # them in bounded batches walks, whatever the number of a subscription's other rows.
            models.Index(
                fields=["subscription", "id"],
                condition=Q(status=DeliveryStatus.DEAD_LETTERED),
                name="wq_dlv_dead_letter_ix",
            ),
            # Settled deliveries by subscription and age: the retention purge walks each
            # subscription up to its topic's own cutoff, and the stats count a subscription's
            # completions of the last hour, each reading its own rows only. (Until 0048 they
            # were ordered by age alone, and a purge read every retained row of the topics
            # with a longer retention than the shortest, at every batch.)
            models.Index(
                fields=["subscription", "completed_at"],
                include=["status"],
                condition=Q(status__in=TERMINAL_STATUSES),
                name="wq_dlv_settled_ix",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.subscription_id}/{self.id} ({self.status})"


class Deduplication(DriverOwnedModel):
    """The publish-time deduplication ledger: one owner message per (topic, key) per window."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # Not indexed alone: the (topic, deduplication_key) unique constraint leads with it.
    topic = models.ForeignKey(
        Topic, on_delete=models.PROTECT, related_name="deduplications", db_index=False
    )
    deduplication_key = ByteExactKeyField(max_length=200)
    # No foreign key: the owning message may have been purged while the window is still open.
    message_id = models.UUIDField()
    status = models.CharField(max_length=20, choices=DeduplicationStatus.choices)
    expires_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["topic", "deduplication_key"], name="wq_dedup_topic_key_uq"
            ),
            models.CheckConstraint(
                condition=Q(status__in=DeduplicationStatus.values), name="wq_dedup_status_valid"
            ),
        ]
        indexes = [models.Index(fields=["expires_at"], name="wq_dedup_expires_ix")]

    def __str__(self) -> str:
        return f"{self.deduplication_key} → {self.message_id}"


class RateLimitBucket(DriverOwnedModel):
    """A rate-limited subscription's token bucket, shared by every host: ``tokens`` as of
    ``refilled_at``. Written only by wq_take_rate_tokens and wq_return_rate_tokens. Not a foreign
    key: a bucket is a counter, not history, and must never stop a subscription's deletion."""

    subscription_id = models.UUIDField(primary_key=True, editable=False)
    tokens = models.FloatField()
    refilled_at = models.DateTimeField()

    class Meta:
        db_table = "workqueue_rate_limit_bucket"

    def __str__(self) -> str:
        return f"{self.subscription_id}: {self.tokens:.2f} tokens"


class SweepLock(DriverOwnedModel):
    """The one row a sweeper locks for its pass (wq_try_sweep_lock), so that one pass runs at a
    time across every host. A row lock, not an advisory lock: any role that may connect can take
    an advisory lock, and one held by a session that is no sweeper stopped every pass; no granted
    role may read or lock this table."""

    id = models.SmallIntegerField(primary_key=True, editable=False)

    class Meta:
        db_table = "workqueue_sweep_lock"

    def __str__(self) -> str:
        return "sweep lock"
