"""Claim and lease cases: redelivery, backoff, expiry, fencing and heartbeats
(C04-C09, C21, C22, C29, C30, C41), a claim whose answer was lost (C45, C46). Time passes through
``advance_time``, never a sleep."""

from __future__ import annotations

import uuid

from workqueue.models import Subscription
from workqueue.testing.conformance.harness import (
    CaseContext,
    expect_equal,
    expect_settled,
    expect_true,
)
from workqueue.testing.conformance.registry import CASES

LEASE = 5  # the shortest lease a subscription may have


@CASES.case("C04", "a completed delivery is never delivered again")
def completed_not_redelivered(ctx: CaseContext) -> None:
    ctx.subscribe("a", lease_seconds=LEASE)
    ctx.publish()
    delivery = ctx.receive_one("a")

    settled = ctx.receiver("a").complete(delivery)

    expect_settled(settled, "Completed", "complete result")
    ctx.expect_nothing_receivable("a", "right after completion")
    # Even once the old lease would have run out, nothing comes back.
    ctx.advance_time(LEASE + 1)
    ctx.expect_nothing_receivable("a", "after the old lease's expiry time")


@CASES.case("C05", "a retried delivery stays hidden for its delay, then returns as attempt 2")
def retry_with_delay(ctx: CaseContext) -> None:
    ctx.subscribe("a")
    sent = ctx.publish()
    first = ctx.receive_one("a")

    settled = ctx.receiver("a").retry(first, delay_seconds=2, error="try later")

    expect_settled(settled, "Pending", "retry result")
    ctx.expect_nothing_receivable("a", "during the 2 s backoff")
    ctx.advance_time(3)
    again = ctx.receive_one("a")
    expect_equal(again.message_id, sent.message_id, "message id after the backoff")
    expect_equal(again.delivery_id, first.delivery_id, "delivery id after the backoff")
    expect_equal(again.attempt, 2, "attempt number after one retry")


@CASES.case("C06", "a delivery whose lease expires unsettled is delivered again as attempt 2")
def lease_expiry_redelivers(ctx: CaseContext) -> None:
    ctx.subscribe("a", lease_seconds=LEASE)
    sent = ctx.publish()
    ctx.receive_one("a")

    ctx.expect_nothing_receivable("a", "while the lease is held")
    ctx.advance_time(LEASE + 1)

    again = ctx.receive_one("a", owner="second")
    expect_equal(again.message_id, sent.message_id, "message id redelivered after expiry")
    expect_equal(again.attempt, 2, "attempt number after lease expiry")


@CASES.case("C07", "a stale lease token cannot settle; the new holder's token can")
def fencing_on_complete(ctx: CaseContext) -> None:
    ctx.subscribe("a", lease_seconds=LEASE)
    ctx.publish()
    stale = ctx.receive_one("a")
    ctx.advance_time(LEASE + 1)
    current = ctx.receive_one("a", owner="second")
    expect_true(stale.lease_token != current.lease_token, "re-claim issues a new lease token")

    lost = ctx.receiver("a").complete(stale)
    won = ctx.receiver("a", "second").complete(current)

    expect_equal(lost.outcome, "LeaseLost", "complete with the stale token")
    expect_settled(won, "Completed", "complete with new token")


@CASES.case("C08", "a heartbeat renews the full lease, so the delivery is not taken over")
def heartbeat_keeps_lease(ctx: CaseContext) -> None:
    ctx.subscribe("a", lease_seconds=LEASE)
    ctx.publish()
    delivery = ctx.receive_one("a")

    ctx.advance_time(4)
    extension = ctx.receiver("a").extend_lease(delivery, progress={"percent": 50})
    expect_equal(extension.state, "Held", "lease state after a heartbeat 4 s in")
    # 7 s after the claim: past the original lease, within the renewed one.
    ctx.advance_time(3)
    ctx.expect_nothing_receivable("a", "3 s after the heartbeat")

    settled = ctx.receiver("a").complete(delivery)
    expect_settled(settled, "Completed", "complete after the heartbeat")


@CASES.case("C09", "a heartbeat with a stale token after a takeover reports the lease lost")
def heartbeat_after_takeover(ctx: CaseContext) -> None:
    ctx.subscribe("a", lease_seconds=LEASE)
    ctx.publish()
    stale = ctx.receive_one("a")
    ctx.advance_time(LEASE + 1)
    current = ctx.receive_one("a", owner="second")

    expect_equal(ctx.receiver("a").extend_lease(stale).state, "Lost", "stale heartbeat")
    expect_equal(
        ctx.receiver("a", "second").extend_lease(current).state, "Held", "new holder's heartbeat"
    )


