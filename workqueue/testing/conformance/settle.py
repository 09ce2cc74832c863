"""Settle cases: each subscription settles its own copy, and dead letters are listed (C02, C10)."""

from __future__ import annotations

from workqueue.testing.conformance.harness import CaseContext, expect_equal, expect_settled, numbers
from workqueue.testing.conformance.registry import CASES


@CASES.case("C02", "each subscription settles its own delivery independently of the others")
def independent_settle(ctx: CaseContext) -> None:
    ctx.subscribe("a")
    ctx.subscribe("b")
    sent = ctx.publish()
    on_a = ctx.receive_one("a")
    on_b = ctx.receive_one("b")

    completed = ctx.receiver("a").complete(on_a)
    dead = ctx.receiver("b").dead_letter(on_b, "Poison", error="cannot parse")

    expect_settled(completed, "Completed", "complete on 'a'")
    expect_settled(dead, "DeadLettered", "dead-letter on 'b'")
    ctx.expect_nothing_receivable("a", "after completing on 'a'")
    expect_equal(ctx.dead_letters("a"), [], "dead letters of 'a'")
    expect_equal(
        [(d.message_id, d.reason) for d in ctx.dead_letters("b")],
        [(sent.message_id, "Poison")],
        "dead letters of 'b'",
    )


@CASES.case("C10", "a dead letter is listed with its reason and message and never redelivered")
def dead_letter_listed(ctx: CaseContext) -> None:
    ctx.subscribe("a", lease_seconds=5)
    ctx.publish()
    sent = ctx.publish()
    received = sorted(ctx.receive("a"), key=lambda d: numbers([d]))
    expect_equal(numbers(received), [1, 2], "messages received")
    first, second = received
    expect_settled(ctx.receiver("a").complete(first), "Completed", "complete result")

    expect_settled(
        ctx.receiver("a").dead_letter(second, "BadInput", error="field x missing"),
        "DeadLettered",
        "dead letter result",
    )

    letters = ctx.dead_letters("a")
    expect_equal(
        [(d.delivery_id, d.message_id, d.reason, d.last_error) for d in letters],
        [(second.delivery_id, sent.message_id, "BadInput", "field x missing")],
        "dead letters listed (delivery, message, reason, error)",
    )
    ctx.expect_nothing_receivable("a", "after dead-lettering")
    ctx.advance_time(6)
    ctx.expect_nothing_receivable("a", "after the old lease's expiry time")
