"""Partition cases: Exclusive single flight per key, Ordered heads, and cancelled heads
(C11-C17, C25-C28, C42, C47)."""

from __future__ import annotations

from workqueue.testing.conformance.harness import CaseContext, expect_equal, expect_settled, numbers
from workqueue.testing.conformance.registry import CASES
from workqueue.types import ClaimedDelivery

LEASE = 5


@CASES.case("C11", "Exclusive: a key runs one delivery at a time; the next follows completion")
def exclusive_one_in_flight(ctx: CaseContext) -> None:
    ctx.subscribe("a", partition_mode="Exclusive")
    ctx.keyed(2)

    first = ctx.receive_one("a")
    ctx.expect_nothing_receivable("a", "while the key's first delivery is in flight")
    expect_settled(ctx.receiver("a").complete(first), "Completed", "complete result")

    second = ctx.receive_one("a")
    expect_equal(sorted(numbers([first, second])), [1, 2], "messages received one after the other")


@CASES.case("C12", "Exclusive: deliveries of different keys are received together")
def exclusive_keys_in_parallel(ctx: CaseContext) -> None:
    ctx.subscribe("a", partition_mode="Exclusive")
    ctx.publish(key="k1")
    ctx.publish(key="k2")

    deliveries = ctx.receive("a")

    expect_equal(
        sorted(d.partition_key or "" for d in deliveries), ["k1", "k2"], "keys received at once"
    )


@CASES.case("C13", "Exclusive: a dead-lettered delivery does not block its key")
def exclusive_dead_letter_frees_key(ctx: CaseContext) -> None:
    ctx.subscribe("a", partition_mode="Exclusive")
    ctx.keyed(2)
    first = ctx.receive_one("a")

    expect_settled(
        ctx.receiver("a").dead_letter(first, "Poison"), "DeadLettered", "dead letter result"
    )

    second = ctx.receive_one("a")
    expect_equal(
        sorted(numbers([first, second])), [1, 2], "the key's other message follows the dead letter"
    )


@CASES.case(
    "C14",
    "Ordered: only a key's head is delivered; the next follows its completion",
    requires=("supports_ordered",),
)
def ordered_head_only(ctx: CaseContext) -> None:
    ctx.subscribe("a", partition_mode="Ordered")
    ctx.keyed(3)

    for expected in (1, 2, 3):
        head = ctx.receive_one("a")
        expect_equal(numbers([head]), [expected], "message delivered as the key's head")
        ctx.expect_nothing_receivable("a", f"while message {expected} is in flight")
        expect_settled(ctx.receiver("a").complete(head), "Completed", "complete result")


@CASES.case(
    "C15",
    "Ordered: a head in retry backoff holds its key and returns first as attempt 2",
    requires=("supports_ordered",),
)
def ordered_retry_holds_key(ctx: CaseContext) -> None:
    ctx.subscribe("a", partition_mode="Ordered")
    ctx.keyed(2)
    head = ctx.receive_one("a")

    expect_settled(ctx.receiver("a").retry(head, delay_seconds=2), "Pending", "retry result")

    ctx.expect_nothing_receivable("a", "while the head waits out its backoff")
    ctx.advance_time(3)
    again = ctx.receive_one("a")
    expect_equal((numbers([again])[0], again.attempt), (1, 2), "head after backoff (n, attempt)")


@CASES.case(
    "C16",
    "Ordered: a dead-lettered head blocks its key until it is replayed and completed",
    requires=("supports_ordered",),
)
def ordered_dead_letter_blocks_until_replay(ctx: CaseContext) -> None:
    ctx.subscribe("a", partition_mode="Ordered")
    ctx.keyed(2)
    head = ctx.receive_one("a")
    expect_settled(
        ctx.receiver("a").dead_letter(head, "Poison"), "DeadLettered", "dead letter result"
    )

    ctx.expect_nothing_receivable("a", "while the dead-lettered head blocks the key")
    if ctx.traits.supports_list_partitions:
        blocked = ctx.partitions("a", "Blocked")
        expect_equal(
            [(p.partition_key, p.head_delivery_id) for p in blocked],
            [("k", head.delivery_id)],
            "keys listed as Blocked (key, head delivery)",
        )

    replayed = ctx.replay("a", head.delivery_id)

    expect_equal(replayed, True, "replay of the dead-lettered head changed it")
    again = ctx.receive_one("a")
    expect_equal(
        (numbers([again])[0], again.is_replay, again.attempt),
        (1, True, 1),
        "replayed head (n, is_replay, attempt)",
    )
    expect_settled(ctx.receiver("a").complete(again), "Completed", "complete result")
    expect_equal(numbers([ctx.receive_one("a")]), [2], "message after the replayed head")