@CASES.case("C21", "a released delivery is delivered again without using up an attempt")
def release_refunds_attempt(ctx: CaseContext) -> None:
    ctx.subscribe("a")
    sent = ctx.publish()
    first = ctx.receive_one("a")

    settled = ctx.receiver("a").release(first)

    expect_settled(settled, "Pending", "release result")
    again = ctx.receive_one("a")
    expect_equal(again.message_id, sent.message_id, "message id after release")
    expected_attempt = 2 if ctx.traits.release_consumes_attempt else 1
    expect_equal(again.attempt, expected_attempt, "attempt number after release")


@CASES.case(
    "C22",
    "a lease expiring on the last attempt dead-letters the delivery as LeaseExpired",
    requires=("expired_lease_dead_letters",),
)
def expiry_on_last_attempt(ctx: CaseContext) -> None:
    ctx.subscribe("a", lease_seconds=LEASE, max_attempts=1)
    sent = ctx.publish()
    delivery = ctx.receive_one("a")
    ctx.advance_time(LEASE + 1)

    result = ctx.receive_result("a")

    expect_equal(len(result.deliveries), 0, "deliveries receivable after the last attempt expired")
    expect_equal(
        [(e.delivery_id, e.reason) for e in result.expired_dead_letters],
        [(delivery.delivery_id, "LeaseExpired")],
        "dead letters reported by the receive that expired the lease",
    )
    letters = ctx.dead_letters("a")
    expect_equal(
        [(d.message_id, d.reason) for d in letters],
        [(sent.message_id, "LeaseExpired")],
        "dead letters listed",
    )


@CASES.case(
    "C29",
    "until the delivery is taken back, a holder whose lease ran out may still renew and settle",
    requires=("settles_after_expiry_until_taken_back",),
)
def expired_but_not_taken_back(ctx: CaseContext) -> None:
    # The token, not the clock, fences a holder: nobody else can have run the delivery before a
    # claim or the sweeper takes it back, so the holder's work still counts until then.
    ctx.subscribe("a", lease_seconds=LEASE)
    ctx.publish()
    ctx.publish()
    first, second = ctx.receive("a")
    receiver = ctx.receiver("a")
    ctx.advance_time(LEASE + 1)

    expect_equal(receiver.extend_lease(first).state, "Held", "renewal after the expiry time")
    expect_settled(receiver.complete(second), "Completed", "complete after the expiry time")
    ctx.advance_time(LEASE - 1)  # the renewal gave a whole new lease
    ctx.expect_nothing_receivable("a", "while the renewed lease is held")
    expect_settled(receiver.complete(first), "Completed", "complete within the renewed lease")


@CASES.case(
    "C30",
    "a batch completion settles only the deliveries whose tokens still hold; a stale holder "
    "cannot acknowledge a cancel",
    requires=("cancel_in_flight",),
)
def batch_completion_with_stale_tokens(ctx: CaseContext) -> None:
    ctx.subscribe("a", lease_seconds=LEASE)
    ctx.publish()
    ctx.publish()
    stale_one, stale_two = ctx.receive("a")
    ctx.advance_time(LEASE + 1)
    retaken = {d.delivery_id: d for d in ctx.receive("a", owner="second")}
    expect_equal(set(retaken), {stale_one.delivery_id, stale_two.delivery_id}, "taken back")
    ctx.publish()
    fresh = ctx.receive_one("a")

    results = ctx.receiver("a").complete_many([stale_one, fresh, stale_two])

    expect_equal(
        {key: result.outcome for key, result in results.items()},
        {stale_one.delivery_id: "LeaseLost", fresh.delivery_id: "Settled",
         stale_two.delivery_id: "LeaseLost"},
        "outcome per delivery",
    )  # fmt: skip
    ctx.discard("a", stale_one.delivery_id)  # a cancel of the second holder's run
    expect_equal(
        ctx.receiver("a").acknowledge_cancel(stale_one).outcome,
        "LeaseLost",
        "acknowledgement with the stale token",
    )
    current = retaken[stale_one.delivery_id]
    expect_settled(
        ctx.receiver("a", "second").acknowledge_cancel(current), "Discarded", "holder's ack"
    )


