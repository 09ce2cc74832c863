"""The transport interface and its capability flags.

A transport is where a topic's messages live and how a subscription's deliveries are claimed and
settled. ``Transport.driver_class`` names one (see ``workqueue.transports``); callers read its
capability flags instead of asking which transport it is, the way Django code reads
``connection.features.supports_*``. The database vendor layer (``workqueue.driver``) sits below:
the Database transport uses it, other transports need not.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from workqueue.exceptions import UnsupportedByTransportError
from workqueue.types import HeartbeatMode, HostType, PartitionMode

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

    from workqueue.types import (
        Backlog,
        ClaimedDelivery,
        ClaimResult,
        DeadLetterItem,
        DiscardResult,
        LeaseExtension,
        PartitionItem,
        RateTokens,
        SettleResult,
    )


@dataclass(frozen=True, slots=True)
class ProvisionChange:
    """One cloud resource ``manage.py workqueue provision`` created, changed or found as it
    should be (``action`` create | update | keep), or would on a dry run."""

    action: str
    kind: str
    name: str
    detail: str = ""


class TransportReceiver(Protocol):
    """What a consumer holds for one subscription: claim, heartbeat and settle, each fenced by
    the delivery's lease token (a settle by a holder whose lease is gone answers LeaseLost)."""

    subscription_id: str
    lease_owner: str

    @property
    def enlist_alias(self) -> str | None:
        """The database alias whose open transaction may take a completion
        (``context.complete(enlist=True)``); None when the transport cannot enlist."""
        ...

    def close(self) -> None: ...

    def receive(self, max_rows: int) -> ClaimResult: ...

    def extend_lease(
        self, delivery: ClaimedDelivery, progress: dict[str, Any] | None = None
    ) -> LeaseExtension: ...

    def take_rate_tokens(self, wanted: int) -> RateTokens: ...

    def return_rate_tokens(
        self, unused: int, held_seconds: float, full_in_seconds: float
    ) -> None: ...

    def complete(
        self,
        delivery: ClaimedDelivery,
        *,
        connection: BaseDatabaseWrapper | None = None,
        holding_key: bool = False,
    ) -> SettleResult:
        """Complete ``delivery``; given ``connection``, inside the caller's open transaction.
        ``holding_key`` (with ``connection``: a handler that runs on after its transaction)
        keeps the delivery's partition key from being claimed until ``release_key``, or until
        the lease ends."""
        ...

    def release_key(self, delivery: ClaimedDelivery) -> SettleResult:
        """Free the partition key a completion ``holding_key`` held: its handler returned."""
        ...

    def complete_many(
        self, deliveries: Iterable[ClaimedDelivery]
    ) -> dict[str, SettleResult | Exception]:
        """Each delivery's completion, by delivery id: its result, or the failure its holder
        hears (and may make the completion again after) when only part of the batch failed.
        A failure of the whole batch is raised."""
        ...

    def retry(
        self, delivery: ClaimedDelivery, delay_seconds: int = 0, error: str | None = None
    ) -> SettleResult: ...

    def dead_letter(
        self, delivery: ClaimedDelivery, reason: str, error: str | None = None
    ) -> SettleResult: ...

    def release(self, delivery: ClaimedDelivery) -> SettleResult: ...

    def max_attempts(self, planned: int) -> int:
        """The subscription's ``max_attempts`` as this transport goes by it now, asked when the
        plan (``planned``, read at the last re-plan) says a failed attempt is the last: a
        transport whose own rules read the stored value answers that one."""
        ...

    def acknowledge_cancel(self, delivery: ClaimedDelivery) -> SettleResult: ...

    def settles_go_through(self) -> bool:
        """Whether a settle would be recorded now, asked without a delivery: False when the
        transport refuses this process's settles for want of a grant (``PrivilegeRefusedError``,
        which a settle of a handled delivery met). A host asks while its settles are refused
        and it has no delivery to probe with (raising WorkQueueError when it cannot tell)."""
        ...

    def carry_over_from(self, previous: TransportReceiver) -> None:
        """Take on what ``previous``, the receiver this one replaces (the same subscription and
        holder: a re-plan rebuilt the consumer), still owed its next claims, such as a claim
        whose answer was lost: dropped with it, what that claim took waited out its lease.
        Called before this receiver's first claim, once ``previous``'s consumer has stopped (a
        claim of its may still be out, and fail later)."""
        ...

    def cancel_requested(self, delivery: ClaimedDelivery) -> bool:
        """Whether an operator has asked to cancel ``delivery``, read without renewing its
        lease; asked of a transport with ``supports_cancel`` when a cancel was announced. A
        transport without it has such a check made as a renewal (``extend_lease``)."""
        ...

    def completed_at_its_attempt(self, delivery: ClaimedDelivery) -> bool:
        """Whether ``delivery`` is Completed at the attempt this holder claimed. Asked only
        when a completion's answer was lost (its connection dropped after the commit) and the
        completion sent again was refused as already done; False when the transport cannot
        tell."""
        ...

    def dead_lettered_at_its_attempt(self, delivery: ClaimedDelivery, reason: str) -> bool:
        """Whether ``delivery`` is dead-lettered with ``reason`` at the attempt this holder
        claimed; asked, as ``completed_at_its_attempt`` is, for a dead letter sent again after
        its answer was lost."""
        ...


