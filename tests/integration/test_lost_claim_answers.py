"""A claim that committed but whose answer was lost with its connection (a network drop, a
failover, a pooler restarting) costs no attempt: the consumer's next claims name the lost claim
again and are handed what it took, at the same attempt, with fresh leases and tokens. Before,
those deliveries stayed hidden for a whole lease, then ran as attempt 2 (on a subscription with
``max_attempts=1``, dead-lettered as LeaseExpired without ever having run).

The answer is lost the way the driver sees it: the procedure ran and committed on the
autocommit connection, then the call raised as a dropped connection does.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import pytest
from django.db import connection

from tests.factories import SubscriptionFactory
from tests.support.handlers import probe
from tests.support.hosts import one, status_of, sub
from tests.support.waiting import wait_until
from workqueue import publish, publish_many
from workqueue.driver import get_driver
from workqueue.exceptions import TransientDriverError
from workqueue.models import Delivery, Subscription
from workqueue.operators import operations
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")

LONG_LEASE = 300


class LostClaims:
    """Makes the next ``count`` claims (``wq_claim`` calls) that take something commit and then
    lose their answer; ``ids`` holds the claim id each lost claim was sent with."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.pending = 0
        #: While set, claims fail before they reach the database (a connection refused).
        self.refusing = False
        self.lost: list[list[dict[str, Any]]] = []
        self.ids: list[uuid.UUID] = []
        # The instance every receiver calls, patched in its ``__dict__`` so that the undo leaves
        # nothing behind (``setattr`` on an instance leaves it its own bound ``call`` after the
        # undo, which a later patch of the class then misses).
        driver = get_driver()
        call = driver.call

        def call_losing_claim_answers(name: str, *args: Any, **kwargs: Any) -> Any:
            if name == "wq_claim" and self.refusing:
                raise TransientDriverError("connection refused (test)")
            rows = call(name, *args, **kwargs)
            claimed = [r for r in rows if r["kind"] == "Claimed"] if name == "wq_claim" else []
            if claimed and self.pending:
                self.pending -= 1
                self.lost.append(claimed)
                self.ids.append(args[0].get("claim_id"))
                raise TransientDriverError("server closed the connection unexpectedly (test)")
            return rows

        monkeypatch.setitem(vars(driver), "call", call_losing_claim_answers)

    def lose(self, count: int = 1) -> None:
        self.pending = count


@pytest.fixture
def lost_claims(monkeypatch: pytest.MonkeyPatch) -> LostClaims:
    return LostClaims(monkeypatch)


def _lease_ends(delivery_id: str) -> dt.datetime:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT lease_expires_at FROM workqueue_delivery WHERE id = %s", [delivery_id]
        )
        return cursor.fetchone()[0]


def test_a_claim_whose_answer_was_lost_is_handed_back_by_the_next_claim_at_its_attempt(
    lost_claims,
):
    subscription = SubscriptionFactory(lease_seconds=LONG_LEASE)
    published = [publish(subscription.topic.name, {"n": n}).message_id for n in range(3)]
    receiver = Receiver(subscription.id, "host-1")

    lost_claims.lose()
    with pytest.raises(TransientDriverError):
        receiver.receive(3)
    (lost,) = lost_claims.lost
    assert len(lost) == 3  # the claim committed: three deliveries InFlight, nobody knowing
    first_leases = {str(r["delivery_id"]): _lease_ends(r["delivery_id"]) for r in lost}

    handed_back = receiver.receive(3).deliveries

    assert sorted(d.message_id for d in handed_back) == sorted(published)
    assert [d.attempt for d in handed_back] == [1, 1, 1]
    for delivery in handed_back:
        # A fresh lease from the claim that answered: the consumer times its renewals from it.
        assert _lease_ends(delivery.delivery_id) > first_leases[delivery.delivery_id]
        assert receiver.complete(delivery).settled
    assert set(Delivery.objects.values_list("status", flat=True)) == {"Completed"}


