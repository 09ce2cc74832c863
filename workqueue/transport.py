"""The Database transport's Python face: typed wrappers over the ``wq_*`` procedures.

``Receiver`` is what a consumer holds for one subscription (receive, heartbeat, settle);
the module functions are the operator and sweeper primitives. Everything here is one procedure
call on the driver's own connection, so none of it rides the caller's transaction, except a
completion explicitly given the caller's connection (``context.complete(enlist=True)``).
"""

from __future__ import annotations

import math
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any

from django.db import connections, transaction

from workqueue.conf import MAX_CLAIM_ROWS, setting
from workqueue.driver import get_driver
from workqueue.driver.base import (
    BaseDriver,
    JsonText,
    QueueTableSize,
    SparseIndex,
    StalledListeners,
    VacuumHorizon,
    canonical_json,
    encode_json_string,
    routed_to_django_connection,
)
from workqueue.exceptions import (
    DeliveryBusyError,
    EnlistError,
    LockTimeoutError,
    PrivilegeRefusedError,
    TransientDriverError,
    WorkQueueError,
)
from workqueue.input_limits import within_units
from workqueue.payload_ref import stored_payload_ref
from workqueue.types import (
    Backlog,
    ClaimedDelivery,
    ClaimResult,
    DeadLetterItem,
    DeliveryStatus,
    DiscardResult,
    ExpiredDeadLetter,
    LeaseExtension,
    PartitionItem,
    PublishErrorCode,
    PublishStatus,
    RateTokens,
    SettleOutcome,
    SettleResult,
    fill_dead_letter_page,
)

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

    from workqueue.transports.base import TransportReceiver

EXPIRE_BATCH_SIZE = 500
BACKLOG_CAP = 1000
TRANSIENT_RETRIES = 3


def _driver() -> BaseDriver:
    return get_driver(setting("DATABASE_ALIAS"))