class BaseTransport:
    """One transport: its capabilities (class attributes) and its operations.

    Subclasses set the ``supports_*`` flags they honour and implement the methods: claiming and
    settling through the ``receiver``, operators through the remaining methods. A method a
    transport cannot do is one whose flag is off: callers check the flag (``require``) before
    calling, so the refusal names the capability.
    """

    #: The name ``Transport.driver_class`` holds for this transport.
    name: ClassVar[str] = ""

    # -- capabilities: what a subscription may use --------------------------------------------
    #: Exclusive partitions: one running delivery per partition key at a time.
    supports_exclusive: ClassVar[bool] = False
    #: Ordered partitions: per key, in publish order, a dead letter blocking its key.
    supports_ordered: ClassVar[bool] = False
    #: Heartbeat modes a subscription may choose (``HeartbeatMode`` values).
    heartbeat_modes: ClassVar[frozenset[str]] = frozenset({HeartbeatMode.AUTO})
    #: ``rate_limit_per_second`` on subscriptions (a bucket shared by every host).
    supports_rate_limit: ClassVar[bool] = False
    #: Subscriptions consumed outside the work-queue host (``host_type=External``).
    supports_external_consumers: ClassVar[bool] = False
    # -- capabilities: what a publisher may ask for -------------------------------------------
    #: ``deduplication_key`` on publish.
    supports_deduplication: ClassVar[bool] = False
    #: ``not_before`` / ``delay_seconds`` on publish.
    supports_scheduled_publish: ClassVar[bool] = False
    #: ``priority`` other than 0 on publish.
    supports_priority: ClassVar[bool] = False
    #: ``publish(..., enlist=True)``: the publish commits or rolls back with the caller's
    #: database transaction.
    supports_enlisted_publish: ClassVar[bool] = False
    # -- capabilities: what an operator may do ------------------------------------------------
    #: Replaying dead letters (one by one and in bulk).
    supports_replay: ClassVar[bool] = False
    #: Asking the holder of a running delivery to stop (discard of a running delivery).
    supports_cancel: ClassVar[bool] = False
    #: Listing partition keys and their conditions.
    supports_partition_listing: ClassVar[bool] = False
    #: Bulk discard of Pending deliveries by filter.
    supports_bulk_discard_pending: ClassVar[bool] = False

    #: How this transport legitimately differs in the conformance suite beyond its flags
    #: (``workqueue.testing.conformance.TransportTraits`` fields and their values).
    conformance_traits: ClassVar[dict[str, Any]] = {}

    #: Its deliveries are rows of this database's queue tables, so the admin's Delivery pages
    #: list them (otherwise operators reach them through the operator API and CLI).
    keeps_deliveries_in_database: ClassVar[bool] = False

    #: ``Topic.is_fifo`` chooses the kind of resource a topic gets (not a capability: on a
    #: transport without that choice the field simply has no effect).
    honours_topic_is_fifo: ClassVar[bool] = False

    #: Its resources are named after the topology (a topic's name and ``is_fifo``, a
    #: subscription's name and topic): changed, provisioning makes new ones and the work waiting
    #: in the old ones is read by nobody, so the topology refuses such a change.
    names_resources_after_topology: ClassVar[bool] = False

    #: Which flag each partition mode needs (None needs nothing).
    PARTITION_MODE_FLAGS: ClassVar[dict[str, str]] = {
        PartitionMode.EXCLUSIVE: "supports_exclusive",
        PartitionMode.ORDERED: "supports_ordered",
    }

    # -- capability checks ---------------------------------------------------------------------

    @classmethod
    def require(cls, flag: str, what: str, transport_name: str) -> None:
        """Raise ``UnsupportedByTransportError`` naming ``flag`` unless this transport has it."""
        if not getattr(cls, flag):
            raise UnsupportedByTransportError(cls.refusal(flag, what, transport_name), flag)

    @classmethod
    def refusal(cls, flag: str, what: str, transport_name: str) -> str:
        return (
            f"{what} needs {flag}, which the {cls.name} transport {transport_name!r} does not "
            f"have; bind the topic to a transport that has it (the Database transport has "
            f"every capability)."
        )

    @classmethod
    def subscription_problem(cls, subscription: Any, transport_name: str) -> str | None:
        """Why this transport cannot run ``subscription`` as configured (None when it can):
        the reason names the missing capability, e.g. "Ordered needs supports_ordered ..."."""
        flag = cls.PARTITION_MODE_FLAGS.get(subscription.partition_mode)
        if flag is not None and not getattr(cls, flag):
            return cls.refusal(flag, subscription.partition_mode, transport_name)
        if subscription.heartbeat_mode not in cls.heartbeat_modes:
            return (
                f"Heartbeat mode {subscription.heartbeat_mode} needs heartbeat_modes to include "
                f"it; the {cls.name} transport {transport_name!r} has "
                f"{', '.join(sorted(cls.heartbeat_modes))}. Choose one of those or a Database "
                f"topic."
            )
        if subscription.rate_limit_per_second is not None and not cls.supports_rate_limit:
            return cls.refusal("supports_rate_limit", "rate_limit_per_second", transport_name)
        if subscription.host_type == HostType.EXTERNAL and not cls.supports_external_consumers:
            return cls.refusal(
                "supports_external_consumers", "An External consumer", transport_name
            )
        return None

    @classmethod
    def configuration_problem(cls, configuration: dict[str, Any] | None) -> str | None:
        """Why ``Transport.configuration`` cannot configure this transport (None when it can);
        the text names the key and the fix. Checked whenever a Transport row is saved."""
        return None

    @classmethod
    def subscription_field_problems(
        cls, subscription: Any, configuration: dict[str, Any] | None
    ) -> dict[str, str]:
        """Problems, by field, that stop this transport from carrying ``subscription`` at all
        (a filter it cannot express, a name too long for its resources); checked whenever the
        subscription is saved. What the host merely cannot run is ``subscription_problem``."""
        return {}

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        """Every capability flag and its value (for docs, the admin and ``validate-bindings``)."""
        found: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):
            for key in vars(klass):
                if key.startswith("supports_") or key == "heartbeat_modes":
                    value = getattr(cls, key)
                    found[key] = sorted(value) if isinstance(value, frozenset) else value
        return found

    # -- publishing ----------------------------------------------------------------------------

    def publish(
        self,
        topic: Any,
        messages: list[dict[str, Any]],
        *,
        publisher: str,
        enlist: bool,
        external: bool,
        chosen_message_ids: frozenset[str] = frozenset(),
    ) -> list[dict[str, Any]]:
        """Publish validated messages (``workqueue.publishing``'s parameters for each) to
        ``topic`` (a ``Topic`` row of this transport); one row per message, in order, with
        ``message_id``, ``status``, ``error_code`` and optionally ``error_message``.

        ``chosen_message_ids`` are the ids the publisher gave; the others were generated for
        this call and are new by construction (a transport that must record ids to answer
        Duplicate / MessageIDConflict need only record these)."""
        raise NotImplementedError

    # -- autoscaling ---------------------------------------------------------------------------

    def scaler_query_refusal(self, subscription: Any) -> str | None:
        """Why the database scaler query (``manage.py workqueue scaler-query``) cannot measure
        ``subscription``'s backlog, naming what an autoscaler should read instead; None when
        it can. The query reads the queue tables, so it measures only transports that keep
        their deliveries there."""
        if self.keeps_deliveries_in_database:
            return None
        return (
            f"Subscription {subscription.name!r} is on the {self.name} transport, whose "
            "deliveries are not in this database: the scaler query would always answer 0. "
            "Scale on the transport's own queue instead."
        )

    # -- provisioning --------------------------------------------------------------------------

    def provision(self, transport: Any, *, dry_run: bool) -> list[ProvisionChange]:
        """Create or update the resources the topics and subscriptions of ``transport`` (a
        ``Transport`` row of this transport) need; with ``dry_run`` only report what would
        change. Idempotent: a second run reports only ``keep``."""
        return []

    # -- consuming -----------------------------------------------------------------------------

    def receiver(self, subscription_id: str, lease_owner: str | None = None) -> TransportReceiver:
        raise NotImplementedError

    # -- operator reads ------------------------------------------------------------------------

    def subscription_stats(
        self, subscription_id: str, cap: int | None = None
    ) -> dict[str, Any] | None:
        """An operator's counts (those of ``queue_gauges``, ``completed_last_hour``, ``as_of``
        and ``capped``), each made up to ``cap`` where counting costs what it counts (None:
        1,000,000); ``capped`` says when one stopped there."""
        raise NotImplementedError

    def backlog(self, subscription_id: str) -> Backlog | None:
        raise NotImplementedError

    def queue_gauges(self, subscription_id: str, cap: int) -> dict[str, Any] | None:
        """A metrics scrape's counts (``pending``, ``in_flight``, ``dead_lettered``,
        ``blocked_keys``, ``oldest_pending_age_seconds``), each at most ``cap``."""
        raise NotImplementedError

    def list_dead_letters(
        self,
        subscription_id: str,
        after_delivery_id: str | None,
        page_size: int,
        *,
        with_payload: bool = True,
    ) -> list[DeadLetterItem]:
        """Up to ``page_size`` dead letters by delivery id, after ``after_delivery_id``; without
        their payloads and references (None) when ``with_payload`` is false, read as little of
        them as the transport can. With payloads, the page ends at the item whose payload text
        takes the page's total to DEAD_LETTER_PAGE_PAYLOAD_CHARS."""
        raise NotImplementedError

    def list_partitions(
        self,
        subscription_id: str,
        condition: str | None,
        after_partition_key: str | None,
        page_size: int,
    ) -> tuple[list[PartitionItem], str | None]:
        raise NotImplementedError

    # -- operator writes -----------------------------------------------------------------------

    def replay(
        self, subscription_id: str, delivery_id: str, actor: str | None, note: str | None
    ) -> bool:
        raise NotImplementedError

    def discard(
        self, subscription_id: str, delivery_id: str, actor: str | None, reason: str | None
    ) -> DiscardResult:
        """Discard a Pending or dead-lettered delivery; with ``supports_cancel``, also ask the
        holder of a running one to stop."""
        raise NotImplementedError

    def resolve_dead_letters(
        self, subscription_id: str, action: str, selection: dict[str, Any], **options: Any
    ) -> dict[str, Any]:
        raise NotImplementedError

    def discard_pending(self, subscription_id: str, **options: Any) -> dict[str, Any]:
        raise NotImplementedError


# The user and password of a URL (an endpoint_url written with them, e.g. a proxy's), up to the
# host's last "@".
_URL_CREDENTIALS = re.compile(r"(\b[a-z][a-z0-9+.-]*://)[^/\s]+@", re.IGNORECASE)


def without_url_credentials(value: Any) -> Any:
    """``value`` (text, or a configuration: JSON) with the user and password of every URL in
    its strings replaced by ``***``: what errors and the admin show of a transport's
    configuration."""
    if isinstance(value, str):
        return _URL_CREDENTIALS.sub(r"\1***@", value)
    if isinstance(value, list):
        return [without_url_credentials(item) for item in value]
    if isinstance(value, dict):
        return {key: without_url_credentials(item) for key, item in value.items()}
    return value