def test_a_lost_claim_larger_than_the_next_is_handed_back_over_several_claims_never_twice(
    lost_claims,
):
    """The next claim may have less room than the lost one had (a rate limit, a one-shot
    budget): the rest comes with the claims after it, and what one hands back is never handed
    out again (it carries the new claim's tokens)."""
    subscription = SubscriptionFactory(lease_seconds=LONG_LEASE)
    publish_many(subscription.topic, [{"payload": {"n": n}} for n in range(6)])
    receiver = Receiver(subscription.id, "host-1")

    lost_claims.lose()
    with pytest.raises(TransientDriverError):
        receiver.receive(4)
    claims = [receiver.receive(2).deliveries, receiver.receive(4).deliveries]
    claims.append(receiver.receive(4).deliveries)

    lost_ids = {str(r["delivery_id"]) for r in lost_claims.lost[0]}
    handed = [d.delivery_id for claim in claims for d in claim]
    assert len(handed) == len(set(handed)) == 6
    assert {d.delivery_id for d in claims[0]} <= lost_ids
    assert lost_ids <= {d.delivery_id for d in claims[0] + claims[1]}
    assert {d.attempt for claim in claims for d in claim} == {1}


def test_a_lost_claim_hands_back_only_what_it_took_and_only_to_its_consumer(lost_claims):
    """The hand-back is fenced by the lost claim's tokens and its holder: not a delivery the
    consumer already runs, not to another consumer naming the same claim, not to a claim
    naming another id."""
    subscription = SubscriptionFactory(lease_seconds=LONG_LEASE)
    first = publish(subscription.topic.name, {"n": 0}).message_id
    receiver = Receiver(subscription.id, "host-1")
    (running,) = receiver.receive(1).deliveries
    assert running.message_id == first
    publish_many(subscription.topic, [{"payload": {"n": n}} for n in (1, 2)])
    lost_claims.lose()
    with pytest.raises(TransientDriverError):
        receiver.receive(5)
    (lost_id,) = lost_claims.ids

    def claim_naming(retake_claim_id: uuid.UUID, owner: str) -> list[dict[str, Any]]:
        rows = get_driver().call(
            "wq_claim",
            {
                "subscription_id": subscription.id,
                "lease_owner": owner,
                "max_rows": 5,
                "claim_id": uuid.uuid4(),
                "retake_claim_id": retake_claim_id,
            },
        )
        return [r for r in rows if r["kind"] == "Claimed"]

    assert claim_naming(lost_id, "host-2") == []
    assert claim_naming(uuid.uuid4(), "host-1") == []
    handed = receiver.receive(5).deliveries
    assert sorted(d.delivery_id for d in handed) == sorted(
        str(r["delivery_id"]) for r in lost_claims.lost[0]
    )
    assert running.delivery_id not in {d.delivery_id for d in handed}


def test_a_lost_claim_is_handed_back_though_the_subscription_was_paused_since(lost_claims):
    """Claimed while it ran, they run as they would have had the answer arrived; a pause stops
    new claims only."""
    subscription = SubscriptionFactory(lease_seconds=LONG_LEASE)
    publish_many(subscription.topic, [{"payload": {"n": n}} for n in range(3)])
    receiver = Receiver(subscription.id, "host-1")
    lost_claims.lose()
    with pytest.raises(TransientDriverError):
        receiver.receive(2)
    Subscription.objects.filter(pk=subscription.pk).update(status="Paused")

    handed = receiver.receive(3)

    assert sorted(d.delivery_id for d in handed.deliveries) == sorted(
        str(r["delivery_id"]) for r in lost_claims.lost[0]
    )
    assert [d.attempt for d in handed.deliveries] == [1, 1]
    assert {d.lease_seconds for d in handed.deliveries} == {LONG_LEASE}


def test_a_lost_claim_whose_lease_ran_out_or_was_cancelled_is_not_handed_back(lost_claims):
    """What the lost claim took and has since ended its lease, or been cancelled by an
    operator, follows the ordinary rules (expiry, a cancel settling it when its lease runs out),
    never a hand-back that would run it on a lease already gone or against the cancel."""
    subscription = SubscriptionFactory(lease_seconds=LONG_LEASE, max_attempts=5)
    expired, cancelled = (publish(subscription.topic.name, {"n": n}).message_id for n in (1, 2))
    receiver = Receiver(subscription.id, "host-1")
    lost_claims.lose()
    with pytest.raises(TransientDriverError):
        receiver.receive(2)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE workqueue_delivery SET lease_expires_at = now() - interval '1 second' "
            "WHERE message_id = %s",
            [expired],
        )
    cancelled_id = str(Delivery.objects.get(message_id=cancelled).id)
    assert operations.discard(subscription.name, cancelled_id, reason="test").cancel_requested

    handed = receiver.receive(2).deliveries

    # The expired one came back through expiry as attempt 2 (a claim, not a hand-back); the
    # cancelled one was not handed out at all.
    assert [(d.message_id, d.attempt) for d in handed] == [(expired, 2)]
    assert Delivery.objects.get(message_id=cancelled).status == "InFlight"