def new_instance_id() -> str:
    """An id naming this process as a lease owner: ``hostname:pid:8 hex``."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _settled(affected_rows: int, status: str) -> SettleResult:
    if affected_rows == 1:
        return SettleResult(SettleOutcome.SETTLED, status)
    return SettleResult(SettleOutcome.LEASE_LOST)


def _claimed(
    row: dict[str, Any], subscription_id: str, lease_seconds: int | None
) -> ClaimedDelivery:
    return ClaimedDelivery(
        delivery_id=row["delivery_id"],
        subscription_id=subscription_id,
        lease_token=row["lease_token"],
        lease_expires_at=row["lease_expires_at"],
        attempt=row["attempt_count"],
        is_replay=row["is_replay"],
        message_id=row["message_id"],
        topic_id=row["topic_id"],
        partition_key=row["partition_key"],
        attributes=row["attributes"] or {},
        payload=None,
        payload_json=row["payload"],
        payload_ref=stored_payload_ref(row["payload_ref"]),
        correlation_id=row["correlation_id"],
        published_at=row["published_at"],
        lease_seconds=lease_seconds,
    )


class Receiver:
    """Claims and settles deliveries of one subscription on behalf of ``lease_owner``."""

    def __init__(self, subscription_id: str | uuid.UUID, lease_owner: str | None = None) -> None:
        self.subscription_id = str(subscription_id).lower()
        self.lease_owner = lease_owner or new_instance_id()
        self.driver = _driver()
        # Where the last claim's walk over partition keys stopped (see wq_claim): the next claim
        # goes on from there, so every key gets its turn when a hot key clogs the oldest rows.
        self.key_cursor: str | None = None
        # The id of a claim that raised: it may have committed with its answer lost (a dropped
        # connection). The next claims name it, to be handed what it took (see wq_claim), until
        # one hands back less than it had room for.
        self._unanswered_claim: uuid.UUID | None = None
        self._unanswered_lock = threading.Lock()
        # The receiver this one replaced (carry_over_from), while a claim of its may still end:
        # one hung on a dead connection outlives its consumer's stop, and fails later.
        self._previous: Receiver | None = None

    @property
    def enlist_alias(self) -> str | None:
        """The database alias a handler's transaction must be on for
        ``context.complete(enlist=True)`` to settle the delivery inside it."""
        return self.driver.alias

    def close(self) -> None:
        """Close the calling thread's connection (a consumer thread's last act)."""
        self.driver.close()

    def carry_over_from(self, previous: TransportReceiver) -> None:
        """Name next what ``previous`` would have named (a claim whose answer was lost, now or
        when a claim of its still out fails), and go on with its walk over the partition keys;
        nothing from another transport's receiver."""
        if not isinstance(previous, Receiver):
            return
        previous._previous = None  # one step back: not a chain of every receiver since start
        self._previous = previous
        self.key_cursor = previous.key_cursor

    @property
    def owes_a_lost_claim(self) -> bool:
        """Whether a claim whose answer was lost (this receiver's, or one it carried over) may
        hold deliveries that the next claim would take back."""
        previous = self._previous
        return self._unanswered_claim is not None or (
            previous is not None and previous._unanswered_claim is not None
        )

    def _take_over_unanswered(self) -> None:
        """Move the previous receiver's lost claim here (taken, so named by one of us only),
        unless this one has one of its own to name first."""
        previous = self._previous
        if previous is None:
            return
        with self._unanswered_lock, previous._unanswered_lock:
            if self._unanswered_claim is None:
                self._unanswered_claim = previous._unanswered_claim
                previous._unanswered_claim = None

    def receive(self, max_rows: int) -> ClaimResult:
        """Lease up to ``max_rows`` deliveries in one round trip (none if paused or empty).

        Also reports deliveries whose expired lease was their last attempt, now dead-lettered.
        After a claim that raised, the next ones first take back what it may have claimed before
        its answer was lost: those deliveries, at the attempt they were claimed for. At most
        MAX_CLAIM_ROWS, which the procedure clamps to: asked for more, a full claim would read
        as a short one (drained, everything named handed back).
        """
        max_rows = min(max_rows, MAX_CLAIM_ROWS)
        claim_id = uuid.uuid4()
        self._take_over_unanswered()
        with self._unanswered_lock:
            retake_claim_id = self._unanswered_claim
        try:
            rows = self.driver.call(
                "wq_claim",
                {
                    "subscription_id": self.subscription_id,
                    "lease_owner": self.lease_owner,
                    "max_rows": max_rows,
                    "after_key": self.key_cursor,
                    "claim_id": claim_id,
                    "retake_claim_id": retake_claim_id,
                },
            )
        except BaseException:
            # Whatever the failure, the claim may have committed: naming a claim that never ran
            # finds nothing, at the cost of one read. Not a claim that named one itself: what it
            # handed back and failed to deliver is left to its leases (and so to max_attempts),
            # or an answer that can never be read (a value the driver cannot decode) would hand
            # the same deliveries back for ever at the same attempt. The earlier one stays named
            # (the failure may have come before the call reached the server).
            if retake_claim_id is None:
                with self._unanswered_lock:
                    if self._unanswered_claim is None:
                        self._unanswered_claim = claim_id
            raise
        walked = False
        lease_seconds = None
        for r in rows:
            if r["kind"] == "KeyCursor":
                self.key_cursor = r["partition_key"]
                walked = True
            elif r["kind"] == "Lease":
                lease_seconds = r["attempt_count"]  # how long the claimed rows' leases are
            elif r["kind"] == "Retaken" and r["attempt_count"] < max_rows:
                # Everything the named claim still held is handed back: not named again.
                with self._unanswered_lock:
                    if self._unanswered_claim == retake_claim_id:
                        self._unanswered_claim = None
        claimed = [
            _claimed(r, self.subscription_id, lease_seconds) for r in rows if r["kind"] == "Claimed"
        ]
        expired = [
            ExpiredDeadLetter(
                r["delivery_id"], self.subscription_id, r["partition_key"], "LeaseExpired"
            )
            for r in rows
            if r["kind"] == "ExpiredDeadLetter"
        ]
        # Short of max_rows, the claim saw every row it could take, unless it walked the
        # partition keys: a walk stops at its budget, and keys past it may still be free.
        return ClaimResult(claimed, expired, drained=len(claimed) < max_rows and not walked)

    def extend_lease(
        self, delivery: ClaimedDelivery, progress: dict[str, Any] | None = None
    ) -> LeaseExtension:
        row = self.driver.call_one(
            "wq_extend_lease",
            {
                "delivery_id": delivery.delivery_id,
                "lease_token": delivery.lease_token,
                "progress": progress,
            },
        )
        return LeaseExtension(row["lease_state"], row["lease_expires_at"])

    def take_rate_tokens(self, wanted: int) -> RateTokens:
        """Take up to ``wanted`` tokens of the subscription's shared rate-limit bucket."""
        row = self.driver.call_one(
            "wq_take_rate_tokens", {"subscription_id": self.subscription_id, "wanted": wanted}
        )
        return RateTokens(row["granted"], row["wait_ms"] / 1000, row["full_in_ms"] / 1000)

    def return_rate_tokens(self, unused: int, held_seconds: float, full_in_seconds: float) -> None:
        """Give back tokens a claim did not use (it found fewer deliveries than granted), taken
        ``held_seconds`` ago by a take that answered ``full_in_seconds``: what the bucket's
        refill since then would have made up counts against them."""
        self.driver.call_rowcount(
            "wq_return_rate_tokens",
            {
                "subscription_id": self.subscription_id,
                "unused": unused,
                "held_ms": math.ceil(max(held_seconds, 0.0) * 1000),
                "full_in_ms": math.floor(max(full_in_seconds, 0.0) * 1000),
            },
        )

    def complete(
        self,
        delivery: ClaimedDelivery,
        *,
        connection: BaseDatabaseWrapper | None = None,
        holding_key: bool = False,
    ) -> SettleResult:
        """Complete ``delivery`` (fenced by its lease token) on the driver's own connection, or,
        given the caller's ``connection``, inside the caller's open transaction: the completion
        then commits or rolls back with it, and the row stays locked until it does. With
        ``holding_key`` a keyed delivery keeps its lease, which keeps its partition key from
        being claimed until ``release_key`` (or the lease's end)."""
        procedure = "wq_complete_holding_key" if holding_key else "wq_complete"
        affected = self.driver.call_rowcount(procedure, _fence(delivery), connection=connection)
        return _settled(affected, DeliveryStatus.COMPLETED)

    def release_key(self, delivery: ClaimedDelivery) -> SettleResult:
        affected = self.driver.call_rowcount("wq_release_key", _fence(delivery))
        return _settled(affected, DeliveryStatus.COMPLETED)

    def complete_many(self, deliveries: Iterable[ClaimedDelivery]) -> dict[str, SettleResult]:
        """Complete several deliveries in one round trip; results keyed by delivery id."""
        items = [_fence(d) for d in deliveries]
        if not items:
            return {}
        rows = self.driver.call("wq_complete_many", {"items": items})
        done = {r["delivery_id"] for r in rows}
        return {
            item["delivery_id"]: _settled(
                int(item["delivery_id"] in done), DeliveryStatus.COMPLETED
            )
            for item in items
        }

    def retry(
        self, delivery: ClaimedDelivery, delay_seconds: int = 0, error: str | None = None
    ) -> SettleResult:
        params = {**_fence(delivery), "delay_seconds": max(int(delay_seconds), 0), "error": error}
        return _settled(self.driver.call_rowcount("wq_retry", params), DeliveryStatus.PENDING)

    def dead_letter(
        self, delivery: ClaimedDelivery, reason: str, error: str | None = None
    ) -> SettleResult:
        params = {**_fence(delivery), "reason": reason, "error": error}
        return _settled(
            self.driver.call_rowcount("wq_dead_letter", params), DeliveryStatus.DEAD_LETTERED
        )

    def release(self, delivery: ClaimedDelivery) -> SettleResult:
        return _settled(
            self.driver.call_rowcount("wq_release", _fence(delivery)), DeliveryStatus.PENDING
        )

    def max_attempts(self, planned: int) -> int:
        # Lease expiry (in the database) goes by the stored value, so a settle must too: raising
        # it is an outage's usual remedy, and a host went by the plan it read up to
        # RECONCILE_INTERVAL_MS before, dead-lettering work just given more attempts. Read
        # through the ORM (the topology is a Django model on any vendor); only on a last
        # attempt's failure, and the plan's word stands when the read fails.
        from workqueue.models import Subscription

        try:
            stored = (
                Subscription.objects.filter(pk=self.subscription_id)
                .values_list("max_attempts", flat=True)
                .first()
            )
        except Exception:
            return planned
        return stored or planned

    def acknowledge_cancel(self, delivery: ClaimedDelivery) -> SettleResult:
        return _settled(
            self.driver.call_rowcount("wq_acknowledge_cancel", _fence(delivery)),
            DeliveryStatus.DISCARDED,
        )

    def settles_go_through(self) -> bool:
        # Every way of settling, fenced by a delivery that does not exist: each procedure's
        # grant is checked and no row is touched. Asking one only, a refusal of another (a
        # grant missing for one procedure) read as over after every empty claim.
        nowhere = {"delivery_id": str(uuid.uuid4()), "lease_token": str(uuid.uuid4())}
        calls = (
            ("wq_complete_many", {"items": []}),
            ("wq_complete", nowhere),
            ("wq_retry", {**nowhere, "delay_seconds": 0, "error": None}),
            ("wq_dead_letter", {**nowhere, "reason": "MaxAttemptsExceeded", "error": None}),
            ("wq_release", nowhere),
            ("wq_acknowledge_cancel", nowhere),
        )
        try:
            for procedure, params in calls:
                self.driver.call(procedure, params)
        except PrivilegeRefusedError:
            return False
        return True

    def completed_at_its_attempt(self, delivery: ClaimedDelivery) -> bool:
        return self._stored_at_its_attempt(delivery, status=DeliveryStatus.COMPLETED)

    def dead_lettered_at_its_attempt(self, delivery: ClaimedDelivery, reason: str) -> bool:
        if reason == "LeaseExpired":
            return False  # lease expiry's own reason: the row could be its
        return self._stored_at_its_attempt(
            delivery,
            status=DeliveryStatus.DEAD_LETTERED,
            dead_letter_reason=within_units(reason, 100),  # as wq_dead_letter stores it
        )

    def cancel_requested(self, delivery: ClaimedDelivery) -> bool:
        # A read that renews nothing: a cancel announced (by anyone who may connect) or a
        # catch-up after the listener reconnected costs the holder no renewal unless an
        # operator did ask (then extend_lease confirms it against the lease token). On the
        # driver's connection for this thread, which its renewals keep open: through the ORM a
        # heartbeat thread opened (and closed) a connection for every check.
        return self.driver.cancel_requested(delivery.delivery_id)

    def _stored_at_its_attempt(self, delivery: ClaimedDelivery, **settled: Any) -> bool:
        return stored_at_attempt(
            self.driver.alias, delivery.delivery_id, delivery.attempt, **settled
        )


