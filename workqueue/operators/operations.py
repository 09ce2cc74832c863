"""The seven operator operations. Each checks permissions and validates its input before any
queue call, and returns plain values (dataclasses) that every surface renders its own way.

Names, notes and reasons the database cannot store (a NUL character, a lone surrogate, as a
``%00`` in a URL gives) are an ``InvalidInputError`` like any other bad input, not a database
error."""

from __future__ import annotations

import datetime as dt
import difflib
import logging
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from workqueue import transport
from workqueue.conf import get_settings
from workqueue.exceptions import (
    BulkOperationInterrupted,
    BulkOperationStopped,
    DriverError,
    InvalidInputError,
    LockTimeoutError,
    NotFoundError,
    PermissionDeniedError,
    TransportUnavailableError,
    UnsupportedByTransportError,
    WorkQueueConfigurationError,
    WorkQueueError,
    one_line,
)
from workqueue.input_limits import KEY_UNITS, key_length, text_problem
from workqueue.operators import cursors
from workqueue.operators.display import count_of, host_pseudonym
from workqueue.operators.permissions import (
    CHANGE_TRANSPORT_PERMISSION,
    CLI,
    OPERATE,
    READ,
    Actor,
    may_call_the_cloud,
    may_name_subscription,
    may_view_payload,
    require,
)
from workqueue.publishing import MAX_KEY_LENGTH
from workqueue.runtime.handler_runs import what_to_do
from workqueue.transports import BaseTransport
from workqueue.types import (
    DeliveryStatus,
    PartitionCondition,
    PartitionItem,
    SubscriptionStats,
    payloads_fill_the_page,
)

if TYPE_CHECKING:
    from workqueue.models import HostRecord

logger = logging.getLogger(__name__)

STATS_UNAVAILABLE = "Stats are unavailable for this subscription"
#: The highest cap a stats read may be given (the procedures clamp to it).
STATS_COUNT_MAX = 1_000_000
MAX_NAME_LENGTH = 200
MAX_NOTE_LENGTH = 1000
DELIVERY_ID_LENGTH = 36  # a UUID's canonical text


