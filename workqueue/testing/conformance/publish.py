"""Publishing cases: fan-out, attribute filters and MessageID idempotency (C01, C03, C19, C20)."""

from __future__ import annotations

import uuid

from workqueue.testing.conformance.harness import CaseContext, expect_equal, numbers
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
