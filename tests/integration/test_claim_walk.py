"""The key walk of wq_claim: when a hot key's backlog fills a claim's window of oldest rows, the
claim walks the keys instead, resuming where the receiver's last walk stopped. Without the
cursor, keys past one walk's budget would never be reached while the window stays clogged. And
when a claim may tell its consumer that it took all there was (``ClaimResult.drained``)."""

from __future__ import annotations

import pytest

from tests.factories import SubscriptionFactory
from workqueue import publish_many
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")

BLOCKED_KEYS = 100  # more than one claim of one delivery may walk (4 x 1 + 64 keys)


def _publish(topic: str, keys: list[str]) -> None:
    results = publish_many(topic, [{"payload": {}, "partition_key": key} for key in keys])
    assert all(r.accepted for r in results)


def test_successive_claims_walk_on_from_the_cursor_until_a_free_key_is_reached():
    subscription = SubscriptionFactory(partition_mode="Ordered")
    topic = subscription.topic.name
    holder = Receiver(subscription.id, "holder")
    # The oldest rows: a hot key whose head is held, then two rows on each of 100 keys whose
    # heads are held too. Only the keys published last are free.
    _publish(topic, ["hot"] * 60)
    assert [d.partition_key for d in holder.receive(1).deliveries] == ["hot"]
    blocked = [f"b{n:03d}" for n in range(BLOCKED_KEYS)]
    _publish(topic, blocked * 2)
    assert len(holder.receive(BLOCKED_KEYS).deliveries) == BLOCKED_KEYS
    _publish(topic, ["c000", "c001"])

    walker = Receiver(subscription.id, "walker")
    first = walker.receive(1)
    assert first.deliveries == []
    assert walker.key_cursor is not None and walker.key_cursor.startswith("b")
    # Keys past the walk's budget may be free: a consumer must not take this claim for all
    # there was.
    assert not first.drained
    # A claim that starts over each time never gets past the blocked keys.
    assert Receiver(subscription.id, "forgetful").receive(1).deliveries == []

    second = walker.receive(1)
    third = walker.receive(1)

    assert [d.partition_key for d in second.deliveries + third.deliveries] == ["c000", "c001"]


def test_a_window_with_room_needs_no_walk_and_keeps_publish_age_order():
    subscription = SubscriptionFactory(partition_mode="Exclusive")
    _publish(subscription.topic.name, ["z", "y", "x"])
    receiver = Receiver(subscription.id)

    result = receiver.receive(10)

    assert [d.partition_key for d in result.deliveries] == ["z", "y", "x"]
    assert receiver.key_cursor is None
    assert result.drained  # short of 10 without a walk: nothing else could be taken


def test_only_a_claim_short_of_what_it_asked_for_took_all_there_was():
    subscription = SubscriptionFactory()
    results = publish_many(subscription.topic.name, [{"payload": {"n": n}} for n in range(3)])
    assert all(r.accepted for r in results)
    receiver = Receiver(subscription.id)

    full = receiver.receive(2)
    short = receiver.receive(2)

    assert (len(full.deliveries), full.drained) == (2, False)
    assert (len(short.deliveries), short.drained) == (1, True)


def _publish_items(topic: str, items: list[dict]) -> None:
    results = publish_many(topic, [{"payload": {}, **item} for item in items])
    assert all(r.accepted for r in results)


def _clog_with_a_hot_key(subscription, priority: int = 0) -> None:
    """More of the hot key's rows than a claim of one looks at, its head held: claims walk."""
    _publish_items(subscription.topic.name, [{"partition_key": "hot", "priority": priority}] * 60)
    held = Receiver(subscription.id, "holder").receive(1).deliveries
    assert [d.partition_key for d in held] == ["hot"]


@pytest.mark.parametrize("mode", ["Exclusive", "Ordered"])
def test_a_key_the_walk_finds_goes_after_keyless_work_of_a_higher_priority(mode):
    """A walked key ranked as the window's lowest priority (the hot key's 50), so its
    delivery of priority -10 was claimed before keyless work of priority 0 (review helper-85)."""
    subscription = SubscriptionFactory(partition_mode=mode)
    _clog_with_a_hot_key(subscription, priority=50)
    _publish_items(subscription.topic.name, [{"partition_key": "a", "priority": -10}, {}])
    walker = Receiver(subscription.id, "walker")

    assert [d.partition_key for d in walker.receive(1).deliveries] == [None]
    assert [d.partition_key for d in walker.receive(1).deliveries] == ["a"]


@pytest.mark.parametrize("mode", ["Exclusive", "Ordered"])
def test_the_walk_resumes_at_a_key_it_found_but_gave_no_turn(mode):
    """Older keyless work filled the claim while a found key waited its turn: the cursor had
    already moved past that key, so the next claim skipped it (review helper-85)."""
    subscription = SubscriptionFactory(partition_mode=mode)
    _clog_with_a_hot_key(subscription)
    _publish_items(subscription.topic.name, [{}])  # due before the keys published next
    _publish_items(subscription.topic.name, [{"partition_key": "a"}, {"partition_key": "b"}])
    walker = Receiver(subscription.id, "walker")

    assert [d.partition_key for d in walker.receive(1).deliveries] == [None]
    assert [d.partition_key for d in walker.receive(1).deliveries] == ["a"]
    assert [d.partition_key for d in walker.receive(1).deliveries] == ["b"]


@pytest.mark.parametrize("mode", ["Exclusive", "Ordered"])
def test_a_walked_key_outranked_by_keyless_work_does_not_hold_back_the_keys_after_it(mode):
    """Waiting behind keyless work of a higher priority, the first key the walk found kept the
    cursor before it, so every claim found it again and the keys after it were never reached,
    a key of a higher priority than that keyless work included (review helper-86)."""
    subscription = SubscriptionFactory(partition_mode=mode)
    topic = subscription.topic.name
    _clog_with_a_hot_key(subscription, priority=50)
    _publish_items(topic, [{"partition_key": "a", "priority": -10}])
    _publish_items(topic, [{"partition_key": "b", "priority": 10}])
    walker = Receiver(subscription.id, "walker")

    claimed = []
    for _ in range(4):
        _publish_items(topic, [{}])  # keyless work keeps coming, of priority 0
        claimed += [d.partition_key for d in walker.receive(1).deliveries]

    assert "b" in claimed[:2] and "a" not in claimed, claimed