def stored_at_attempt(alias: str, delivery_id: str, attempt: int, **settled: Any) -> bool:
    """Whether delivery ``delivery_id`` is stored ``settled`` (its status, and so on) at the
    attempt its holder claimed: asked for a settle whose earlier call may have committed.

    While this holder's settle was in doubt its lease held, or expired without lowering the
    count (and expiry dead-letters as LeaseExpired only), and another holder's claim counts a
    new attempt. (Only a replay resets the count: a dead letter made by expiry, replayed and
    settled again, all within this holder's settle retries, could pass; the retries last the
    lease plus 5 s.) Read through the ORM (the runtime role may read the table), on the calling
    thread's connection for the alias, closed again if opened here: this is a rare path, and a
    settle thread keeps no idle connection for it (a handler's thread keeps the one its handler
    uses)."""
    from workqueue.models import Delivery

    connection = connections[alias]
    opened_here = connection.connection is None
    failed = True
    try:
        found = (
            Delivery.objects.using(alias)
            .filter(pk=delivery_id, attempt_count=attempt, **settled)
            .exists()
        )
        failed = False
        return found
    finally:
        # A connection that failed the read is not left for the thread's next handler.
        if (opened_here or failed) and not connection.in_atomic_block:
            connection.close()


def _fence(delivery: ClaimedDelivery) -> dict[str, str]:
    return {"delivery_id": delivery.delivery_id, "lease_token": delivery.lease_token}


