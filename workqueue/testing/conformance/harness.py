"""What every conformance case runs inside: its own topic, named subscriptions and helpers.

A case gets a fresh topic ``wqconf.<case>-<8 hex>`` so cases never see each other's messages
(and may run concurrently against one database). Whatever the case does, leaving the context
removes the topic with its subscriptions, messages, deliveries and ledger rows.

Checks raise :class:`ConformanceFailure` through the ``expect_*`` helpers rather than using
``assert``, so a run under ``python -O`` (or from ``manage.py``) still checks everything.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from django.conf import settings
from django.test.utils import override_settings

from workqueue.conf import get_settings
from workqueue.driver import get_driver
from workqueue.driver.base import Row
from workqueue.models import Subscription, Topic, Transport
from workqueue.models.topology import DATABASE_DRIVER
from workqueue.publishing import publish
from workqueue.transports import TransportReceiver, transport_class
from workqueue.types import (
    Backlog,
    ClaimedDelivery,
    ClaimResult,
    DeadLetterItem,
    DiscardResult,
    PartitionItem,
    PublishResult,
    SettleResult,
)

TOPIC_PREFIX = "wqconf."
OPERATOR = "conformance"


class ConformanceFailure(AssertionError):
    """A transport did not behave as a conformance case requires; the message says how."""


def expect_equal(actual: Any, expected: Any, what: str) -> None:
    """Fail unless ``actual == expected``, naming ``what`` was compared."""
    if actual != expected:
        raise ConformanceFailure(f"{what}: expected {expected!r}, got {actual!r}")


def expect_true(condition: bool, what: str, got: Any = None) -> None:
    """Fail unless ``condition`` holds; ``got`` (if given) is shown as the observed value."""
    if not condition:
        detail = f" (got {got!r})" if got is not None else ""
        raise ConformanceFailure(f"{what}{detail}")


def expect_settled(result: SettleResult, status: str, what: str) -> None:
    """Fail unless a settle call took effect and left the delivery in ``status``."""
    expect_equal((result.outcome, result.status), ("Settled", status), what)


@dataclass(frozen=True, slots=True)
class TransportTraits:
    """How the transport under test may legitimately differ; cases read these, never a name.

    The defaults describe the Database transport.
    """

    #: Release gives the attempt back (False) or counts it like any other (True).
    release_consumes_attempt: bool = False
    #: A lease that expires on the last attempt dead-letters with reason ``LeaseExpired``.
    expired_lease_dead_letters: bool = True
    supports_ordered: bool = True
    #: ``list_partitions`` can report an Ordered key blocked by its dead-lettered head.
    supports_list_partitions: bool = True
    #: An operator can discard a Pending delivery.
    cancel_pending: bool = True
    #: An operator can ask the holder of an InFlight delivery to stop.
    cancel_in_flight: bool = True
    #: Re-publishing a MessageID is recognised (Duplicate or MessageIDConflict).
    detects_message_id_duplicates: bool = True
    #: Subscription stats count completions of the last hour.
    completed_counts: bool = True
    #: A publish can be scheduled (``not_before``/``delay_seconds``) up to the topic's retention.
    supports_scheduled_publish: bool = True
    #: Among due deliveries of a subscription, higher ``priority`` is received first.
    supports_priority: bool = True
    #: ``deduplication_key`` on publish is honoured.
    supports_deduplication: bool = True
    #: A holder whose lease ran out may still renew and settle until another holder (or the
    #: sweeper) takes the delivery back: the token fences, not the clock.
    settles_after_expiry_until_taken_back: bool = True
    #: A claim says how long its lease is (``ClaimedDelivery.lease_seconds``); a transport
    #: that leaves it None has its holders time renewals by their own plan's lease.
    reports_lease_seconds: bool = True
    #: The case topics are FIFO topics (``is_fifo``), which Exclusive needs on this transport.
    fifo_topics: bool = False
    #: The harness can move the transport's clock (``advance_time`` shifts stored times);
    #: without it, ``advance_time`` waits that long for real.
    shifts_time: bool = True
    #: Claims are calls of the queue's stored procedure ``wq_claim``, which the harness can
    #: make itself and drop the answer of, as a lost connection does (C45).
    claims_through_procedures: bool = True
    #: The registered transport (``Transport.driver_class``) the cases run on; the case's
    #: topic is bound to the Transport row of the same name.
    transport: str = DATABASE_DRIVER
    #: ``Transport.configuration`` of that row when the harness creates it (a cloud
    #: transport's region and endpoint).
    transport_configuration: dict[str, Any] | None = None

    @classmethod
    def of_transport(
        cls, driver_class: str, configuration: dict[str, Any] | None = None
    ) -> TransportTraits:
        """The traits a registered transport declares through its capability flags and its
        ``conformance_traits`` (the rest as on the Database transport), so each case runs
        where its capabilities are."""
        found = transport_class(driver_class)
        flags = {trait: getattr(found, flag) for trait, flag in TRAIT_CAPABILITIES.items()}
        return replace(
            cls(),
            transport=driver_class,
            transport_configuration=configuration,
            # Only a transport whose deliveries are the queue tables' rows claims through
            # wq_claim; any other would fail C45 on tables that hold none of its work.
            claims_through_procedures=found.keeps_deliveries_in_database,
            **flags,
            **found.conformance_traits,
        )


#: Which transport capability flag each trait follows (``TransportTraits.of_transport``).
TRAIT_CAPABILITIES = {
    "supports_ordered": "supports_ordered",
    "supports_list_partitions": "supports_partition_listing",
    "cancel_in_flight": "supports_cancel",
    "supports_scheduled_publish": "supports_scheduled_publish",
    "supports_priority": "supports_priority",
    "supports_deduplication": "supports_deduplication",
}


DATABASE_TRAITS = TransportTraits()


class ProcedureClaim(NamedTuple):
    """What one ``wq_claim`` call answered (``CaseContext.claim_by_procedure``)."""

    claimed: list[Row]
    #: How many of ``claimed`` the named earlier claim handed back (None: it named none).
    retaken: int | None
    #: The lease length its 'Lease' row gives (None: it claimed nothing).
    lease_seconds: int | None


class CaseContext:
    """One case's topic, subscriptions, receivers and helpers, on database ``alias``.

    Create it with :func:`case_context`, which guarantees the cleanup.
    """

    def __init__(self, case_id: str, alias: str, traits: TransportTraits) -> None:
        self.case_id = case_id
        self.alias = alias
        self.traits = traits
        self.driver = get_driver(alias)
        self.topic_name = f"{TOPIC_PREFIX}{case_id.lower()}-{uuid.uuid4().hex[:8]}"
        self.topic: Topic | None = None
        self.subscriptions: dict[str, Subscription] = {}
        self.transport = transport_class(traits.transport)()
        self._receivers: dict[tuple[str, str], TransportReceiver] = {}
        #: The number given to the last published message (its ``n`` attribute).
        self.n = 0

    # -- topology --------------------------------------------------------------------------

    def create_topic(self) -> Topic:
        # The transport row is shared topology (the Database one is seeded by migration 0003);
        # it is only created when missing, e.g. after a test flush, and never removed by a case.
        row, _ = Transport.objects.using(self.alias).get_or_create(
            name=self.traits.transport,
            defaults={
                "driver_class": self.traits.transport,
                "configuration": self.traits.transport_configuration,
            },
        )
        self.topic = Topic(name=self.topic_name, transport=row, is_fifo=self.traits.fifo_topics)
        self.topic.save(using=self.alias)
        return self.topic

    def update_topic(self, **fields: Any) -> Topic:
        """Change model fields of the case's topic (validated), e.g. its deduplication default."""
        if self.topic is None:
            raise RuntimeError("the case's topic has not been created")
        for name, value in fields.items():
            setattr(self.topic, name, value)
        self.topic.save(using=self.alias)
        return self.topic

    @property
    def topic_id(self) -> str:
        if self.topic is None:
            raise RuntimeError("the case's topic has not been created")
        return str(self.topic.id)

    def subscribe(self, name: str, **options: Any) -> Subscription:
        """Create subscription ``<topic>.<name>`` with model field ``options`` (validated)."""
        if self.topic is None:
            raise RuntimeError("the case's topic has not been created")
        options.setdefault("handler_key", "conformance.noop")
        subscription = Subscription(topic=self.topic, name=f"{self.topic_name}.{name}", **options)
        # save() applies the model's rules on this alias and stores the filter in canonical form.
        subscription.save(using=self.alias)
        self.subscriptions[name] = subscription
        # A cloud transport's queue for it (the Database transport has nothing to provision).
        self.transport.provision(self.topic.transport, dry_run=False)
        return subscription

    def sub_id(self, name: str) -> str:
        return str(self.subscriptions[name].id)

    # -- publishing ------------------------------------------------------------------------

    def publish(
        self,
        *,
        key: str | None = None,
        attributes: Mapping[str, str] | None = None,
        payload: Any = None,
        message_id: str | None = None,
        numbered: bool = True,
        deduplication_key: str | None = None,
        deduplication_ttl: int | None = None,
        **schedule: Any,
    ) -> PublishResult:
        """Publish one message; unless ``numbered`` is False it gets the next ``n`` attribute.

        ``schedule`` passes ``not_before``, ``delay_seconds`` and ``priority`` on to publish.
        """
        merged = dict(attributes or {})
        if numbered:
            self.n += 1
            merged["n"] = str(self.n)
        return publish(
            self.topic_name,
            payload if payload is not None else {"case": self.case_id, "n": self.n},
            partition_key=key,
            attributes=merged or None,
            message_id=message_id,
            deduplication_key=deduplication_key,
            deduplication_ttl=deduplication_ttl,
            **schedule,
        )

    def keyed(self, count: int, key: str = "k") -> list[PublishResult]:
        """Publish ``count`` numbered messages on partition ``key``, each checked Accepted."""
        results = [self.publish(key=key) for _ in range(count)]
        for result in results:
            expect_equal(result.status, "Accepted", f"publish status of a message on key {key!r}")
        return results

    # -- consuming -------------------------------------------------------------------------

    def receiver(self, name: str, owner: str = "primary") -> TransportReceiver:
        """The receiver of subscription ``name`` for lease owner ``owner`` (one per pair)."""
        found = self._receivers.get((name, owner))
        if found is None:
            found = self.transport.receiver(self.sub_id(name), self._lease_owner(owner))
            self._receivers[(name, owner)] = found
        return found

    def _lease_owner(self, owner: str) -> str:
        return f"conformance:{self.case_id}:{owner}"

    def claim_by_procedure(
        self,
        name: str,
        max_rows: int,
        *,
        claim_id: uuid.UUID,
        retake_claim_id: uuid.UUID | None = None,
        owner: str = "primary",
    ) -> ProcedureClaim:
        """Call ``wq_claim`` for subscription ``name`` as ``owner``'s receiver would. A case
        drops the answer by not using it, as a lost connection drops it."""
        rows = self.driver.call(
            "wq_claim",
            {
                "subscription_id": self.sub_id(name),
                "lease_owner": self._lease_owner(owner),
                "max_rows": max_rows,
                "claim_id": claim_id,
                "retake_claim_id": retake_claim_id,
            },
        )
        counts = {r["kind"]: r["attempt_count"] for r in rows if r["kind"] in ("Retaken", "Lease")}
        return ProcedureClaim(
            [r for r in rows if r["kind"] == "Claimed"], counts.get("Retaken"), counts.get("Lease")
        )

    def complete_by_procedure(self, row: Row) -> int:
        """``wq_complete`` of a claimed row with the token it carries: rows changed (0 or 1)."""
        return self.driver.call_rowcount(
            "wq_complete", {"delivery_id": row["delivery_id"], "lease_token": row["lease_token"]}
        )

    def receive_result(self, name: str, max: int = 10, owner: str = "primary") -> ClaimResult:
        return self.receiver(name, owner).receive(max)

    def receive(self, name: str, max: int = 10, owner: str = "primary") -> list[ClaimedDelivery]:
        """Claim up to ``max`` deliveries of subscription ``name`` (expiring passed leases)."""
        return self.receive_result(name, max, owner).deliveries

    def receive_one(self, name: str, owner: str = "primary") -> ClaimedDelivery:
        """Claim and return exactly one delivery, failing if zero or several are receivable."""
        deliveries = self.receive(name, owner=owner)
        if len(deliveries) != 1:
            raise ConformanceFailure(
                f"deliveries received from {name!r}: expected exactly 1, got {len(deliveries)} "
                f"(n attributes {numbers(deliveries)})"
            )
        return deliveries[0]

    def expect_nothing_receivable(self, name: str, why: str) -> None:
        deliveries = self.receive(name)
        expect_equal(numbers(deliveries), [], f"deliveries received from {name!r} {why}")

    # -- time and operators ----------------------------------------------------------------

    def advance_time(self, seconds: int) -> None:
        """Move this topic's stored timestamps ``seconds`` into the past.

        Stands in for sleeping: leases, backoff and visibility are all compared with the
        database clock, so shifting the rows is the same as waiting that long.
        """
        if int(seconds) != seconds or seconds < 1:
            raise ValueError("advance_time takes a whole number of seconds, at least 1")
        if not self.traits.shifts_time:
            # A cloud queue keeps its own clock: the time passes for real.
            time.sleep(seconds)
            return
        self.driver.shift_time(int(seconds), topic_id=self.topic_id)

    def discard(self, name: str, delivery_id: str) -> DiscardResult:
        """Operator discard: Pending/dead-lettered rows are discarded, running ones cancelled."""
        return self.transport.discard(
            self.sub_id(name), delivery_id, OPERATOR, f"conformance {self.case_id} discard"
        )

    def replay(self, name: str, delivery_id: str) -> bool:
        """Operator replay of a dead letter; True when it changed the delivery."""
        return self.transport.replay(
            self.sub_id(name), delivery_id, OPERATOR, f"conformance {self.case_id} replay"
        )

    def partitions(self, name: str, condition: str | None) -> list[PartitionItem]:
        # The cases hold a handful of keys: one call walks them all.
        items, _resume_after = self.transport.list_partitions(
            self.sub_id(name), condition, None, 100
        )
        return items

    def dead_letters(self, name: str) -> list[DeadLetterItem]:
        return self.transport.list_dead_letters(self.sub_id(name), None, 100)

    def backlog(self, name: str) -> Backlog | None:
        """What an autoscaler sees: claimable (due) and in-flight deliveries."""
        return self.transport.backlog(self.sub_id(name))

    def stats(self, name: str) -> dict[str, Any]:
        found = self.transport.subscription_stats(self.sub_id(name))
        if found is None:
            raise ConformanceFailure(f"stats of subscription {name!r}: expected a row, got none")
        return found

    def cleanup(self) -> None:
        if self.topic is not None:
            self.driver.remove_topic(self.topic_id)