def test_a_host_whose_claim_answer_was_lost_runs_the_work_at_once_at_attempt_1(
    make_host, lost_claims
):
    s = sub(lease_seconds=LONG_LEASE, max_attempts=1)
    lost_claims.lose()
    host = make_host(one(s, concurrency=2))
    host.start()

    message = publish(s.topic.name, {"then": "complete"}).message_id

    # Well within the lease: before, the delivery waited out its 300 s lease and then, on its
    # only attempt, was dead-lettered as LeaseExpired without ever having run.
    wait_until(lambda: status_of(message) == "Completed", timeout=20)
    assert lost_claims.lost and str(lost_claims.lost[0][0]["message_id"]) == message
    assert [run.attempt for run in probe.wait_for(1, message_id=message)] == [1]


def test_a_lost_claim_is_handed_back_to_the_consumer_a_re_plan_put_in_its_place(
    make_host, lost_claims
):
    """A re-plan that rebuilt the subscription's consumer (its settings changed) during the
    outage that lost a claim's answer dropped the lost claim's id with the old consumer: its
    deliveries waited out their lease, and on a last attempt were dead-lettered unrun."""
    s = sub(lease_seconds=LONG_LEASE, max_attempts=1)
    host = make_host(one(s, concurrency=2))
    host.start()
    lost_claims.lose()
    message = publish(s.topic.name, {"then": "complete"}).message_id
    wait_until(lambda: lost_claims.lost, timeout=10)
    lost_claims.refusing = True  # the outage goes on: the old consumer claims nothing more

    Subscription.objects.filter(pk=s.pk).update(lease_seconds=LONG_LEASE + 60)
    host.reconcile()
    lost_claims.refusing = False

    wait_until(lambda: status_of(message) == "Completed", timeout=20)
    assert [run.attempt for run in probe.wait_for(1, message_id=message)] == [1]


def test_a_claim_that_fails_after_its_receiver_was_replaced_is_handed_back_by_the_new_one(
    lost_claims,
):
    """A claim hung on a dead connection outlives its consumer's stop: it fails after the
    re-plan built the new consumer, which had copied a state that did not name it yet (review
    helper-159). The new receiver takes it then, and the old one names it no more."""
    subscription = SubscriptionFactory(lease_seconds=LONG_LEASE)
    published = [publish(subscription.topic.name, {"n": n}).message_id for n in range(3)]
    old, new = Receiver(subscription.id, "host-1"), Receiver(subscription.id, "host-1")
    new.carry_over_from(old)  # the re-plan, while the old consumer's claim is still out

    lost_claims.lose()
    with pytest.raises(TransientDriverError):
        old.receive(3)
    handed = new.receive(3).deliveries

    assert sorted(d.message_id for d in handed) == sorted(published)
    assert [d.attempt for d in handed] == [1, 1, 1]
    assert old.receive(3).deliveries == []


def test_deliveries_whose_claim_answer_can_never_be_read_reach_their_dead_letter(lost_claims):
    """Review helper-153: an answer that fails every time (a value the driver cannot decode,
    say) handed the same delivery back every other claim, renewing its lease at the same
    attempt, so it never reached max_attempts and held its key for ever. A claim that named a
    lost one and failed too is not named in turn: the delivery is handed back once, then left
    to its lease."""
    subscription = SubscriptionFactory(lease_seconds=LONG_LEASE, max_attempts=1)
    message = publish(subscription.topic.name, {"n": 1}).message_id
    receiver = Receiver(subscription.id, "host-1")
    lost_claims.lose(count=1_000)

    for _ in range(10):
        with pytest.raises(TransientDriverError):
            receiver.receive(1)
        if len(lost_claims.lost) == 2:
            break
    for _ in range(5):
        assert receiver.receive(1).deliveries == []  # not handed back a third time
    assert len(lost_claims.lost) == 2

    get_driver().shift_time(LONG_LEASE + 1, subscription_id=str(subscription.id))
    expired = receiver.receive(1).expired_dead_letters
    assert [d.delivery_id for d in expired] == [str(lost_claims.lost[0][0]["delivery_id"])]
    assert Delivery.objects.get(message_id=message).status == "DeadLettered"
