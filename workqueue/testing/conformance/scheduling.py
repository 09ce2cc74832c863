"""Scheduled and prioritised delivery (C33-C40, C43, C44). Time passes through ``advance_time``."""

from __future__ import annotations

import datetime as dt

from workqueue.testing.conformance.harness import CaseContext, expect_equal, expect_settled, numbers
from workqueue.testing.conformance.registry import CASES

HOUR = 3600
SCHEDULED = ("supports_scheduled_publish",)
PRIORITISED = ("supports_priority",)


@CASES.case(
    "C33",
    "A delayed message is not received before it is due, and is received once it is",
    requires=SCHEDULED,
)
def delayed_until_due(ctx: CaseContext) -> None:
    ctx.subscribe("a")
    expect_equal(ctx.publish(delay_seconds=HOUR).status, "Accepted", "delayed publish status")
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=2)
    expect_equal(ctx.publish(not_before=later).status, "Accepted", "not_before publish status")

    ctx.expect_nothing_receivable("a", "before either message is due")
    ctx.advance_time(HOUR)
    first = ctx.receive_one("a")
    expect_equal(numbers([first]), [1], "received once the delay has passed")
    expect_settled(ctx.receiver("a").complete(first), "Completed", "complete result")
    ctx.advance_time(HOUR)
    expect_equal(numbers(ctx.receive("a")), [2], "received once not_before has passed")


@CASES.case(
    "C34",
    "Ordered: a head not yet due holds its key; publish order wins over due time",
    requires=("supports_ordered", *SCHEDULED),
)
def ordered_scheduled_head_holds_key(ctx: CaseContext) -> None:
    ctx.subscribe("a", partition_mode="Ordered")
    ctx.publish(key="k")
    ctx.publish(key="k", delay_seconds=HOUR)
    ctx.publish(key="k")

    first = ctx.receive_one("a")
    expect_equal(numbers([first]), [1], "the key's first message")
    expect_settled(ctx.receiver("a").complete(first), "Completed", "complete result")
    ctx.expect_nothing_receivable("a", "while the key's next message is not yet due")

    ctx.advance_time(HOUR)
    second = ctx.receive_one("a")
    expect_equal(numbers([second]), [2], "the scheduled message, once due, before the third")
    expect_settled(ctx.receiver("a").complete(second), "Completed", "complete result")
    expect_equal(numbers(ctx.receive("a")), [3], "the third message last")


@CASES.case(
    "C35",
    "Exclusive: a message not yet due is skipped; the key's next due message is received",
    requires=SCHEDULED,
)
def exclusive_skips_scheduled(ctx: CaseContext) -> None:
    ctx.subscribe("a", partition_mode="Exclusive")
    ctx.publish(key="k", delay_seconds=HOUR)
    ctx.publish(key="k")

    due = ctx.receive_one("a")
    expect_equal(numbers([due]), [2], "the due message, past the scheduled one")
    expect_settled(ctx.receiver("a").complete(due), "Completed", "complete result")
    ctx.expect_nothing_receivable("a", "while the key's other message is not yet due")
    ctx.advance_time(HOUR)
    expect_equal(numbers(ctx.receive("a")), [1], "the scheduled message once due")


@CASES.case(
    "C36",
    "Backlog counts only deliveries that are due",
    requires=SCHEDULED,
)
def backlog_counts_due_only(ctx: CaseContext) -> None:
    ctx.subscribe("a")
    ctx.subscribe("b", partition_mode="Exclusive")
    ctx.publish(key="k1")
    ctx.publish(key="k2", delay_seconds=HOUR)
    ctx.publish(delay_seconds=HOUR)

    for name in ("a", "b"):
        backlog = ctx.backlog(name)
        expect_equal(
            (backlog.claimable, backlog.in_flight) if backlog else None,
            (1, 0),
            f"backlog of {name!r} with one due and two scheduled messages",
        )