# -- publishing --------------------------------------------------------------------------


def publishing_connection(alias: str) -> BaseDatabaseWrapper:
    """The connection an enlisted publish runs on: this thread's to ``alias``, in the
    transaction open there (an atomic block, or autocommit turned off), or, with no transaction
    open anywhere, in autocommit (it commits at once, as it always has: there is no rollback
    for it to outlive). ``EnlistError`` when a transaction is open on another alias only: run
    there, the publish committed at once and outlived that transaction's rollback."""
    connection = transaction.get_connection(alias)
    if connection.get_autocommit():  # off inside an atomic block too
        refuse_a_transaction_on_another_alias(alias, "publish(..., enlist=True)")
    return connection


def refuse_a_transaction_on_another_alias(alias: str, call: str) -> None:
    """``EnlistError`` for ``call`` when a transaction is open on an alias other than the work
    queue's ``alias``: it cannot join that one."""
    elsewhere = sorted(
        other.alias for other in connections.all(initialized_only=True) if other.in_atomic_block
    )
    if elsewhere:
        raise EnlistError(
            f"{call} found a transaction on database {', '.join(map(repr, elsewhere))}, but "
            f"the work queue uses {alias!r} (WORKQUEUE['DATABASE_ALIAS']): it cannot join that "
            f"transaction. Make your changes inside transaction.atomic(using={alias!r}) and "
            "call it there."
        )


def publish(
    topic: str,
    prepared: list[dict[str, Any]],
    publisher: str,
    alias: str,
    enlist: bool,
    external: bool,
    chosen_message_ids: frozenset[str] = frozenset(),
) -> list[dict[str, Any]]:
    """Hand validated messages (``publishing``'s parameters for each) to ``wq_publish`` or, for
    several, ``wq_publish_many``: one round trip, one row per message (message_id, status,
    error_code), retried whole on a transient failure unless it is enlisted.
    ``chosen_message_ids`` are the ids the publisher chose (the others were made for this
    call)."""
    driver = get_driver(alias)
    # Enlisted, it joins the caller's open transaction on the queue's alias; one open on another
    # alias only is refused (run beside it, the publish outlived its rollback).
    connection = publishing_connection(alias) if enlist else None
    procedure, params = publish_call(topic, prepared, publisher, external)
    for attempt in range(1, TRANSIENT_RETRIES + 2):
        try:
            rows = driver.publish(procedure, params, connection=connection)
            if attempt == 1:
                return rows
            return _stored_by_the_lost_attempt(driver, topic, rows, prepared, chosen_message_ids)
        except TransientDriverError as exc:
            # An enlisted publish shares the caller's transaction, which is now aborted: only
            # the caller can retry it. On our own connection the whole call simply re-runs.
            if enlist:
                raise
            if attempt > TRANSIENT_RETRIES:
                # Still busy after the retries: each message is rejected as retryable, saying
                # what the database last answered (to this server's own callers: an external
                # publisher is not told the database's address).
                rejected = {
                    "status": PublishStatus.REJECTED,
                    "error_code": PublishErrorCode.TRANSPORT_UNAVAILABLE,
                }
                if not external:
                    rejected["error_message"] = (
                        f"The database did not take the publish in {attempt} tries; the last "
                        f"answer: {str(exc).strip()}. Publish again."
                    )
                return [{"message_id": p["message_id"], **rejected} for p in prepared]
            time.sleep((20 * attempt + random.uniform(0, 80)) / 1000)
    raise AssertionError("unreachable")