@CASES.case(
    "C17",
    "Ordered: discarding a dead-lettered head unblocks its key",
    requires=("supports_ordered",),
)
def ordered_discard_unblocks(ctx: CaseContext) -> None:
    ctx.subscribe("a", partition_mode="Ordered")
    ctx.keyed(2)
    head = ctx.receive_one("a")
    expect_settled(
        ctx.receiver("a").dead_letter(head, "Poison"), "DeadLettered", "dead letter result"
    )

    result = ctx.discard("a", head.delivery_id)

    expect_equal(
        (result.changed, result.cancel_requested), (True, False), "discard (changed, cancel)"
    )
    expect_equal(numbers([ctx.receive_one("a")]), [2], "message after the discarded head")


@CASES.case(
    "C25",
    "Exclusive: a cancelled head keeps its key busy until its holder acknowledges",
    requires=("cancel_in_flight",),
)
def exclusive_cancel_frees_key_on_acknowledge(ctx: CaseContext) -> None:
    ctx.subscribe("a", partition_mode="Exclusive")
    ctx.keyed(2)
    head = ctx.receive_one("a")

    result = ctx.discard("a", head.delivery_id)

    expect_equal(result.cancel_requested, True, "discard of a running head requests a cancel")
    ctx.expect_nothing_receivable("a", "before the holder acknowledges the cancel")
    acknowledged = ctx.receiver("a").acknowledge_cancel(head)
    expect_equal(acknowledged.status, "Discarded", "status after acknowledging the cancel")
    second = ctx.receive_one("a")
    expect_equal(
        sorted(numbers([head, second])), [1, 2], "the key's other message follows the cancel"
    )


def _cancelled_head_of_two(ctx: CaseContext) -> ClaimedDelivery:
    """An Exclusive subscription "a" (lease LEASE) with two messages of one key: the head,
    claimed, then cancelled by an operator."""
    ctx.subscribe("a", partition_mode="Exclusive", lease_seconds=LEASE)
    ctx.keyed(2)
    head = ctx.receive_one("a")
    expect_equal(ctx.discard("a", head.delivery_id).cancel_requested, True, "cancel requested")
    return head


@CASES.case(
    "C26",
    "Exclusive: an unacknowledged cancelled head is discarded at lease expiry, never retried",
    requires=("cancel_in_flight",),
)
def exclusive_cancel_discarded_on_expiry(ctx: CaseContext) -> None:
    head = _cancelled_head_of_two(ctx)
    ctx.expect_nothing_receivable("a", "while the cancelled head's lease runs")

    ctx.advance_time(LEASE + 1)

    second = ctx.receive_one("a", owner="second")
    expect_equal(
        sorted(numbers([head, second])), [1, 2], "the key's other message after the expiry"
    )
    stats = ctx.stats("a")
    expect_equal(
        (stats["pending"], stats["in_flight"], stats["dead_lettered"]),
        (0, 1, 0),
        "stats (pending, in flight, dead-lettered): the cancelled head was not retried",
    )