@dataclass(frozen=True, slots=True)
class StatsReport:
    subscriptions: list[SubscriptionStats]
    failures: list[dict[str, str]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Page:
    supported: bool
    items: list[Any]
    next_cursor: str | None = None


@dataclass(frozen=True, slots=True)
class ReplayOutcome:
    supported: bool
    replayed: bool


@dataclass(frozen=True, slots=True)
class DiscardOutcome:
    supported: bool
    discarded: bool
    cancel_requested: bool
    # The running handler completed its delivery in its own transaction and holds its
    # partition key: the delivery stays Completed; the key is free when the handler returns.
    holds_key: bool = False


@dataclass(frozen=True, slots=True)
class DeadLetterSelection:
    """Which dead letters a bulk replay or discard takes; an unset field matches all."""

    #: The dead-letter reason (MaxAttemptsExceeded, LeaseExpired, ...), ignoring case.
    reason: str | None = None
    partition_key: str | None = None
    #: Dead-lettered at or after this instant ...
    dead_lettered_from: dt.datetime | None = None
    #: ... and before this one.
    dead_lettered_before: dt.datetime | None = None
    #: Text the last error contains, ignoring case.
    error_contains: str | None = None


@dataclass(frozen=True, slots=True)
class BulkOutcome:
    supported: bool
    action: str  # replay | discard
    dry_run: bool
    #: Dead letters matching the selection that were changed (or, on a dry run, would be).
    matched: int
    #: Dead letters of the subscription looked at.
    examined: int
    batches: int


@dataclass(frozen=True, slots=True)
class BacklogReport:
    supported: bool
    claimable: int
    in_flight: int
    total: int
    capped: bool


@dataclass(frozen=True, slots=True)
class BindingIssue:
    severity: str  # Error | Warning
    subject: str
    message: str


@dataclass(frozen=True, slots=True)
class UnservedSubscription:
    name: str
    #: Deliveries that could be claimed now (at most transport.BACKLOG_CAP); None when the
    #: subscription's transport could not count them (``problem`` says why).
    due: int | None
    problem: str | None = None
    #: Deliveries in flight though no live host runs the subscription: held by hosts that are
    #: gone, until their leases expire (on partitioned subscriptions their keys wait too).
    held: int = 0

    def waiting(self) -> str:
        """What waits for a host, in words: ``3 deliveries are due, 2 held by hosts no longer
        seen`` (either part alone when the other is none)."""
        parts = [f"{count_of(self.due, 'delivery is', 'deliveries are')} due"] if self.due else []
        if self.held:
            held = "held by hosts no longer seen"
            parts.append(
                f"{self.held:,} {held}"
                if parts
                else f"{count_of(self.held, 'delivery', 'deliveries')} {held}"
            )
        return ", ".join(parts)


# -- input rules ---------------------------------------------------------------------------


def _storable(value: str, what: str) -> str:
    problem = text_problem(value)
    if problem is not None:
        raise InvalidInputError(f"{what} {problem}.")
    return value


def _name(value: Any, what: str = "subscription_name") -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidInputError(f"{what} is required.")
    value = _storable(value.strip(), what)
    if len(value) > MAX_NAME_LENGTH:
        raise InvalidInputError(f"{what} must be at most {MAX_NAME_LENGTH} characters.")
    return value.lower()


def _note(value: Any, what: str, *, required: bool = False) -> str | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        if required:
            raise InvalidInputError(f"{what} is required.")
        return None
    if not isinstance(value, str):
        raise InvalidInputError(f"{what} must be text.")
    if key_length(value) > MAX_NOTE_LENGTH:
        raise InvalidInputError(f"{what} must be at most {MAX_NOTE_LENGTH} {KEY_UNITS}.")
    return _storable(value.strip(), what)


def _filter_text(value: Any, what: str, *, trim: bool = False) -> str | None:
    """A text filter of a bulk operation: left out (``None``), it matches every row. Blank
    text is refused rather than read as left out, so that an empty shell variable or form
    value cannot widen a discard to every dead letter; other text is matched as given
    (trimmed, " API " would match "RAPID" too: audit helper-132), unless ``trim``."""
    if isinstance(value, str) and not value.strip():
        raise InvalidInputError(
            f"The {what} is blank: leave it out to match every delivery, or give the text to match."
        )
    # Checked as a note is (text, length, storable), which trims it; else kept as given.
    checked = _note(value, what)
    return checked if trim or checked is None else value


def _delivery_id(value: Any) -> str | None:
    """A normalised delivery id, or None when it is not a UUID (nothing can match it)."""
    try:
        return str(uuid.UUID(str(value)))
    except ValueError:
        return None


def _target_delivery_id(value: Any) -> str:
    """The delivery id an operation acts on: text that is no UUID (an id cut short, copied
    from a list that shows the first characters) is refused rather than matching nothing."""
    target = _delivery_id(value)
    if target is None:
        raise InvalidInputError(
            f"{value!r} is not a delivery id: give the whole id, a UUID such as "
            "0190a5d4-ac96-7c4b-bcce-b302099a8057 (the dead-letters verb and the admin's "
            "delivery page show it in full)."
        )
    return target


def _subscription(name: str, actor: Actor) -> Any:
    """The subscription an operation acts on: the one place operators' names are found."""
    # Imported here: operators read topology only when called (keeps imports cheap).
    from workqueue.models import Subscription

    found = Subscription.objects.filter(name=name).select_related("topic__transport").first()
    if found is None:
        raise _no_subscription(name, actor)
    return found


def _no_subscription(name: str, actor: Actor) -> NotFoundError:
    """No subscription has ``name``: say so, with the names spelt nearly alike (a typo's
    likely meaning) among those ``actor`` may be told of."""
    from workqueue.models import Subscription

    names = [
        existing
        for existing in Subscription.objects.values_list("name", flat=True)
        if may_name_subscription(actor, existing)
    ]
    near = difflib.get_close_matches(name, names, n=3, cutoff=0.8)
    suggestion = f" Did you mean {' or '.join(map(repr, near))}?" if near else ""
    return NotFoundError(f"No subscription is named {name!r}.{suggestion}")


def _transport_of(subscription: Any, flag: str | None = None, what: str = "") -> BaseTransport:
    """The subscription's transport; with ``flag``, refused (``UnsupportedByTransportError``,
    naming the flag) unless the transport has that capability."""
    row = subscription.topic.transport
    try:
        transport_class = row.transport_class
    except WorkQueueConfigurationError as exc:
        raise UnsupportedByTransportError(str(exc), "driver_class") from exc
    if flag is not None:
        transport_class.require(flag, what, row.name)
    return transport_class()


# -- the operations ------------------------------------------------------------------------


def subscription_stats(
    subscription_name: str | None = None, *, actor: Actor = CLI, cap: int | None = None
) -> StatsReport:
    """Counts for one subscription or all of them (sorted by name), each made up to ``cap``
    (None: ``STATS_COUNT_CAP``; at most 1,000,000). A subscription whose stats cannot be read
    is listed under ``failures`` with a fixed message."""
    from workqueue.models import Subscription

    if cap is None:
        cap = get_settings().STATS_COUNT_CAP
    elif not 1 <= cap <= STATS_COUNT_MAX:
        raise InvalidInputError(f"cap must be 1 to {STATS_COUNT_MAX:,}; got {cap}.")

    queryset = Subscription.objects.order_by("name")
    if subscription_name is not None:
        name = _name(subscription_name)
        require(actor, READ, subscription=name)
        queryset = queryset.filter(name=name)
        if not queryset.exists():
            raise _no_subscription(name, actor)
    else:
        require(actor, READ)
    report = StatsReport([])
    first_error: tuple[str, WorkQueueError] | None = None
    for subscription in queryset.select_related("topic__transport"):
        if actor.subscriptions and subscription.name not in actor.subscriptions:
            continue
        try:
            row = _transport_of(subscription).subscription_stats(str(subscription.id), cap)
        except WorkQueueError as exc:
            first_error = first_error or (subscription.name, exc)
            report.failures.append(
                {"subscription_name": subscription.name, "error": STATS_UNAVAILABLE}
            )
            continue
        if row is None:
            continue
        age = row["oldest_pending_age_seconds"]
        report.subscriptions.append(
            SubscriptionStats(
                subscription_name=subscription.name,
                pending=row["pending"],
                in_flight=row["in_flight"],
                dead_lettered=row["dead_lettered"],
                blocked_keys=row["blocked_keys"],
                oldest_pending_age_seconds=None if age is None else max(age, 0),
                completed_last_hour=row["completed_last_hour"],
                as_of=row["as_of"],
                rate_limit_per_second=subscription.rate_limit_per_second,
                capped=row.get("capped", False),
            )
        )
    if first_error is not None:
        # The reader sees a fixed sentence (the error may name the endpoint or the cloud
        # identity); the operator reads why here, once a call (the dashboard reads every
        # subscription at each refresh).
        logger.warning(
            "Stats of %d subscription(s) could not be read; the first, %s: %s (on the Database "
            "transport, a procedure that does not exist means this release's `manage.py "
            "migrate` has not run)",
            len(report.failures),
            *first_error,
        )
    return report


@dataclass(frozen=True, slots=True)
class QueueGauges:
    """One subscription's gauges for a metrics scrape; each count stops at ``cap``."""

    subscription_name: str
    pending: int
    due: int
    in_flight: int
    dead_lettered: int
    blocked_keys: int | None
    oldest_pending_age_seconds: int | None
    cap: int

    @property
    def capped(self) -> bool:
        counts = (self.pending, self.in_flight, self.dead_lettered, self.blocked_keys or 0)
        return max(counts) >= self.cap


@dataclass(frozen=True, slots=True)
class GaugesReport:
    """A scrape's gauges, and the subscriptions whose gauges could not be read (name: why)."""

    gauges: list[QueueGauges]
    unavailable: dict[str, str]
    #: Whether a read found the queue tables locked (and waited 2 s for them): the scrape
    #: reads nothing more of them, which would wait as long again.
    locked: bool = False


def queue_gauges(*, actor: Actor = CLI) -> GaugesReport:
    """What a metrics scrape reports for every subscription the caller may read, at a cost
    bounded by ``METRICS_COUNT_CAP`` per count whatever the backlog (``workqueue stats`` counts
    everything instead). A subscription whose gauges cannot be read (its transport is away, the
    role may not call the procedure) is listed as unavailable, and logged: a series that
    vanished would resolve the alerts that watch it. A queue table locked (VACUUM FULL, a
    migrate's ALTER TABLE) fails a read after 2 s, and every database subscription after it
    is then listed unavailable unread: their reads would each wait the same 2 s."""
    from workqueue.models import Subscription

    require(actor, READ)
    cap = get_settings().METRICS_COUNT_CAP
    gauges = []
    unavailable: dict[str, str] = {}
    locked = _LockedTables()
    for subscription in Subscription.objects.order_by("name").select_related("topic__transport"):
        name = subscription.name
        if actor.subscriptions and name not in actor.subscriptions:
            continue
        if (why := locked.why(subscription)) is not None:
            unavailable[name] = why
            continue
        try:
            found = _transport_of(subscription)
            row = found.queue_gauges(str(subscription.id), cap)
            backlog = found.backlog(str(subscription.id))
        except WorkQueueError as exc:
            logger.warning("Could not read the gauges of %s: %s", name, exc)
            unavailable[name] = str(exc)
            locked.note(subscription, exc)
            continue
        if row is None or backlog is None:
            continue
        age = row["oldest_pending_age_seconds"]
        gauges.append(
            QueueGauges(
                subscription_name=name,
                pending=row["pending"],
                due=backlog.claimable,
                in_flight=row["in_flight"],
                dead_lettered=row["dead_lettered"],
                blocked_keys=row["blocked_keys"],
                oldest_pending_age_seconds=None if age is None else max(age, 0),
                cap=cap,
            )
        )
    return GaugesReport(gauges, unavailable, locked=bool(locked))


class _LockedTables:
    """The transports whose queue tables a read found locked (VACUUM FULL, a migrate's ALTER
    TABLE) for the 2 s it waits, by driver class (they share the tables), and why: a loop over
    subscriptions reads none of theirs again, each of which would wait as long."""

    def __init__(self) -> None:
        self._why: dict[str, str] = {}

    def __bool__(self) -> bool:
        return bool(self._why)

    def why(self, subscription: Any) -> str | None:
        """Why ``subscription``'s tables are known locked, or None."""
        return self._why.get(subscription.topic.transport.driver_class)

    def note(self, subscription: Any, error: Exception) -> None:
        """Remember ``error`` if it says ``subscription``'s tables are locked."""
        if isinstance(error, LockTimeoutError):
            self._why[subscription.topic.transport.driver_class] = str(error)


def list_dead_letters(
    subscription_name: str,
    *,
    cursor: str | None = None,
    page_size: Any = None,
    payloads: bool = True,
    actor: Actor = CLI,
) -> Page:
    """One page of a subscription's dead letters, oldest id first, with their payloads if
    ``payloads`` and the caller has ``workqueue.view_payload``. A page with payloads may end
    before ``page_size`` (at DEAD_LETTER_PAGE_PAYLOAD_CHARS of them), with a next cursor."""
    name = _name(subscription_name)
    size = cursors.page_size(page_size)
    after = cursors.decode(cursor, "delivery_id", max_length=DELIVERY_ID_LENGTH, listing=name)
    if after is not None and _delivery_id(after) is None:
        raise InvalidInputError("cursor is not valid; pass the next_cursor of a previous page.")
    require(actor, READ, subscription=name)
    subscription = _subscription(name, actor)
    # Not read at all for a caller who may not see them: a page of a thousand payloads read to
    # be blanked cost the web process their whole size, a read key's way to exhaust it.
    with_payload = payloads and may_view_payload(actor)
    items = _transport_of(subscription).list_dead_letters(
        str(subscription.id), after, size + 1, with_payload=with_payload
    )
    if not with_payload:
        # Blanked whatever the transport read: one written before the keyword, or careless with
        # it, must not show a payload to a caller who may not see it (review helper-172).
        items = [replace(item, payload_json=None, payload_ref=None) for item in items]
    page = items[:size]
    more = len(items) > size or payloads_fill_the_page(page)
    next_cursor = cursors.encode({"delivery_id": page[-1].delivery_id}, name) if more else None
    return Page(True, page, next_cursor)


def list_partitions(
    subscription_name: str,
    *,
    condition: str | None = None,
    cursor: str | None = None,
    page_size: Any = None,
    actor: Actor = CLI,
) -> Page:
    """One page of a partitioned subscription's keys that are InFlight or Blocked (or the
    given ``condition``), by key. A subscription without partitions lists nothing.

    Each call looks at a bounded number of keys, so a page may hold fewer items than asked
    (even none) and still have a ``next_cursor``: follow it until it is None."""
    name = _name(subscription_name)
    if condition is not None and condition not in PartitionCondition.values:
        raise InvalidInputError(
            f"condition must be one of {', '.join(PartitionCondition.values)}; got {condition!r}."
        )
    size = cursors.page_size(page_size)
    after = cursors.decode(cursor, "partition_key", max_length=MAX_KEY_LENGTH, listing=name)
    # A cursor is opaque but not trusted: a forged one must not carry a key the database
    # cannot take.
    if isinstance(after, str) and text_problem(after) is not None:
        raise InvalidInputError("cursor is not valid; pass the next_cursor of a previous page.")
    require(actor, READ, subscription=name)
    subscription = _subscription(name, actor)
    if subscription.partition_mode == "None":
        return Page(True, [])
    found = _transport_of(subscription, "supports_partition_listing", "Listing partitions")
    items, resume_after = found.list_partitions(str(subscription.id), condition, after, size + 1)
    if len(items) > size:
        resume_after = items[size - 1].partition_key
    next_cursor = (
        None if resume_after is None else cursors.encode({"partition_key": resume_after}, name)
    )
    if found.keeps_deliveries_in_database:
        items = _with_leases(subscription, items[:size], condition, actor)
    return Page(True, items[:size], next_cursor)


def _with_leases(
    subscription: Any, items: list[PartitionItem], condition: str | None, actor: Actor
) -> list[PartitionItem]:
    """``items`` with each InFlight key's holder and lease end, read from its delivery in
    flight (at most one per key) or from the completed one whose handler, which completed in
    its own transaction, still holds the key (its hold's lease unexpired). The key's head is
    then that delivery, the one whose run a discard cancels: the first open one was the next
    message of a held key (review helper-199), and in an Exclusive key may be one waiting to be
    retried. A caller limited to named subscriptions sees the holder's pseudonym, as on
    /health.

    The holders are read after the listing: a key let go in between has none, and is listed
    as the key is now (its first open delivery the head, Idle or Blocked), or left out when
    that is not the ``condition`` asked for (review helper-200: listed InFlight and headed by
    its next message, a discard of "the running one" discarded a message that never ran)."""
    from workqueue.models import Delivery
    from workqueue.models.queue import HANDLER_RUNS

    keys = [item.partition_key for item in items if item.condition == "InFlight"]
    if not keys:
        return items
    leases: dict[str, Any] = {}
    for row in Delivery.objects.filter(
        HANDLER_RUNS,
        subscription=subscription,
        partition_key__in=keys,
    ).values("id", "partition_key", "status", "lease_owner", "lease_expires_at"):
        # A delivery in flight is the key's holder before a completed one (whose hold it
        # outlived, by the time it was read).
        if row["status"] == DeliveryStatus.IN_FLIGHT or row["partition_key"] not in leases:
            leases[row["partition_key"]] = row
    let_go = [
        item.head_delivery_id
        for item in items
        if item.condition == "InFlight" and item.partition_key not in leases
    ]
    head_status = (
        dict(Delivery.objects.filter(pk__in=let_go).values_list("id", "status")) if let_go else {}
    )
    listed = []
    for item in items:
        lease = leases.get(item.partition_key)
        if lease is not None:
            owner = lease["lease_owner"]
            item = replace(
                item,
                head_delivery_id=str(lease["id"]),
                lease_owner=host_pseudonym(owner) if actor.subscriptions and owner else owner,
                lease_expires_at=lease["lease_expires_at"],
            )
        elif item.condition == "InFlight":
            blocked = (
                subscription.partition_mode == "Ordered"
                and head_status.get(uuid.UUID(item.head_delivery_id))
                == DeliveryStatus.DEAD_LETTERED
            )
            item = replace(item, condition="Blocked" if blocked else "Idle")
            # As the listing would choose it now: the condition asked for, or any but Idle.
            if (item.condition != condition) if condition else (item.condition == "Idle"):
                continue
        listed.append(item)
    return listed


def replay(
    subscription_name: str, delivery_id: Any, *, note: str | None = None, actor: Actor = CLI
) -> ReplayOutcome:
    """Send a dead letter back to Pending with its attempts reset (an Ordered head keeps its
    place). ``replayed`` is False when the delivery is not a dead letter of this subscription."""
    name = _name(subscription_name)
    note = _note(note, "note")
    require(actor, OPERATE, subscription=name)
    subscription = _subscription(name, actor)
    target = _target_delivery_id(delivery_id)
    found = _transport_of(subscription, "supports_replay", "Replaying a dead letter")
    return ReplayOutcome(True, found.replay(str(subscription.id), target, actor.name, note))


def discard(
    subscription_name: str, delivery_id: Any, *, reason: str, actor: Actor = CLI
) -> DiscardOutcome:
    """Discard a Pending or dead-lettered delivery; for a running one, ask its holder to stop
    (``cancel_requested``): it becomes Discarded when its handler returns (or at lease expiry,
    if the handler ignores the signal that long) and never runs again. A running delivery whose
    cancel was asked before reads ``cancel_requested`` without ``discarded``: nothing changed,
    and its handler has not returned yet. A handler that completed its delivery in its own
    transaction and runs on holding its partition key is asked to stop too (``holds_key``):
    the delivery stays Completed, and the key is free when the handler returns."""
    name = _name(subscription_name)
    reason = _note(reason, "reason", required=True)
    require(actor, OPERATE, subscription=name)
    subscription = _subscription(name, actor)
    target = _target_delivery_id(delivery_id)
    found = _transport_of(subscription)
    result = found.discard(str(subscription.id), target, actor.name, reason)
    if not result.changed and not found.supports_cancel:
        raise UnsupportedByTransportError(
            f"Nothing was discarded: delivery {target} is not a dead letter of this "
            f"subscription. The {found.name} transport {subscription.topic.transport.name!r} "
            "can discard only dead letters by id: a waiting delivery cannot be picked out of "
            "its queue, and a running one cannot be cancelled (that needs supports_cancel). "
            "Let it run and settle (or its lease expire), then discard it if it dead-letters.",
            "supports_cancel",
        )
    return DiscardOutcome(True, result.changed, result.cancel_requested, result.holds_key)


BULK_BATCH_SIZE = 1000


def resolve_dead_letters(
    subscription_name: str,
    action: str,
    selection: DeadLetterSelection,
    *,
    dry_run: bool = False,
    note: str | None = None,
    batch_size: int = BULK_BATCH_SIZE,
    actor: Actor = CLI,
) -> BulkOutcome:
    """Replay (``action="replay"``) or discard (``"discard"``, which needs ``note`` as its
    reason) every dead letter of a subscription matching ``selection``, or count them with
    ``dry_run``. Works through the dead letters in batches of ``batch_size`` (1..5000), each
    its own transaction, so the rows of one batch are locked only while it runs; each changed
    delivery records the actor and note, as single replays and discards do. Replayed Ordered
    heads keep their places, so each key resumes in publish order. A database or transport
    failure after a batch committed raises BulkOperationInterrupted, which counts what was
    done."""
    name = _name(subscription_name)
    if action not in ("replay", "discard"):
        raise InvalidInputError("action must be replay or discard.")
    note = _note(note, "reason" if action == "discard" else "note", required=action == "discard")
    if not isinstance(batch_size, int) or not 1 <= batch_size <= 5000:
        raise InvalidInputError("batch_size must be a whole number from 1 to 5000.")
    filters = {
        # A reason is a name, compared whole: trimmed ("MaxAttemptsExceeded " matched none).
        "reason": _filter_text(selection.reason, "reason filter", trim=True),
        **_filter_parameters(
            partition_key=selection.partition_key,
            window={
                "dead_lettered_from": selection.dead_lettered_from,
                "dead_lettered_before": selection.dead_lettered_before,
            },
            error_contains=selection.error_contains,
        ),
    }
    require(actor, OPERATE, subscription=name)
    _require_read_to_filter_by_content(actor, name, filters, ("reason", "partition_key"))
    subscription = _subscription(name, actor)
    found = _transport_of(
        subscription,
        "supports_replay" if action == "replay" else None,
        "Replaying dead letters",
    )
    sub_id = str(subscription.id)
    return _in_batches(
        lambda after: found.resolve_dead_letters(
            sub_id,
            action.capitalize(),
            filters,
            after_delivery_id=after,
            batch_size=batch_size,
            dry_run=dry_run,
            actor=actor.name,
            note=note,
        ),
        batch_size,
        lambda batch: batch["last_delivery_id"],
        BulkOutcome(True, action, dry_run, matched=0, examined=0, batches=0),
        "dead letters",
    )


@dataclass(frozen=True, slots=True)
class PendingSelection:
    """Which waiting deliveries a bulk discard takes; an unset field matches all."""

    partition_key: str | None = None
    #: Published at or after this instant ...
    published_from: dt.datetime | None = None
    #: ... and before this one.
    published_before: dt.datetime | None = None
    #: Text the last error of an earlier attempt contains, ignoring case.
    error_contains: str | None = None


def discard_pending(
    subscription_name: str,
    selection: PendingSelection,
    *,
    reason: str,
    dry_run: bool = False,
    batch_size: int = BULK_BATCH_SIZE,
    actor: Actor = CLI,
) -> BulkOutcome:
    """Discard every Pending delivery of a subscription matching ``selection`` (they never
    run), or count them with ``dry_run``; ``reason`` is recorded on each. Works along the claim
    indexes in batches of ``batch_size``, each its own transaction, skipping rows a claim holds
    at that moment: running deliveries are never touched (cancel them one by one). A database
    or transport failure after a batch committed raises BulkOperationInterrupted, which counts
    what both indexes' batches did."""
    name = _name(subscription_name)
    reason = _note(reason, "reason", required=True)
    if not isinstance(batch_size, int) or not 1 <= batch_size <= 5000:
        raise InvalidInputError("batch_size must be a whole number from 1 to 5000.")
    filters = _filter_parameters(
        partition_key=selection.partition_key,
        window={
            "published_from": selection.published_from,
            "published_before": selection.published_before,
        },
        error_contains=selection.error_contains,
    )
    require(actor, OPERATE, subscription=name)
    _require_read_to_filter_by_content(actor, name, filters, ("partition_key",))
    subscription = _subscription(name, actor)
    found = _transport_of(
        subscription, "supports_bulk_discard_pending", "Discarding Pending deliveries in bulk"
    )
    outcome = BulkOutcome(True, "discard", dry_run, matched=0, examined=0, batches=0)
    for keyed in (False, True):  # the keyless claim index, then the keyed one
        outcome = _in_batches(
            lambda after, keyed=keyed: found.discard_pending(
                str(subscription.id),
                keyed=keyed,
                selection=filters,
                after=after,
                batch_size=batch_size,
                dry_run=dry_run,
                actor=actor.name,
                reason=reason,
            ),
            batch_size,
            lambda batch: (
                batch["last_priority"],
                batch["last_visible_at"],
                batch["last_delivery_id"],
            ),
            outcome,
            "waiting deliveries",
        )
    return outcome


def _in_batches(
    run_batch: Callable[[Any], dict[str, Any]],
    batch_size: int,
    resume_point: Callable[[dict[str, Any]], Any],
    done: BulkOutcome,
    rows: str,
) -> BulkOutcome:
    """Run a bulk operation's procedure batch after batch, each resuming where the last one's
    rows ended (``resume_point`` of its result), until one examines fewer rows than a full
    batch. Returns ``done`` (the outcome so far: nothing yet, or an earlier pass's) with the
    rows changed (or, on a dry run, to change), examined, and the batches added.

    A database or transport failure once a batch has committed is a BulkOperationInterrupted
    with the counts so far (``rows`` names what they count, "dead letters"): those batches
    stay applied, which the failure alone would not tell the caller. Ctrl-C then is a
    BulkOperationStopped (a KeyboardInterrupt) saying the same."""
    after = None
    while True:
        try:
            batch = run_batch(after)
        except (DriverError, TransportUnavailableError) as exc:
            if not done.batches:
                raise  # nothing was applied: the failure says all there is
            raise _interrupted(done, rows, exc) from exc
        except KeyboardInterrupt as stop:
            if not done.batches:
                raise
            # Ctrl-C at a bulk command: the operator needs the counts as much as after a
            # failure (review helper-183), and the interrupt must still stop what it stops.
            text = _what_the_batches_did(done, rows, "interrupted")
            raise BulkOperationStopped(
                f"{text} The batch under way at the interrupt may have been applied too.",
                **_counts_of(done),
            ) from stop
        done = replace(
            done,
            matched=done.matched + batch["changed"],
            examined=done.examined + batch["examined"],
            batches=done.batches + 1,
        )
        if batch["examined"] < batch_size:
            return done
        following = resume_point(batch)
        if following is None or following == after:
            # The same batch would be read forever.
            stuck = WorkQueueError(
                "A bulk operation's batch did not move past the rows it read; stopping rather "
                "than reading them again. Run `manage.py migrate` so the installed procedures "
                "match this version of django-workqueue, then run it again."
            )
            raise _interrupted(done, rows, stuck) from stuck
        after = following


def _what_the_batches_did(done: BulkOutcome, rows: str, stopped: str) -> str:
    """What the committed batches (``done``) did before the operation was ``stopped`` ("stopped
    by an error", "interrupted"), and what running it again does."""
    changed = "replayed" if done.action == "replay" else "discarded"
    batches = count_of(done.batches, "batch", "batches")
    if done.dry_run:
        return (
            f"The dry run was {stopped} after {batches}, having found {done.matched} of the "
            f"{done.examined} {rows} examined to be {changed}; nothing was changed. Run it "
            "again to count them all."
        )
    return (
        f"{stopped.capitalize()} after {batches}, in which {done.matched} of the "
        f"{done.examined} {rows} examined were {changed}: those stay {changed}. Running it "
        "again is safe and goes on with what is left (a dry run counts it)."
    )


def _interrupted(done: BulkOutcome, rows: str, error: WorkQueueError) -> BulkOperationInterrupted:
    """The error saying what the committed batches (``done``) did before ``error``."""
    text = _what_the_batches_did(done, rows, "stopped by an error")
    return BulkOperationInterrupted(f"{text} The error: {one_line(error)}", **_counts_of(done))


def _counts_of(done: BulkOutcome) -> dict[str, Any]:
    """What a stopped operation's error carries of the committed batches (``done``)."""
    return {
        "action": done.action,
        "dry_run": done.dry_run,
        "matched": done.matched,
        "examined": done.examined,
        "batches": done.batches,
    }


def _require_read_to_filter_by_content(
    actor: Actor, name: str, filters: dict[str, Any], content: tuple[str, ...]
) -> None:
    """A bulk operation filtered by what the deliveries hold (``content``'s filters, and the
    error text) answers, in the count it returns, what reading them would: "card 4" matched 1
    and "card 5" none reads an error a character at a time (review helper-143). Such a filter
    needs what reading needs too; no filter, or a time window, only what operating needs."""
    if all(filters.get(what) is None for what in (*content, "error_contains")):
        return
    try:
        require(actor, READ, subscription=name)
    except PermissionDeniedError as exc:
        # Named in no one door's words (REST's errorContains, the admin's labels, the CLI's
        # --error-contains): what each filter is.
        raise PermissionDeniedError(
            "A filter on what the deliveries hold (their dead-letter reason, partition key or "
            f"error text) tells it, as reading them would: {exc} Filter by time only, or act "
            "as a caller who may read."
        ) from exc


def _filter_parameters(
    *,
    partition_key: Any,
    window: dict[str, dt.datetime | None],
    error_contains: Any,
) -> dict[str, Any]:
    """A bulk operation's filters checked and named as its procedure's parameters: ``window``
    maps the two bounds' parameter names (from, before) to their instants."""
    if partition_key is not None:
        if (
            not isinstance(partition_key, str)
            or not partition_key
            # Characters, not UTF-16 units: a filter only selects, and a PostgreSQL database
            # may hold keys of up to 200 emoji that earlier releases accepted.
            or len(partition_key) > MAX_KEY_LENGTH
        ):
            raise InvalidInputError(
                f"partition_key must be 1 to {MAX_KEY_LENGTH} characters of text."
            )
        partition_key = _storable(partition_key, "partition_key")
    for what, instant in window.items():
        if instant is not None and (not isinstance(instant, dt.datetime) or instant.tzinfo is None):
            raise InvalidInputError(f"{what} must be a date and time with its UTC offset.")
    (start_name, start), (end_name, end) = window.items()
    if start is not None and end is not None and start >= end:
        raise InvalidInputError(f"{start_name} must be earlier than {end_name}.")
    return {
        "partition_key": partition_key,
        **window,
        "error_contains": _filter_text(error_contains, "error_contains filter"),
    }


def backlog(subscription_name: str, *, actor: Actor = CLI) -> BacklogReport:
    """Claimable and in-flight counts for autoscaling, each capped at 1000."""
    name = _name(subscription_name)
    require(actor, READ, subscription=name)
    subscription = _subscription(name, actor)
    result = _transport_of(subscription).backlog(str(subscription.id))
    if result is None:
        raise _no_subscription(name, actor)
    return BacklogReport(True, result.claimable, result.in_flight, result.total, result.capped)


def check_scaler_query(subscription_name: str) -> bool | None:
    """Whether a subscription has the name (None: the database could not be read). Refuse
    (``UnsupportedByTransportError``) the database scaler query for a subscription whose
    transport keeps its deliveries elsewhere: the query would always answer 0, so an
    autoscaler would never start a job. The refusal names what to scale on instead. A name
    no subscription has, or a database that cannot be reached, is not refused: the query is
    made from the name (the subscription may be created later), and printing it needs no
    connection."""
    from django.db import Error as DatabaseError

    from workqueue.models import Subscription

    name = _name(subscription_name)
    try:
        found = Subscription.objects.select_related("topic__transport").filter(name=name).first()
    except DatabaseError:  # any database library error, a connection refused included
        return None
    if found is None:
        return False
    refusal = _transport_of(found).scaler_query_refusal(found)
    if refusal is not None:
        raise UnsupportedByTransportError(refusal, "keeps_deliveries_in_database")
    return True


def validate_bindings(
    transport_name: str | None = None, *, actor: Actor = CLI
) -> list[BindingIssue]:
    """Configuration problems that would stop work from flowing, as Errors and Warnings.

    A caller limited to named subscriptions gets only the issues about those subscriptions,
    their topics and those topics' transports (see ``_visible_subjects``)."""
    from workqueue.models import HostRecord, Subscription, Transport

    require(actor, READ)
    visible = _visible_subjects(actor)
    transports = Transport.objects.all()
    if transport_name is not None:
        transports = transports.filter(name__iexact=_name(transport_name, "transport_name"))
        names = transports.values_list("name", flat=True)
        # A transport the caller may not see answers like one that does not exist.
        if not any(visible is None or f"transport {name}" in visible for name in names):
            raise NotFoundError(f"No transport is named {transport_name!r}.")
    issues: list[BindingIssue] = []
    if not transport.read_committed_snapshot_on():
        issues.append(
            BindingIssue(
                "Error",
                "database",
                "READ_COMMITTED_SNAPSHOT is off: readers block claims and claims block readers. "
                "Run: ALTER DATABASE CURRENT SET READ_COMMITTED_SNAPSHOT ON WITH ROLLBACK "
                "IMMEDIATE;",
            )
        )
    schema_problem = transport.schema_problem()
    if schema_problem is not None:
        issues.append(BindingIssue("Error", "database", schema_problem))
    procedures_problem = transport.procedures_problem()
    if procedures_problem is not None:
        issues.append(BindingIssue("Error", "database", procedures_problem))
    issues.extend(_database_health_issues())
    live_keys: set[str] = set()
    in_scope: set[str] = set()  # subscriptions of the transports checked
    live_hosts = list(HostRecord.objects.live())
    for record in live_hosts:
        live_keys.update(record.registered_handler_keys())
    for tr in transports.order_by("name"):
        try:
            transport_class: type[BaseTransport] | None = tr.transport_class
        except WorkQueueConfigurationError as exc:
            transport_class = None
            issues.append(BindingIssue("Error", f"transport {tr.name}", str(exc)))
        if tr.status != "Active":
            issues.append(
                BindingIssue(
                    "Warning",
                    f"transport {tr.name}",
                    "The transport is disabled: publishes to its topics are rejected.",
                )
            )
        if transport_class is not None and tr.status == "Active":
            if may_call_the_cloud(actor):
                issues.extend(
                    _provisioning_issues(tr, transport_class, limited=visible is not None)
                )
            elif transport_class.provision is not BaseTransport.provision:
                issues.append(
                    BindingIssue(
                        "Warning",
                        f"transport {tr.name}",
                        "Whether its cloud resources match the topology was not checked: the "
                        "provisioning dry run calls the cloud with the server's credentials, "
                        f"which needs the {CHANGE_TRANSPORT_PERMISSION} permission.",
                    )
                )
        for topic in tr.topics.order_by("name"):
            if topic.is_fifo and transport_class and not transport_class.honours_topic_is_fifo:
                issues.append(
                    BindingIssue(
                        "Warning",
                        f"topic {topic.name}",
                        f"is_fifo has no effect on the {transport_class.name} transport.",
                    )
                )
        subscriptions = (
            Subscription.objects.filter(topic__transport=tr)
            .select_related("topic")
            .order_by("name")
        )
        for sub in subscriptions:
            in_scope.add(sub.name)
            subject = f"subscription {sub.name}"
            if tasks_problem := sub.external_tasks_problem():
                issues.append(BindingIssue("Error", subject, tasks_problem))
            filter_problem = sub.filter_problem()
            if filter_problem is not None:
                issues.append(
                    BindingIssue(
                        "Error",
                        subject,
                        f"The stored filter is invalid, so the subscription matches no message "
                        f"until it is fixed: {filter_problem}. Correct it in the admin (or save "
                        "the subscription from code), where it is checked.",
                    )
                )
            problem = transport_class and transport_class.subscription_problem(sub, tr.name)
            if problem:
                issues.append(BindingIssue("Error", subject, problem))
            if sub.host_type == "Worker" and not sub.handler_key.strip():
                issues.append(BindingIssue("Error", subject, "No handler key is set."))
            elif sub.host_type == "Worker" and sub.handler_key.strip() not in live_keys:
                issues.append(
                    BindingIssue(
                        "Warning",
                        subject,
                        f"Handler key {sub.handler_key!r} is not registered in any live host; "
                        "its deliveries wait until a host with that handler runs.",
                    )
                )
    for unserved in unserved_subscriptions(actor=actor, live_hosts=live_hosts):
        if unserved.name in in_scope and unserved.due is None:
            # The transport's own words name its endpoint (credentials and all, when written
            # into the URL) and, from a cloud, the server's identity and account: for those
            # who may change transports only, as the provisioning dry run is.
            why = unserved.problem
            if not may_call_the_cloud(actor):
                logger.warning("The backlog of %s could not be read: %s", unserved.name, why)
                why = "its transport could not be reached or refused (the server's log says why)"
            issues.append(
                BindingIssue(
                    "Warning",
                    f"subscription {unserved.name}",
                    "Its backlog could not be read, so whether work waits for it is unknown: "
                    + why,
                )
            )
        elif unserved.name in in_scope:
            issues.append(
                BindingIssue(
                    "Warning",
                    f"subscription {unserved.name}",
                    f"{unserved.waiting()} and no live host runs this subscription; they "
                    "wait until one does. Start a host "
                    f"that runs it (`manage.py workqueue_host -s {unserved.name}`, or '*' in "
                    "WORKQUEUE['SUBSCRIPTIONS']), or pause the subscription.",
                )
            )
    issues.extend(_stuck_run_issues(live_hosts, in_scope))
    if visible is None:
        return issues
    return [issue for issue in issues if issue.subject in visible]


def _provisioning_issues(
    row: Any, transport_class: type[BaseTransport], *, limited: bool
) -> list[BindingIssue]:
    """A warning when the transport's cloud resources are missing or differ from the topology
    (a provisioning dry run; nothing for a transport with nothing to provision). A caller
    limited to named subscriptions hears how many, not which: the names map the topology."""
    subject = f"transport {row.name}"
    command = f"`manage.py workqueue provision --transport {row.name}`"
    try:
        found = transport_class().provision(row, dry_run=True)
        changes = [c for c in found if c.action not in ("keep", "refuse")]
        refused = [c for c in found if c.action == "refuse"]
    except (TransportUnavailableError, WorkQueueConfigurationError) as exc:
        return [
            BindingIssue(
                "Warning",
                subject,
                f"Its resources could not be checked ({exc}); {command} --dry-run shows them.",
            )
        ]
    issues = [
        # Provisioning cannot fix these: the detail says what to change.
        BindingIssue("Error", subject, f"{c.kind} {c.name} is refused: {c.detail}")
        for c in ([] if limited else refused)
    ]
    if not changes:
        return issues
    listed = (
        f"{len(changes)} changes"
        if limited
        else "; ".join(f"{c.action} {c.kind} {c.name}" for c in changes)
    )
    return [
        *issues,
        BindingIssue(
            "Warning",
            subject,
            f"Its cloud resources do not match the topology ({listed}): publishes and claims "
            f"fail or miss messages until you run {command}.",
        ),
    ]


def database_warnings(*, actor: Actor = CLI) -> list[str]:
    """What threatens the queue tables' upkeep now (sparse indexes, a vacuum horizon held past
    ``VACUUM_HORIZON_WARNING_SECONDS``, a filling notification queue, dead rows outnumbering
    live ones), as sentences naming
    the fix. Database-wide, so a caller limited to named subscriptions hears only that the
    queue tables are locked: its own subscriptions' claims wait for that lock too, and a
    monitor reading ``ok`` meanwhile would be lied to."""
    require(actor, READ)
    issues = _database_health_issues()
    if actor.subscriptions:
        issues = [issue for issue in issues if issue.subject == QUEUE_TABLES_LOCKED]
    return [issue.message for issue in issues]


#: The subject of the issue that says the queue tables are locked: every caller may see it.
QUEUE_TABLES_LOCKED = "queue tables"


def _database_health_issues() -> list[BindingIssue]:
    try:
        return _read_database_health_issues()
    except LockTimeoutError as exc:
        # The reads wait 2 s at most for a lock on a queue table: one held longer is itself
        # what an operator must hear of (claims and publishes wait behind it too), not a
        # failed /health (review helper-187).
        return [
            BindingIssue(
                "Warning",
                QUEUE_TABLES_LOCKED,
                f"The queue tables are locked (VACUUM FULL, REINDEX, a migrate's ALTER TABLE?): "
                f"their upkeep could not be checked, and claims and publishes wait for the lock "
                f"too. Find the holder in pg_locks / sys.dm_tran_locks. ({one_line(exc)})",
            )
        ]


def _read_database_health_issues() -> list[BindingIssue]:
    settings = get_settings()
    issues: list[BindingIssue] = []
    sparse = transport.sparse_queue_indexes()
    if sparse:
        listed = ", ".join(f"{i.name} ({i.pages:,} pages, {i.entries:,} entries)" for i in sparse)
        issues.append(
            BindingIssue(
                "Warning",
                "database",
                f"Queue indexes far larger than their entries need, as a drained backlog leaves "
                f"them: {listed}. The planner may avoid them and claims slow down; run "
                "`manage.py workqueue reindex` as the owner of the work-queue tables.",
            )
        )
    horizon = transport.vacuum_horizon()
    if horizon.holder and horizon.age_seconds >= settings.VACUUM_HORIZON_WARNING_SECONDS:
        issues.append(
            BindingIssue(
                "Warning",
                "database",
                f"The {horizon.holder} has held back vacuum for {horizon.age_seconds:,.0f} s: no "
                "dead row of the queue tables younger than it can be cleaned up, so they and "
                "their indexes grow and claims slow down. End it (commit, or "
                "pg_terminate_backend / KILL the session; drop an unused replication slot). "
                "The threshold is WORKQUEUE['VACUUM_HORIZON_WARNING_SECONDS'].",
            )
        )
    usage = transport.notification_queue_usage()
    if usage is not None and usage >= transport.NOTIFICATION_QUEUE_WARNING_USAGE:
        issues.append(
            BindingIssue(
                "Warning",
                "database",
                f"The server's notification queue is {usage:.1%} full, and every publish fails "
                "once it is full: a session listening for notifications has stopped reading "
                "them. The sweeper disconnects such sessions of this database and logs what it "
                "did; find one it cannot end in pg_stat_activity (wait_event ClientWrite, or an "
                "old xact_start) and end it (pg_terminate_backend).",
            )
        )
    for table in transport.queue_table_sizes():
        dead = table.dead_rows
        if dead is not None and dead >= settings.DEAD_ROWS_WARNING and dead > table.live_rows:
            issues.append(
                BindingIssue(
                    "Warning",
                    "database",
                    f"{table.name} holds {dead:,} dead rows against {table.live_rows:,} live "
                    "ones: vacuum is not keeping up. Look for a held vacuum horizon (the "
                    "workqueue_db_vacuum_horizon_* metrics) and at autovacuum's settings for "
                    "this table. The threshold is WORKQUEUE['DEAD_ROWS_WARNING'].",
                )
            )
    return issues


def _stuck_run_issues(live_hosts: list[Any], in_scope: set[str]) -> list[BindingIssue]:
    """A Warning for each subscription in ``in_scope`` whose handler runs a live host reports
    past their threshold (``runtime.handler_runs``): one holds its slot, and on an Exclusive or
    Ordered subscription its key, for as long as it runs."""
    found: dict[str, tuple[int, list[dict[str, Any]]]] = {}
    for record in live_hosts:
        for entry in record.subscription_entries():
            if entry["name"] in in_scope and entry["stuck_count"]:
                count, runs = found.get(entry["name"], (0, []))
                found[entry["name"]] = (count + entry["stuck_count"], runs + entry["stuck_runs"])
    issues = []
    for name in sorted(found):
        count, runs = found[name]
        oldest = max(runs, key=lambda run: run["seconds"], default=None)
        named = (
            f" (the oldest: delivery {oldest['delivery_id']}, handler {oldest['handler_key']}, "
            f"{oldest['seconds']:,.0f} s against {oldest['threshold_seconds']:,} s). "
            + what_to_do(name, oldest["delivery_id"], oldest["cancellable"])
            if oldest is not None
            else ". GET /work-queue/health names them"
        )
        issues.append(
            BindingIssue(
                "Warning",
                f"subscription {name}",
                f"{count} handler run{'s' if count != 1 else ''} on live hosts "
                f"{'have' if count != 1 else 'has'} run past the threshold "
                f"(max_processing_seconds, else HANDLER_RUN_WARNING_SECONDS) and may be "
                f"hung{named}; a handler deaf to its abort signal runs on until its host "
                "restarts.",
            )
        )
    return issues


def unserved_subscriptions(
    *, actor: Actor = CLI, live_hosts: Iterable[HostRecord] | None = None
) -> list[UnservedSubscription]:
    """Subscriptions with deliveries due now that no live host is running: nothing will process
    that work until a host runs them. Only subscriptions meant to run count: Active, with an
    Active topic and transport, consumed by work-queue hosts (Paused and Disabled ones are
    left out). A caller limited to named subscriptions hears only about those.

    Each candidate's own transport counts its backlog (the queue tables, or a cloud queue's
    attributes); one whose transport cannot be reached or is misconfigured is listed with
    ``due`` None and the ``problem``, since work may be waiting there unseen. ``live_hosts``:
    the live host records when the caller has read them already."""
    from workqueue.models import HostRecord, Subscription

    require(actor, READ)
    running: set[str] = set()
    listed: set[str] = set()  # by a live host in any state (one draining lists it Paused)
    for record in HostRecord.objects.live() if live_hosts is None else live_hosts:
        entries = record.subscription_entries()
        running.update(entry["name"] for entry in entries if entry["state"] == "Running")
        listed.update(entry["name"] for entry in entries)
    candidates = (
        Subscription.objects.select_related("topic__transport")
        .filter(
            status="Active",
            host_type="Worker",
            topic__status="Active",
            topic__transport__status="Active",
        )
        .exclude(name__in=running)
    )
    if actor.subscriptions:
        candidates = candidates.filter(name__in=actor.subscriptions)
    unserved = []
    locked = _LockedTables()
    for subscription in candidates.order_by("name").select_related("topic__transport"):
        if (why := locked.why(subscription)) is not None:
            unserved.append(UnservedSubscription(subscription.name, None, why))
            continue
        # One probe each: on the Database transport wq_backlog, which counts what a claim
        # could take now (one per key on partitioned subscriptions) along index paths,
        # whatever the size of the backlog; on a cloud transport the queue's counts.
        try:
            counted = _transport_of(subscription).backlog(str(subscription.id))
        except (
            TransportUnavailableError,
            UnsupportedByTransportError,
            WorkQueueConfigurationError,
            # A queue table locked (VACUUM FULL, a migrate's ALTER TABLE) for more than the
            # probe waits: counted as unreadable, not a failed /health (review helper-187).
            LockTimeoutError,
        ) as exc:
            unserved.append(UnservedSubscription(subscription.name, None, str(exc)))
            locked.note(subscription, exc)
            continue
        if counted is None:
            continue
        # In flight with no live host listing the subscription: held by hosts that are gone.
        held = counted.in_flight if subscription.name not in listed else 0
        if counted.claimable or held:
            unserved.append(UnservedSubscription(subscription.name, counted.claimable, held=held))
    return unserved


def _visible_subjects(actor: Actor) -> set[str] | None:
    """The issue subjects a caller limited to named subscriptions may see, or None when the
    caller is not limited. Issues about other subscriptions and topics would show the rest of
    the topology, and database-wide ones name indexes sized by every subscription's backlog.
    A subject not listed here is left out, so a new kind of issue stays hidden from limited
    callers until it is given a subject they may see."""
    from workqueue.models import Subscription

    if not actor.subscriptions:
        return None
    visible: set[str] = {QUEUE_TABLES_LOCKED}
    for name, topic, transport_name in Subscription.objects.filter(
        name__in=actor.subscriptions
    ).values_list("name", "topic__name", "topic__transport__name"):
        visible |= {f"subscription {name}", f"topic {topic}", f"transport {transport_name}"}
    return visible
