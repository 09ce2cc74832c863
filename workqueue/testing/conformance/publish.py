"""Publishing cases: fan-out, attribute filters, MessageID idempotency and deduplication windows
(C01, C03, C19, C20, C31, C32). Time passes through ``advance_time``, never a sleep."""

from __future__ import annotations

import uuid

from workqueue.testing.conformance.harness import CaseContext, expect_equal, expect_true, numbers
from workqueue.testing.conformance.registry import CASES


@CASES.case("C01", "one publish is delivered to every subscription of the topic")
def fan_out(ctx: CaseContext) -> None:
    ctx.subscribe("a")
    ctx.subscribe("b")

    result = ctx.publish()

    expect_equal(result.status, "Accepted", "publish status")
    for name in ("a", "b"):
        delivery = ctx.receive_one(name)
        expect_equal(delivery.message_id, result.message_id, f"message id delivered to {name!r}")
        expect_equal(delivery.attempt, 1, f"first attempt number on {name!r}")


@CASES.case("C03", "an attribute filter lets through only the messages it matches")
def attribute_filter(ctx: CaseContext) -> None:
    ctx.subscribe(
        "clicks",
        filter={
            "logic": "and",
            "filters": [{"field": "eventType", "operator": "eq", "value": "click"}],
        },
    )

    ctx.publish(attributes={"eventType": "view"})
    click = ctx.publish(attributes={"eventType": "click"})
    ctx.publish()  # no eventType at all

    deliveries = ctx.receive("clicks")
    expect_equal(numbers(deliveries), [2], "messages received by the click-only subscription")
    expect_equal(deliveries[0].message_id, click.message_id, "message id of the click message")


@CASES.case(
    "C19",
    "re-publishing a MessageID with the same content in another key order is a duplicate",
    requires=("detects_message_id_duplicates",),
)
def same_message_id_same_envelope(ctx: CaseContext) -> None:
    ctx.subscribe("a")
    message_id = str(uuid.uuid4())

    first = ctx.publish(
        message_id=message_id,
        attributes={"alpha": "1", "beta": "2"},
        payload={"x": 1, "nested": {"p": 1, "q": [1, 2]}},
        numbered=False,
    )
    again = ctx.publish(
        message_id=message_id,
        attributes={"beta": "2", "alpha": "1"},
        payload={"nested": {"q": [1, 2], "p": 1}, "x": 1},
        numbered=False,
    )

    expect_equal(first.status, "Accepted", "status of the first publish")
    expect_equal(again.status, "Duplicate", "status of the identical re-publish")
    expect_equal(again.message_id, message_id, "message id reported for the duplicate")
    deliveries = ctx.receive("a")
    expect_equal([d.message_id for d in deliveries], [message_id], "deliveries after the duplicate")


@CASES.case(
    "C20",
    "re-publishing a MessageID with different content is rejected as a conflict",
    requires=("detects_message_id_duplicates",),
)
def same_message_id_different_envelope(ctx: CaseContext) -> None:
    ctx.subscribe("a")
    message_id = str(uuid.uuid4())

    first = ctx.publish(message_id=message_id)
    conflict = ctx.publish(message_id=message_id)  # the next n attribute makes it different

    expect_equal(first.status, "Accepted", "status of the first publish")
    expect_equal(conflict.status, "Rejected", "status of the conflicting re-publish")
    code = conflict.error.code if conflict.error is not None else None
    expect_equal(code, "MessageIDConflict", "error code of the conflicting re-publish")
    expect_equal(numbers(ctx.receive("a")), [1], "messages delivered (only the first)")


@CASES.case(
    "C31",
    "a deduplication key is a duplicate naming its owner inside its window, and free after it",
    # The window is minutes to days: only a transport whose clock the harness moves.
    requires=("supports_deduplication", "shifts_time"),
)
def deduplication_window(ctx: CaseContext) -> None:
    ctx.subscribe("a")

    owner = ctx.publish(deduplication_key="order-1", deduplication_ttl=120)
    inside = ctx.publish(deduplication_key="order-1", deduplication_ttl=120)  # other content
    other_key = ctx.publish(deduplication_key="order-2")
    ctx.advance_time(110)
    late = ctx.publish(deduplication_key="order-1")

    expect_equal(owner.status, "Accepted", "status of the first publish of the key")
    expect_equal(other_key.status, "Accepted", "status of a publish with another key")
    for what, result in (("at once", inside), ("110 s later", late)):
        expect_equal(
            (result.status, result.message_id),
            ("Duplicate", owner.message_id),
            f"status and message id of a publish of the key {what} (window 120 s)",
        )

    ctx.advance_time(20)  # 130 s after the owner: its window has closed
    after = ctx.publish(deduplication_key="order-1", deduplication_ttl=120)
    again = ctx.publish(deduplication_key="order-1")

    expect_equal(after.status, "Accepted", "status of a publish of the key after its window")
    expect_true(
        after.message_id not in (None, owner.message_id),
        "a publish after the window is a new message with a new id",
        after.message_id,
    )
    expect_equal(
        (again.status, again.message_id),
        ("Duplicate", after.message_id),
        "a publish of the key after the new owner took it names the new owner",
    )
    expect_equal(sorted(numbers(ctx.receive("a"))), [1, 3, 5], "messages delivered (no duplicate)")


@CASES.case(
    "C32",
    "a deduplication window lasts its TTL, from 60 s to 30 days, or else the topic's default",
    requires=("supports_deduplication", "shifts_time"),
)
def deduplication_ttl_bounds(ctx: CaseContext) -> None:
    ctx.update_topic(default_deduplication_ttl_seconds=300)
    ctx.subscribe("a")
    for ttl in (59, 2_592_001, 0):
        refused = ctx.publish(deduplication_key="bad", deduplication_ttl=ttl)
        code = refused.error.code if refused.error is not None else None
        expect_equal(
            (refused.status, code),
            ("Rejected", "InvalidDeduplication"),
            f"status and error code of a publish with a TTL of {ttl} s",
        )
    ttls = {"shortest": 60, "topic-default": None, "longest": 2_592_000}
    owners: dict[str, str | None] = {}
    for key, ttl in ttls.items():
        first = ctx.publish(deduplication_key=key, deduplication_ttl=ttl)
        expect_equal(first.status, "Accepted", f"status of the first publish of key {key!r}")
        owners[key] = first.message_id
    elapsed = 0

    def at(seconds: int, still_open: tuple[str, ...], closed: tuple[str, ...]) -> None:
        nonlocal elapsed
        ctx.advance_time(seconds - elapsed)
        elapsed = seconds
        for key in still_open:
            result = ctx.publish(deduplication_key=key)
            expect_equal(
                (result.status, result.message_id),
                ("Duplicate", owners[key]),
                f"publish of key {key!r} {seconds} s after its owner",
            )
        for key in closed:
            result = ctx.publish(deduplication_key=key)
            expect_equal(
                result.status, "Accepted", f"publish of key {key!r} {seconds} s after its owner"
            )

    at(50, ("shortest", "topic-default", "longest"), ())
    at(70, ("topic-default", "longest"), ("shortest",))
    at(290, ("topic-default", "longest"), ())
    at(310, ("longest",), ("topic-default",))
    at(2_591_990, ("longest",), ())
    at(2_592_010, (), ("longest",))