@CASES.case(
    "C42",
    "Exclusive: a cancelled head's holder renews its lease, and keeps its key, until it "
    "acknowledges",
    requires=("cancel_in_flight",),
)
def exclusive_cancel_renewed_until_acknowledged(ctx: CaseContext) -> None:
    # A handler that has not yet heard its cancel, or ignores it, is still running: the key's
    # next message must not start beside it however long that takes.
    head = _cancelled_head_of_two(ctx)
    receiver = ctx.receiver("a")

    for renewal in (1, 2):  # two renewals a lease apart: past the lease the claim gave
        ctx.advance_time(LEASE - 1)
        extension = receiver.extend_lease(head)
        expect_equal(extension.state, "Cancelled", f"renewal {renewal} after the cancel")
        expect_equal(
            extension.lease_expires_at is not None, True, f"renewal {renewal} renews the lease"
        )

    ctx.expect_nothing_receivable("a", "past the first lease while the holder renews")
    expect_settled(receiver.acknowledge_cancel(head), "Discarded", "acknowledging the cancel")
    second = ctx.receive_one("a", owner="second")
    expect_equal(
        sorted(numbers([head, second])), [1, 2], "the key's other message after the acknowledgement"
    )


# More rows of one key than a claim's window of oldest rows (4 x max rows + 32 for a claim of 2):
# with that key blocked, the window holds nothing claimable and the claim must walk the keys.
HOT_BACKLOG = 45


@CASES.case("C27", "Exclusive: a busy key's backlog filling the oldest rows hides no other key")
def exclusive_hot_key_hides_nothing(ctx: CaseContext) -> None:
    ctx.subscribe("a", partition_mode="Exclusive")
    ctx.keyed(HOT_BACKLOG, key="hot")
    hot = ctx.receive("a", max=1)
    expect_equal([d.partition_key for d in hot], ["hot"], "the hot key's first delivery")
    for key in ("x1", "x2", "x3"):
        ctx.publish(key=key)

    first = ctx.receive("a", max=2)
    second = ctx.receive("a", max=2)

    expect_equal(
        sorted(d.partition_key or "" for d in first + second),
        ["x1", "x2", "x3"],
        "keys received past the busy key's backlog",
    )
    ctx.expect_nothing_receivable("a", "while every key is in flight")


@CASES.case(
    "C28",
    "Ordered: a dead-lettered head with a long backlog blocks only its own key",
    requires=("supports_ordered",),
)
def ordered_blocked_hot_key_hides_nothing(ctx: CaseContext) -> None:
    ctx.subscribe("a", partition_mode="Ordered")
    ctx.keyed(HOT_BACKLOG, key="hot")
    head = ctx.receive_one("a")
    expect_settled(
        ctx.receiver("a").dead_letter(head, "Poison"), "DeadLettered", "dead letter result"
    )
    for key in ("x1", "x2"):
        ctx.publish(key=key)
        ctx.publish(key=key)

    received = ctx.receive("a", max=2)

    expect_equal(
        sorted(zip([d.partition_key for d in received], numbers(received), strict=True)),
        [("x1", HOT_BACKLOG + 1), ("x2", HOT_BACKLOG + 3)],
        "each other key's head, received past the blocked backlog",
    )


@CASES.case(
    "C47",
    "a completion in the holder's own transaction holds its key until let go, or until its "
    "lease ends",
    requires=("claims_through_procedures", "supports_ordered"),
)
def completion_holding_its_key(ctx: CaseContext) -> None:
    # A handler that completes in its transaction runs on after the commit: its key's next
    # delivery must not start beside it (review helper-193).
    from django.db import transaction

    for name, mode in (("a", "Exclusive"), ("b", "Ordered")):
        ctx.subscribe(name, partition_mode=mode, lease_seconds=LEASE)
    ctx.keyed(3)
    for name in ("a", "b"):
        receiver = ctx.receiver(name)
        for let_go in (True, False):
            held = ctx.receive_one(name)
            with transaction.atomic(using=ctx.alias):
                settled = receiver.complete(
                    held, connection=transaction.get_connection(ctx.alias), holding_key=True
                )
            expect_settled(settled, "Completed", f"{name}: completion holding the key")
            ctx.expect_nothing_receivable(name, "while a completed delivery holds its key")
            if let_go:
                expect_settled(receiver.release_key(held), "Completed", f"{name}: letting go")
            else:
                ctx.advance_time(LEASE + 1)  # its holder died: the lease ends instead
        expect_equal(numbers([ctx.receive_one(name)]), [3], f"{name}: the key's third message")