def _stored_by_the_lost_attempt(
    driver: Any,
    topic: str,
    rows: list[dict[str, Any]],
    prepared: list[dict[str, Any]],
    chosen: frozenset[str],
) -> list[dict[str, Any]]:
    """The rows of a publish sent again after a transient failure, whose first sending may have
    committed with its answer lost: a message whose id was made for this call can only be a
    Duplicate of itself if that first sending stored it, so it is Accepted (and the publisher
    does not publish it again under a new id). An id the publisher chose may have been stored
    by an earlier publish of theirs, so its Duplicate stands."""
    stored = [
        index
        for index, (row, message) in enumerate(zip(rows, prepared, strict=True))
        if row["status"] == PublishStatus.DUPLICATE
        and row["message_id"] == message["message_id"]
        and message["message_id"] not in chosen
    ]
    if stored:
        # The lost sending's announcement went with its connection, and the Duplicate made no
        # deliveries to announce: announced now, so hosts need not wait for their next poll.
        with suppress(WorkQueueError):
            driver.call(
                "wq_announce",
                {"topic_name": topic, "message_ids": [rows[i]["message_id"] for i in stored]},
            )
    return [
        {**row, "status": PublishStatus.ACCEPTED} if index in stored else row
        for index, row in enumerate(rows)
    ]


def publish_call(
    topic: str, prepared: list[dict[str, Any]], publisher: str, external: bool
) -> tuple[str, dict[str, Any]]:
    """The procedure and its parameters that publish ``prepared``: ``wq_publish`` for one
    message, ``wq_publish_many`` for several."""
    common = {"topic_name": topic, "external": external, "published_by": publisher}
    if len(prepared) == 1:
        fields = dict(prepared[0])
        fields["payload"] = fields.pop("payload_json")
        return "wq_publish", {**common, **fields}
    messages = JsonText("[" + ",".join(map(_message_json, prepared)) + "]")
    return "wq_publish_many", {**common, "messages": messages}


def _message_json(message: dict[str, Any]) -> str:
    """One item of ``wq_publish_many``'s array: the message's fields with its payload's text
    spliced in as it was made (key order does not matter to the procedure). Fields left unset
    are left out, as both vendors' procedures read a missing field as null: a plain message's
    item is a third of the size, for this process to write and for the server to parse. The
    fields every message has are written directly (the id is canonical UUID text and the size
    a number, neither needing escapes): half the cost of encoding them as a dict."""
    optional = "".join(
        [
            f',"{name}":{_json_value(value)}'
            for name in _OPTIONAL_FIELDS
            if (value := message[name]) is not None
        ]
    )
    payload = message["payload_json"]
    return "".join(
        (
            f'{{"message_id":"{message["message_id"]}",',
            f'"envelope_bytes":{message["envelope_bytes"]:d}',
            optional,
            "}" if payload is None else f',"payload":{payload}}}',
        )
    )


def _json_value(value: Any) -> str:
    """``canonical_json(value)``, without the encoder's set-up for the plain numbers and texts
    most fields hold (``type`` rather than ``isinstance``: a bool is an int that JSON writes as
    true or false)."""
    if type(value) is int:
        return str(value)
    if type(value) is str:
        return encode_json_string(value)
    return canonical_json(value)


#: The fields _message_json writes when set. The others it writes itself (the id and the size,
#: which every message has; the payload as the text made when it was measured) or leaves out
#: (``payload``, the value that text was made from).
_OPTIONAL_FIELDS = (
    "partition_key",
    "attributes",
    "payload_ref",
    "correlation_id",
    "deduplication_key",
    "deduplication_ttl_seconds",
    "not_before",
    "delay_seconds",
    "priority",
)


