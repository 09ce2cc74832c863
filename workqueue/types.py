"""Plain values shared by every layer (no Django models here, so drivers stay import-safe)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from django.db import models


class DeliveryStatus(models.TextChoices):
    PENDING = "Pending"
    IN_FLIGHT = "InFlight"
    COMPLETED = "Completed"
    DEAD_LETTERED = "DeadLettered"
    DISCARDED = "Discarded"


class PartitionMode(models.TextChoices):
    NONE = "None"
    EXCLUSIVE = "Exclusive"
    ORDERED = "Ordered"


class TopologyStatus(models.TextChoices):
    ACTIVE = "Active"
    DISABLED = "Disabled"


class SubscriptionStatus(models.TextChoices):
    ACTIVE = "Active"
    PAUSED = "Paused"
    DISABLED = "Disabled"


class HeartbeatMode(models.TextChoices):
    AUTO = "Auto"
    MANUAL = "Manual"


class HostType(models.TextChoices):
    WORKER = "Worker", "Work-queue host"
    EXTERNAL = "External", "External consumer"


class DeduplicationStatus(models.TextChoices):
    RESERVED = "Reserved"
    CONFIRMED = "Confirmed"


class PublishStatus(models.TextChoices):
    ACCEPTED = "Accepted"
    DUPLICATE = "Duplicate"
    REJECTED = "Rejected"


class LeaseState(models.TextChoices):
    HELD = "Held"
    CANCELLED = "Cancelled"
    LOST = "Lost"


class PartitionCondition(models.TextChoices):
    IDLE = "Idle"
    IN_FLIGHT = "InFlight"
    BLOCKED = "Blocked"


#: The largest message any topic accepts (a topic's max_payload_bytes is at most this): the bytes
#: of the message's partition key, attributes, payload or reference and correlation id as
#: compact UTF-8 JSON.
MAX_PAYLOAD_BYTES = 262_144


# Publish error codes; RETRYABLE_PUBLISH_ERRORS marks those a caller may simply try again.
class PublishErrorCode(models.TextChoices):
    TOPIC_NOT_FOUND = "TopicNotFound"
    TOPIC_DISABLED = "TopicDisabled"
    TOPIC_NOT_EXTERNALLY_PUBLISHABLE = "TopicNotExternallyPublishable"
    INVALID_MESSAGE_ID = "InvalidMessageID"
    INVALID_ATTRIBUTES = "InvalidAttributes"
    INVALID_PAYLOAD = "InvalidPayload"
    INVALID_PARTITION_KEY = "InvalidPartitionKey"
    INVALID_DEDUPLICATION = "InvalidDeduplication"
    INVALID_SCHEDULE = "InvalidSchedule"
    INVALID_PRIORITY = "InvalidPriority"
    PAYLOAD_TOO_LARGE = "PayloadTooLarge"
    MESSAGE_ID_CONFLICT = "MessageIDConflict"
    DEDUPLICATION_PENDING = "DeduplicationPending"
    TRANSPORT_UNAVAILABLE = "TransportUnavailable"


#: What the Database transport's publish procedures answer for a topic bound to another
#: transport: not a result callers see, since ``publishing`` then hands the message to the
#: topic's own transport.
TOPIC_ON_OTHER_TRANSPORT = "TopicOnOtherTransport"


RETRYABLE_PUBLISH_ERRORS = frozenset(
    {PublishErrorCode.DEDUPLICATION_PENDING, PublishErrorCode.TRANSPORT_UNAVAILABLE}
)


@dataclass(frozen=True, slots=True)
class PublishError:
    code: str
    message: str

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE_PUBLISH_ERRORS


#: Each status by its text: looked up once per published message, where calling the enum class
#: costs several times as much (a value no status has still goes to the class, to be refused).
_PUBLISH_STATUSES = {status.value: status for status in PublishStatus}


@dataclass(frozen=True, slots=True)
class PublishResult:
    """What happened to one published message.

    ``status`` is always a ``PublishStatus`` (a ``str`` enum, so ``== "Accepted"`` works too).
    ``message_id`` is the accepted message's id, or for a ``Duplicate`` the id of the message that
    already owns the deduplication key (or the same id re-published); it is ``None`` for a
    ``Rejected`` message, which stored nothing. ``error`` is set exactly when it was rejected.
    ``delivered_to`` holds, for an accepted message, the ids of the subscriptions that took it
    (empty: the topic's subscriptions were all Disabled or filtered it out, so nothing will run
    it), where the transport knows at no cost (PostgreSQL, publishing on the queue's own
    connection); None where it does not. ``delivered`` says the same as yes, no or unknown.
    """

    message_id: str | None
    status: PublishStatus
    error: PublishError | None = None
    delivered_to: frozenset[str] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        # Rows from either vendor's procedure carry the status as plain text: one type for
        # every result, whichever path produced it.
        status = _PUBLISH_STATUSES.get(self.status) or PublishStatus(self.status)
        object.__setattr__(self, "status", status)
        if status is PublishStatus.REJECTED:
            object.__setattr__(self, "message_id", None)

    @property
    def accepted(self) -> bool:
        """The message was stored now (not a duplicate, not rejected)."""
        return self.status == PublishStatus.ACCEPTED

    @property
    def delivered(self) -> bool | None:
        """Whether any subscription took the message; None when the transport cannot tell."""
        return None if self.delivered_to is None else bool(self.delivered_to)

    @property
    def rejected(self) -> bool:
        return self.status == PublishStatus.REJECTED

    def raise_if_rejected(self) -> PublishResult:
        """Return this result, or raise ``PublishRejectedError`` carrying it if it was rejected."""
        if self.rejected:
            # Imported here: exceptions import Django's error classes; types stays import-light.
            from workqueue.exceptions import PublishRejectedError

            raise PublishRejectedError(self)
        return self


@dataclass(frozen=True, slots=True)
class ClaimedDelivery:
    """One delivery leased to a consumer, with its message."""

    delivery_id: str
    subscription_id: str
    lease_token: str
    lease_expires_at: dt.datetime
    attempt: int
    is_replay: bool
    message_id: str
    topic_id: str
    partition_key: str | None
    attributes: dict[str, str]
    payload: Any
    payload_ref: dict[str, Any] | None
    correlation_id: str | None
    published_at: dt.datetime
    #: How long the lease is, as the transport made it at the claim (None: the subscription's
    #: lease_seconds as the consumer last read it).
    lease_seconds: int | None = None
    #: The payload as the JSON text stored, from a transport that keeps it undecoded (the
    #: Database and AWS transports; ``payload`` is None then): a delivery claimed ahead holds
    #: the text while it waits for a slot, where decoded it could take some 25 times the
    #: memory its size says (JSON of empty objects), and ``decoded_payload()`` decodes it as
    #: its handler starts.
    payload_json: str | None = None

    def decoded_payload(self) -> Any:
        """The payload as Python values (decoded from ``payload_json`` at each call)."""
        return self.payload if self.payload_json is None else json.loads(self.payload_json)


@dataclass(frozen=True, slots=True)
class ExpiredDeadLetter:
    """A delivery that the lease-expiry step dead-lettered (its last attempt timed out)."""

    delivery_id: str
    subscription_id: str
    partition_key: str | None
    reason: str


@dataclass(frozen=True, slots=True)
class ClaimResult:
    deliveries: list[ClaimedDelivery]
    expired_dead_letters: list[ExpiredDeadLetter] = field(default_factory=list)
    #: The claim took everything it could at that moment: another before something changes (a
    #: publish, a settle, a due time) would come back empty. A transport that cannot tell
    #: leaves it False, and its consumer claims again at once after a short claim.
    drained: bool = False


class RateTokens(NamedTuple):
    """What a take from a subscription's rate-limit bucket came to: ``granted`` tokens; when
    none were, ``wait_seconds`` until the next is due; ``full_in_seconds``, how long the bucket,
    as this take left it, would take to refill to its burst (tokens given back later count
    only as far as that refill had not made them up)."""

    granted: int
    wait_seconds: float
    full_in_seconds: float


@dataclass(frozen=True, slots=True)
class LeaseExtension:
    state: str
    lease_expires_at: dt.datetime | None = None
    #: Seconds the renewal granted, when the transport gave less than a whole lease (SQS stops
    #: at 12 hours from the receive): the holder's own view of its lease ends there too.
    granted_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class SubscriptionStats:
    subscription_name: str
    pending: int
    in_flight: int
    dead_lettered: int
    blocked_keys: int | None
    oldest_pending_age_seconds: int | None
    #: None when the transport keeps no history of completions (AWS).
    completed_last_hour: int | None
    as_of: dt.datetime
    #: Deliveries started per second across every host at most (None: no limit).
    rate_limit_per_second: float | None = None
    #: A count stopped at the cap it was read with (or the completions were counted among
    #: fewer than the last hour's): the counts are then at least what they say.
    capped: bool = False


@dataclass(frozen=True, slots=True)
class DeadLetterItem:
    delivery_id: str
    partition_key: str | None
    attempts: int
    reason: str | None
    last_error: str | None
    dead_lettered_at: dt.datetime | None
    blocks_key: bool
    message_id: str
    topic: str
    message_partition_key: str | None
    attributes: dict[str, str]
    #: The payload as the JSON text it is stored as (None when it was not read), never
    #: decoded on the way to an operator: a payload of 256 KiB can be 25 times that as
    #: Python objects, and a page holds hundreds.
    payload_json: str | None
    payload_ref: dict[str, Any] | None
    correlation_id: str | None
    published_at: dt.datetime

    @property
    def payload_chars(self) -> int:
        return len(self.payload_json or "")


#: A page of dead letters that carries payloads ends early at the item whose payload text
#: takes the page's total to this many characters (a page holds at least one item). With
#: MAX_PAYLOAD_BYTES a message, a page of 500 could otherwise hold over a hundred megabytes.
DEAD_LETTER_PAGE_PAYLOAD_CHARS = 4 * 2**20


def payloads_fill_the_page(page: Iterable[DeadLetterItem]) -> bool:
    """Whether ``page``'s payloads reach DEAD_LETTER_PAGE_PAYLOAD_CHARS: it ends there."""
    return sum(item.payload_chars for item in page) >= DEAD_LETTER_PAGE_PAYLOAD_CHARS