def numbers(deliveries: Iterable[ClaimedDelivery]) -> list[int]:
    """The ``n`` attributes of ``deliveries``, in order (-1 for a message without one)."""
    return [int(d.attributes.get("n", -1)) for d in deliveries]


@contextmanager
def case_context(
    case_id: str, alias: str = "default", traits: TransportTraits = DATABASE_TRAITS
) -> Iterator[CaseContext]:
    """Yield a :class:`CaseContext` with its topic created; remove everything on exit.

    The work queue's own calls (publish, receive, operators) use the configured
    ``WORKQUEUE["DATABASE_ALIAS"]``; for another ``alias`` that setting is overridden for the
    duration, so every call of the case reaches the same database.
    """
    with ExitStack() as stack:
        stack.enter_context(_work_queue_on(alias))
        context = CaseContext(case_id, alias, traits)
        stack.callback(context.cleanup)
        context.create_topic()
        yield context


@contextmanager
def _work_queue_on(alias: str) -> Iterator[None]:
    """Point the work queue's own calls at ``alias`` for the block (a no-op when they are)."""
    if alias == get_settings().DATABASE_ALIAS:
        yield
        return
    configured = dict(getattr(settings, "WORKQUEUE", {}) or {})
    with override_settings(WORKQUEUE={**configured, "DATABASE_ALIAS": alias}):
        effective = get_settings().DATABASE_ALIAS
        if effective != alias:
            raise RuntimeError(
                f"WORKQUEUE_DATABASE_ALIAS in the environment pins the work queue to "
                f"{effective!r}; unset it to run conformance on {alias!r}."
            )
        yield