def reserve_deduplication(topic: str, key: str, message_id: str) -> tuple[str, str | None]:
    """Reserve ``key`` on ``topic`` for ``message_id`` before another transport sends it:
    (Reserved | Duplicate | Pending | TopicNotFound, the owner's message id)."""
    row = _driver().call_one(
        "wq_reserve_deduplication",
        {"topic_name": topic, "deduplication_key": key, "message_id": message_id},
    )
    owner = row["owner_message_id"]
    return row["status"], None if owner is None else str(owner)


def confirm_deduplication(topic: str, key: str, message_id: str, ttl: int | None) -> bool:
    """The message was sent: hold ``key`` for ``ttl`` seconds (None: the topic's default).
    False when the reservation had lapsed and another publish took the key."""
    params = {
        "topic_name": topic,
        "deduplication_key": key,
        "message_id": message_id,
        "deduplication_ttl_seconds": ttl,
    }
    return _driver().call_rowcount("wq_confirm_deduplication", params) == 1


def release_deduplication(topic: str, key: str, message_id: str) -> bool:
    """Sending failed: free ``key`` at once (only ``message_id``'s own reservation)."""
    params = {"topic_name": topic, "deduplication_key": key, "message_id": message_id}
    return _driver().call_rowcount("wq_release_deduplication", params) == 1


# -- operator primitives -------------------------------------------------------------------


def subscription_stats(subscription_id: str, cap: int | None = None) -> dict[str, Any] | None:
    """A subscription's stats, each count made up to ``cap`` (None: the most, 1,000,000)."""
    rows = _driver().call("wq_subscription_stats", {"subscription_id": subscription_id, "cap": cap})
    return rows[0] if rows else None


def queue_gauges(subscription_id: str, cap: int) -> dict[str, Any] | None:
    """A subscription's counts for a metrics scrape, each counted up to ``cap``."""
    rows = _driver().call("wq_queue_gauges", {"subscription_id": subscription_id, "cap": cap})
    return rows[0] if rows else None


#: Dead letters read per call when their payloads come too: at most some 8 MB of payload text
#: (their stored text can be longer than the message was: jsonb writes a space after each
#: comma and colon).
DEAD_LETTERS_READ_WITH_PAYLOADS = 16


def list_dead_letters(
    subscription_id: str,
    after_delivery_id: str | None,
    page_size: int,
    *,
    with_payload: bool = True,
) -> list[DeadLetterItem]:
    """Up to ``page_size`` dead letters after ``after_delivery_id``. With payloads, read
    DEAD_LETTERS_READ_WITH_PAYLOADS at a time, ending at the one whose payload reaches the
    page's budget (DEAD_LETTER_PAGE_PAYLOAD_CHARS): what the web process holds stays a few
    megabytes whatever the page size asked."""
    items: list[DeadLetterItem] = []
    while True:
        asked = page_size - len(items)
        if with_payload:
            asked = min(asked, DEAD_LETTERS_READ_WITH_PAYLOADS)
        rows = _driver().call(
            "wq_list_dead_letters",
            {
                "subscription_id": subscription_id,
                "after_delivery_id": after_delivery_id,
                "page_size": asked,
                "with_payload": with_payload,
            },
        )
        full = fill_dead_letter_page(items, map(_dead_letter_item, rows), page_size)
        if full or len(rows) < asked:
            return items
        after_delivery_id = items[-1].delivery_id


def _dead_letter_item(row: dict[str, Any]) -> DeadLetterItem:
    return DeadLetterItem(
        delivery_id=row["delivery_id"],
        partition_key=row["partition_key"],
        attempts=row["attempt_count"],
        reason=row["dead_letter_reason"],
        last_error=row["last_error"],
        dead_lettered_at=row["dead_lettered_at"],
        blocks_key=row["blocks_key"],
        message_id=row["message_id"],
        topic=row["topic_name"],
        message_partition_key=row["message_partition_key"],
        attributes=row["attributes"] or {},
        payload_json=row["payload"],
        payload_ref=stored_payload_ref(row["payload_ref"]),
        correlation_id=row["correlation_id"],
        published_at=row["published_at"],
    )


def list_partitions(
    subscription_id: str, condition: str | None, after_partition_key: str | None, page_size: int
) -> tuple[list[PartitionItem], str | None]:
    """Up to ``page_size`` keys after ``after_partition_key``, and the key after which the next
    page goes on when the call's bounded walk stopped before the page was full (else None)."""
    rows = _driver().call(
        "wq_list_partitions",
        {
            "subscription_id": subscription_id,
            "condition": condition,
            "after_partition_key": after_partition_key,
            "page_size": page_size,
        },
    )
    items = [
        PartitionItem(r["partition_key"], r["condition"], r["head_delivery_id"], r["waiting_items"])
        for r in rows
        if r["kind"] == "Partition"
    ]
    resume_after = next((r["partition_key"] for r in rows if r["kind"] == "KeyCursor"), None)
    return items, resume_after