@CASES.case(
    "C37",
    "A due time beyond the topic's retention, or both not_before and delay, is InvalidSchedule",
    requires=SCHEDULED,
)
def schedule_bounds(ctx: CaseContext) -> None:
    ctx.subscribe("a")
    retention = ctx.update_topic(retention_days=1).retention_days * 86400
    far = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=retention + HOUR)
    soon = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=60)
    for label, schedule in [
        ("delay past retention", {"delay_seconds": retention + 60}),
        ("not_before past retention", {"not_before": far}),
        ("both not_before and delay", {"not_before": soon, "delay_seconds": 60}),
    ]:
        result = ctx.publish(**schedule)
        expect_equal(
            (result.status, result.error.code if result.error else None),
            ("Rejected", "InvalidSchedule"),
            label,
        )
    expect_equal(
        ctx.publish(delay_seconds=retention - 60).status, "Accepted", "a delay within retention"
    )
    ctx.expect_nothing_receivable("a", "after rejected schedules and one accepted for later")


@CASES.case(
    "C38",
    "Higher priority is received first among due deliveries; equal priority oldest first",
    requires=PRIORITISED,
)
def keyless_priority_order(ctx: CaseContext) -> None:
    ctx.subscribe("a")
    for priority in (0, 10, -5, 10, 100, -100):
        ctx.publish(priority=priority)
    ctx.publish(priority=100, delay_seconds=HOUR)

    expect_equal(numbers(ctx.receive("a", max=2)), [5, 2], "the first claim of two")
    expect_equal(numbers(ctx.receive("a")), [4, 1, 3, 6], "the rest, by priority")


@CASES.case(
    "C39",
    "Exclusive: the key holding higher-priority work is received first",
    requires=PRIORITISED,
)
def exclusive_priority_between_keys(ctx: CaseContext) -> None:
    ctx.subscribe("a", partition_mode="Exclusive")
    ctx.publish(key="low")
    ctx.publish(key="high", priority=50)
    ctx.publish(key="mid", priority=5)

    expect_equal(
        [d.partition_key for d in ctx.receive("a", max=1)], ["high"], "the first claim of one"
    )
    expect_equal([d.partition_key for d in ctx.receive("a", max=1)], ["mid"], "the next")


@CASES.case(
    "C40",
    "Ordered: a key keeps publish order whatever the priorities",
    requires=("supports_ordered", *PRIORITISED),
)
def ordered_ignores_priority_within_key(ctx: CaseContext) -> None:
    ctx.subscribe("a", partition_mode="Ordered")
    ctx.publish(key="k", priority=-100)
    ctx.publish(key="k", priority=100)

    first = ctx.receive_one("a")
    expect_equal(numbers([first]), [1], "the key's first message, whatever its priority")
    ctx.expect_nothing_receivable("a", "while the key's head is in flight")
    expect_settled(ctx.receiver("a").complete(first), "Completed", "complete result")
    expect_equal(numbers(ctx.receive("a")), [2], "the second message after the first")


@CASES.case(
    "C43",
    "Exclusive: keyless work of a higher priority is received before keyed work, and keyless "
    "work of a lower priority after it",
    requires=PRIORITISED,
)
def exclusive_priority_across_keyed_and_keyless(ctx: CaseContext) -> None:
    ctx.subscribe("a", partition_mode="Exclusive")
    ctx.publish(key="k1")
    ctx.publish(priority=50)
    ctx.publish(key="k2")
    ctx.publish(priority=-5)

    expect_equal(numbers(ctx.receive("a", max=1)), [2], "the first claim of one")
    expect_equal(numbers(ctx.receive("a", max=2)), [1, 3], "the keyed work next")
    expect_equal(numbers(ctx.receive("a")), [4], "the lower-priority keyless work last")


@CASES.case(
    "C44",
    "Exclusive: within one priority, keyed and keyless work is received oldest due first",
    requires=PRIORITISED,
)
def exclusive_oldest_first_across_keyed_and_keyless(ctx: CaseContext) -> None:
    ctx.subscribe("a", partition_mode="Exclusive")
    ctx.publish()
    ctx.publish(key="k1")
    ctx.publish()
    ctx.publish(key="k2")
    ctx.publish(key="k3")
    ctx.publish()

    expect_equal(numbers(ctx.receive("a", max=2)), [1, 2], "the first claim of two")
    expect_equal(numbers(ctx.receive("a", max=3)), [3, 4, 5], "the next claim of three")
    expect_equal(numbers(ctx.receive("a")), [6], "the last")