def fill_dead_letter_page(
    page: list[DeadLetterItem], more: Iterable[DeadLetterItem], page_size: int
) -> bool:
    """Add ``more`` to ``page`` until it holds ``page_size`` items or its payloads fill it (the
    item that fills it is its last), as every transport pages its dead letters; whether it is
    full."""
    chars = sum(item.payload_chars for item in page)
    for item in more:
        page.append(item)
        chars += item.payload_chars
        if len(page) >= page_size or chars >= DEAD_LETTER_PAGE_PAYLOAD_CHARS:
            return True
    return len(page) >= page_size


@dataclass(frozen=True, slots=True)
class PartitionItem:
    partition_key: str
    condition: str
    head_delivery_id: str
    waiting_items: int
    # An InFlight key's holder and when its lease ends (None otherwise, or where the
    # transport keeps no leases in the database): a lease long passed means a dead holder.
    lease_owner: str | None = None
    lease_expires_at: dt.datetime | None = None


@dataclass(frozen=True, slots=True)
class Backlog:
    claimable: int
    in_flight: int
    capped: bool

    @property
    def total(self) -> int:
        return self.claimable + self.in_flight


class SettleOutcome(models.TextChoices):
    SETTLED = "Settled"
    LEASE_LOST = "LeaseLost"


@dataclass(frozen=True, slots=True)
class SettleResult:
    """What a settle call achieved: ``Settled`` with the delivery's new status, or
    ``LeaseLost`` when the caller's lease token no longer held the delivery."""

    outcome: str
    status: str | None = None

    @property
    def settled(self) -> bool:
        return self.outcome == SettleOutcome.SETTLED


@dataclass(frozen=True, slots=True)
class DiscardResult:
    """``changed``: the delivery was discarded or a cancel was requested;
    ``cancel_requested``: it is running and its holder has been asked to stop, by this call
    when ``changed``, by an earlier one otherwise (the handler has not returned yet);
    ``holds_key``: with ``cancel_requested``, the delivery is Completed (its handler completed
    it in its own transaction) and the handler runs on holding its partition key: it stays
    Completed, and the key is free when the handler returns."""

    changed: bool
    cancel_requested: bool = False
    holds_key: bool = False