def replay(subscription_id: str, delivery_id: str, actor: str | None, note: str | None) -> bool:
    params = {
        "subscription_id": subscription_id,
        "delivery_id": delivery_id,
        "actor": actor,
        "note": note,
    }
    return _driver().call_rowcount("wq_replay", params) == 1


def resolve_dead_letters(
    subscription_id: str,
    action: str,
    selection: dict[str, Any],
    *,
    after_delivery_id: str | None,
    batch_size: int,
    dry_run: bool,
    actor: str | None,
    note: str | None,
) -> dict[str, Any]:
    """One bounded batch of a bulk replay or discard (``action`` Replay or Discard) of the dead
    letters matching ``selection`` (wq_resolve_dead_letters' filter parameters)."""
    params = {
        "subscription_id": subscription_id,
        "action": action,
        **selection,
        "after_delivery_id": after_delivery_id,
        "batch_size": batch_size,
        "dry_run": dry_run,
        "actor": actor,
        "note": note,
    }
    return _driver().call_one("wq_resolve_dead_letters", params)


def discard_pending(
    subscription_id: str,
    *,
    keyed: bool,
    selection: dict[str, Any],
    after: tuple[int, Any, str] | None,
    batch_size: int,
    dry_run: bool,
    actor: str | None,
    reason: str | None,
) -> dict[str, Any]:
    """One bounded batch of a bulk discard of Pending deliveries matching ``selection``
    (wq_discard_pending's filter parameters), along the keyed or the keyless claim index,
    resuming after ``after`` (priority, visible_at, delivery id): the claim index's order."""
    params = {
        "subscription_id": subscription_id,
        "keyed": keyed,
        **selection,
        "after_priority": after[0] if after else None,
        "after_visible_at": after[1] if after else None,
        "after_delivery_id": after[2] if after else None,
        "batch_size": batch_size,
        "dry_run": dry_run,
        "actor": actor,
        "reason": reason,
    }
    return _driver().call_one("wq_discard_pending", params)


def discard_or_cancel(
    subscription_id: str,
    delivery_id: str,
    actor: str | None,
    reason: str | None,
    *,
    allow_cancel: bool = True,
) -> DiscardResult:
    """Discard a Pending or dead-lettered delivery, or (``allow_cancel``) ask the holder of a
    running one to stop.

    The status can change between the two guarded statements (a Pending row claimed, a running
    one settled), so the pair is tried twice before reporting no change.
    """
    driver = _driver()
    params = {
        "subscription_id": subscription_id,
        "delivery_id": delivery_id,
        "actor": actor,
        "reason": reason,
    }
    try:
        for _ in range(2):
            if driver.call_rowcount("wq_discard", {**params, "allow_pending": True}) == 1:
                return DiscardResult(changed=True)
            if allow_cancel and driver.call_rowcount("wq_cancel", params) == 1:
                # Running InFlight, or completed in its handler's transaction (which runs on,
                # holding the key): it stays Completed whatever the handler does now.
                completed = _delivery_status(driver.alias, delivery_id) == DeliveryStatus.COMPLETED
                return DiscardResult(changed=True, cancel_requested=True, holds_key=completed)
    except LockTimeoutError as exc:
        raise DeliveryBusyError(
            f"Delivery {delivery_id} is held by an open transaction, most likely its handler "
            "completing it inside transaction.atomic(); nothing was changed. Try again in a "
            "moment: once that transaction ends the delivery is either settled or can be "
            "cancelled.",
            delivery_id,
        ) from exc
    asked = _cancel_pending(driver.alias, subscription_id, delivery_id) if allow_cancel else None
    if asked is not None:
        # Asked before (by another operator, or this one again as the handler ran on): not
        # "nothing to discard", which reads as finished while the delivery holds its key.
        return DiscardResult(
            changed=False, cancel_requested=True, holds_key=asked == DeliveryStatus.COMPLETED
        )
    return DiscardResult(changed=False)


def _cancel_pending(alias: str, subscription_id: str, delivery_id: str) -> str | None:
    """The status of the delivery if its handler runs on with a cancel already asked: InFlight,
    or Completed in its own transaction and holding its key. Read through the ORM: the
    operator role may read the table."""
    from workqueue.models import Delivery
    from workqueue.models.queue import HANDLER_RUNS

    return (
        Delivery.objects.using(alias)
        .filter(
            HANDLER_RUNS,
            pk=delivery_id,
            subscription_id=subscription_id,
            cancel_requested_at__isnull=False,
        )
        .values_list("status", flat=True)
        .first()
    )


def _delivery_status(alias: str, delivery_id: str) -> str | None:
    from workqueue.models import Delivery

    return (
        Delivery.objects.using(alias)
        .filter(pk=delivery_id)
        .values_list("status", flat=True)
        .first()
    )