@CASES.case(
    "C41",
    "a claim says how long its lease is, and a delivery keeps that length while it is held, "
    "however the subscription's lease is shortened meanwhile",
)
def lease_length_kept_from_the_claim(ctx: CaseContext) -> None:
    # A holder times its renewals by the length its claim gave it: a renewal cut to a setting
    # shortened since would run out between them, and another consumer would run the delivery
    # beside the holder.
    subscription = ctx.subscribe("a", lease_seconds=30)
    ctx.publish()
    held = ctx.receive_one("a")
    expected = 30 if ctx.traits.reports_lease_seconds else None
    expect_equal(held.lease_seconds, expected, "the lease length the claim says")
    Subscription.objects.using(ctx.alias).filter(pk=subscription.pk).update(lease_seconds=LEASE)

    ctx.advance_time(4)
    expect_equal(ctx.receiver("a").extend_lease(held).state, "Held", "renewal after the change")
    ctx.advance_time(20)  # 20 s after the renewal: past the shortened lease, within the claim's
    ctx.expect_nothing_receivable("a", "within the lease length the claim gave")
    expect_settled(ctx.receiver("a").complete(held), "Completed", "complete within the lease")


@CASES.case(
    "C45",
    "a claim whose answer was lost is handed back once, at its attempt and with new tokens and "
    "leases, to its holder's claims that name it, over several when they have less room",
    requires=("claims_through_procedures",),
)
def lost_claim_handed_back(ctx: CaseContext) -> None:
    # A claim that commits while its connection drops leaves its deliveries leased to a
    # consumer that never heard of them: without the hand-back they would wait out the lease
    # and run as a further attempt (dead-lettered unrun on a last one).
    ctx.subscribe("a", lease_seconds=30)
    for _ in range(3):
        ctx.publish()
    lost = uuid.uuid4()
    taken = ctx.claim_by_procedure("a", 3, claim_id=lost).claimed  # its answer never arrives
    expect_equal(len(taken), 3, "deliveries the lost claim took")

    stranger = ctx.claim_by_procedure(
        "a", 3, claim_id=uuid.uuid4(), retake_claim_id=lost, owner="second"
    )
    expect_equal(
        (stranger.claimed, stranger.retaken), ([], 0), "another holder's claim naming the lost one"
    )
    ctx.publish()  # new work, which a claim takes only with the room the hand-back leaves
    first = ctx.claim_by_procedure("a", 2, claim_id=uuid.uuid4(), retake_claim_id=lost)
    rest = ctx.claim_by_procedure("a", 5, claim_id=uuid.uuid4(), retake_claim_id=lost)

    expect_equal((first.retaken, rest.retaken), (2, 1), "retaken by a claim of 2, then of 5")
    expect_equal(
        (len(first.claimed), len(rest.claimed)), (2, 2), "rows (the new work in the second)"
    )
    taken_by_id = {str(r["delivery_id"]): r for r in taken}
    handed = first.claimed + [r for r in rest.claimed if str(r["delivery_id"]) in taken_by_id]
    expect_equal(
        sorted(str(r["delivery_id"]) for r in handed),
        sorted(taken_by_id),
        "deliveries handed back, each once",
    )
    expect_equal(
        {r["attempt_count"] for r in first.claimed + rest.claimed}, {1}, "attempts of those claims"
    )
    # Leases from the claim that handed them back, which the consumer times its renewals from.
    expect_true(
        all(
            r["lease_expires_at"] > taken_by_id[str(r["delivery_id"])]["lease_expires_at"]
            for r in handed
        ),
        "each handed-back lease ends after the lost claim's",
    )
    # The tokens the hand-back gave fence the deliveries now; the lost claim's no longer do.
    expect_equal([ctx.complete_by_procedure(r) for r in taken], [0, 0, 0], "old tokens")
    expect_equal(
        [ctx.complete_by_procedure(r) for r in first.claimed + rest.claimed], [1] * 4, "new tokens"
    )


@CASES.case(
    "C46",
    "a lost claim's deliveries are handed back after a pause, which stops only new claims, but "
    "not once an operator asked to cancel one",
    requires=("claims_through_procedures",),
)
def lost_claim_after_pause_or_cancel(ctx: CaseContext) -> None:
    subscription = ctx.subscribe("a", lease_seconds=30)
    for _ in range(3):
        ctx.publish()
    lost = uuid.uuid4()
    taken = ctx.claim_by_procedure("a", 2, claim_id=lost).claimed
    cancelled = ctx.traits.cancel_in_flight
    if cancelled:
        expect_true(ctx.discard("a", str(taken[0]["delivery_id"])).cancel_requested, "cancel")
    Subscription.objects.using(ctx.alias).filter(pk=subscription.pk).update(status="Paused")

    paused = ctx.claim_by_procedure("a", 3, claim_id=uuid.uuid4(), retake_claim_id=lost)

    expected = taken[1:] if cancelled else taken
    expect_equal(
        sorted(str(r["delivery_id"]) for r in paused.claimed),
        sorted(str(r["delivery_id"]) for r in expected),
        "handed back while paused (the third delivery waits, unclaimed)",
    )
    expect_equal(paused.retaken, len(expected), "the Retaken count while paused")
    expect_equal(paused.lease_seconds, 30, "the lease length the claim says")
