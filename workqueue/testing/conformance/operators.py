"""Operator cases: discarding waiting work, cancelling running work and stats (C18, C23, C24)."""

from __future__ import annotations

from workqueue.testing.conformance.harness import CaseContext, expect_equal, expect_settled
from workqueue.testing.conformance.registry import CASES

LEASE = 5


@CASES.case(
    "C18",
    "an operator can discard a waiting (released) delivery, which then never runs",
    requires=("cancel_pending",),
)
def discard_pending(ctx: CaseContext) -> None:
    ctx.subscribe("a")
    ctx.publish()
    delivery = ctx.receive_one("a")
    released = ctx.receiver("a").release(delivery)
    expect_settled(released, "Pending", "release result")

    result = ctx.discard("a", delivery.delivery_id)

    expect_equal(
        (result.changed, result.cancel_requested), (True, False), "discard (changed, cancel)"
    )
    ctx.expect_nothing_receivable("a", "after the discard")


@CASES.case(
    "C23",
    "stats count waiting, running and recently completed deliveries",
    requires=("completed_counts",),
)
def stats_count_completed(ctx: CaseContext) -> None:
    ctx.subscribe("a")
    ctx.publish()
    ctx.publish()

    done = ctx.receive("a", max=1)
    expect_equal(len(done), 1, "deliveries received with max=1")
    expect_settled(ctx.receiver("a").complete(done[0]), "Completed", "complete result")

    stats = ctx.stats("a")
    expect_equal(
        (stats["pending"], stats["in_flight"], stats["completed_last_hour"]),
        (1, 0, 1),
        "stats (pending, in flight, completed in the last hour)",
    )


@CASES.case(
    "C24",
    "cancelling a running delivery stops every settle but the holder's acknowledgement",
    requires=("cancel_in_flight",),
)
def cancel_in_flight(ctx: CaseContext) -> None:
    ctx.subscribe("a", lease_seconds=LEASE)
    ctx.publish()
    delivery = ctx.receive_one("a")
    receiver = ctx.receiver("a")
    # Acknowledging is only for cancelled deliveries; this one is still running normally.
    expect_equal(
        receiver.acknowledge_cancel(delivery).outcome, "LeaseLost", "acknowledge before a cancel"
    )

    result = ctx.discard("a", delivery.delivery_id)

    expect_equal(
        (result.changed, result.cancel_requested), (True, True), "discard (changed, cancel)"
    )
    expect_equal(receiver.extend_lease(delivery).state, "Cancelled", "heartbeat after cancel")
    expect_equal(receiver.complete(delivery).outcome, "LeaseLost", "complete after cancel")
    # The host completes in batches: the same fence holds there.
    expect_equal(
        receiver.complete_many([delivery])[delivery.delivery_id].outcome,
        "LeaseLost",
        "batched complete after cancel",
    )
    expect_equal(receiver.retry(delivery, 0).outcome, "LeaseLost", "retry after cancel")
    # The digest names complete and retry; the same fence stops the other two settles.
    expect_equal(
        receiver.dead_letter(delivery, "X").outcome, "LeaseLost", "dead-letter after cancel"
    )
    expect_equal(receiver.release(delivery).outcome, "LeaseLost", "release after cancel")
    acknowledged = receiver.acknowledge_cancel(delivery)
    expect_settled(acknowledged, "Discarded", "first acknowledgement of the cancel")
    expect_equal(
        receiver.acknowledge_cancel(delivery).outcome, "LeaseLost", "second acknowledgement"
    )

    ctx.advance_time(LEASE + 1)
    ctx.expect_nothing_receivable("a", "after the cancelled delivery's lease time")
    stats = ctx.stats("a")
    expect_equal(
        (stats["pending"], stats["in_flight"], stats["dead_lettered"]),
        (0, 0, 0),
        "stats (pending, in flight, dead-lettered) after the cancel",
    )