def backlog(subscription_id: str, cap: int = BACKLOG_CAP) -> Backlog | None:
    rows = _driver().call("wq_backlog", {"subscription_id": subscription_id, "cap": cap})
    if not rows:
        return None
    claimable, in_flight = rows[0]["claimable"], rows[0]["in_flight"]
    return Backlog(claimable, in_flight, capped=claimable >= cap or in_flight >= cap)


def read_committed_snapshot_on() -> bool:
    return bool(_driver().call_one("wq_read_committed_snapshot_state")["snapshot_on"])


def sparse_queue_indexes() -> list[SparseIndex]:
    return _driver().sparse_queue_indexes()


def queue_table_sizes() -> list[QueueTableSize]:
    return _driver().queue_table_sizes()


def vacuum_horizon() -> VacuumHorizon:
    return _driver().vacuum_horizon()


#: How full the server's notification queue may get before the sweeper looks for sessions that
#: stopped reading it and the health checks warn: 1 % is about 80 MB, some 2.5 million
#: announcements no listener took, where listeners that read keep it near 0. Every publish
#: fails once it is full.
NOTIFICATION_QUEUE_WARNING_USAGE = 0.01


def notification_queue_usage() -> float | None:
    return _driver().notification_queue_usage()


def release_stalled_listeners(confirm_seconds: float) -> StalledListeners:
    return _driver().release_stalled_listeners(confirm_seconds)


def procedures_problem() -> str | None:
    """Why the procedures installed are not this release's, naming the fix, or None."""
    return _driver().procedures_problem()


def schema_problem() -> str | None:
    """Why roles other than the procedures' owner endanger it through their schema, or None."""
    return _driver().schema_problem()


# -- sweeper primitives --------------------------------------------------------------------


def expire_leases_all(batch_size: int = EXPIRE_BATCH_SIZE) -> list[dict[str, Any]]:
    """Expire passed leases across subscriptions; returns each changed row and its new status."""
    return _driver().call("wq_expire_leases_all", {"batch_size": batch_size})


def purge(step: str, batch_size: int) -> int:
    """Run one purge batch: ``terminal_deliveries``, ``orphan_messages`` or
    ``expired_deduplications``; returns the rows removed."""
    return _driver().call_rowcount(f"wq_purge_{step}", {"batch_size": batch_size})


def retire_discard(subscription_id: str, actor: str | None, reason: str, batch_size: int) -> int:
    """Discard up to ``batch_size`` Pending/dead-lettered deliveries of a Disabled
    subscription; returns how many."""
    params = {
        "subscription_id": subscription_id,
        "actor": actor,
        "reason": reason,
        "batch_size": batch_size,
    }
    return _driver().call_rowcount("wq_retire_discard", params)


def retire_purge(subscription_id: str, batch_size: int) -> int:
    """Delete up to ``batch_size`` Completed/Discarded deliveries of a Disabled subscription,
    whatever their age; returns how many."""
    params = {"subscription_id": subscription_id, "batch_size": batch_size}
    return _driver().call_rowcount("wq_retire_purge", params)


#: How often a held sweep lock's idle session is touched, so that the server's limit on idle
#: transactions (wq_try_sweep_lock sets ten minutes) ends only the session of a sweeper that
#: stopped running (frozen, or cut off), never a pass that is still working.
SWEEP_LOCK_KEEPALIVE_SECONDS = 30.0


@contextmanager
def sweep_lock() -> Iterator[bool]:
    """Hold the cluster-wide sweep lock for the block, on a connection of its own.

    Yields False (and holds nothing) when another sweeper is mid-pass. The lock is
    transaction-scoped, so a crashed sweeper can never leave it held, and a frozen one holds it
    until the server ends its idle session; a thread keeps the session of a working pass alive.
    """
    driver = get_driver(setting("DATABASE_ALIAS"))
    lock_driver = type(driver)(driver.alias)  # a separate connection from the pass's own work
    try:
        with lock_driver.transaction() as connection:
            row = lock_driver.call_one("wq_try_sweep_lock", connection=connection)
            if not row["acquired"]:
                yield False
                return
            if routed_to_django_connection(driver.alias):
                yield True  # test mode: the lock's transaction is a savepoint of the test's own
                return
            stop = threading.Event()

            def keep_alive() -> None:
                while not stop.wait(SWEEP_LOCK_KEEPALIVE_SECONDS):
                    try:
                        lock_driver.execute("SELECT 1", [], connection=connection)
                    except Exception:
                        return  # the session is gone: the pass's end reports it

            # Only the keeper uses the lock's connection until the block ends.
            connection.inc_thread_sharing()
            keeper = threading.Thread(target=keep_alive, name="wq-sweep-lock", daemon=True)
            keeper.start()
            try:
                yield True
            finally:
                stop.set()
                keeper.join()
                connection.dec_thread_sharing()
    finally:
        lock_driver.close()
