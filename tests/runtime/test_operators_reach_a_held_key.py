"""A handler that completed its delivery in its own transaction holds the delivery's partition
key while it runs on (migration 0064). What an operator, the retention purge and retiring a
subscription do to such a handler and its key (attack review helper-199; every case failed
before migration 0065):

- the stuck-run warning's own remedy, ``discard`` of the delivery (CLI, REST, admin), answered
  "not a running delivery" and left the handler hung and the key held: it now asks the handler
  to stop, as for any running delivery, and the key is free when the handler returns;
- the partition listing headed a held key with the delivery *waiting* behind it, so that
  discarding "the head", which cancels an InFlight key's run, discarded the next message;
- retiring the subscription purged the held row and deleted the subscription under the
  running handler ("running ones are waited for, never cut short");
- the retention purge deleted a hold renewed a moment before, and the key's next delivery was
  claimed beside the handler."""

from __future__ import annotations

import io
import logging
import threading
import time
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection, transaction

from tests.factories import SubscriptionFactory
from tests.support.api import call, operator
from tests.support.handlers import registry
from tests.support.hosts import one, status_of, sub
from tests.support.waiting import wait_until
from workqueue import publish, transport
from workqueue.models import Delivery, Subscription
from workqueue.operators import operations
from workqueue.operators.retire import retire_subscription
from workqueue.runtime.executor import AbortReason
from workqueue.runtime.handlers import BaseWorkHandler
from workqueue.runtime.outcome import Outcome
from workqueue.runtime.sweeper import Sweeper
from workqueue.transport import Receiver
from workqueue.types import LeaseState

pytestmark = pytest.mark.usefixtures("queue_db")

_seen: dict[str, Any] = {}
_let_go = threading.Event()
# Set: the handler hears its cancel but runs on until the test lets it go.
_deaf = threading.Event()


class CompletesThenWaitsToBeTold(BaseWorkHandler):
    """Completes in its block, then runs on (a slow mail) until it is told to stop or the test
    lets it go; the key's later messages record that they ran."""

    def handle(self, message: Any, context: Any) -> Outcome:
        if message.payload["n"] != "first":
            _seen.setdefault("later_started", time.monotonic())
            return Outcome.complete()
        with transaction.atomic():
            context.complete(enlist=True)
        _seen["holder"] = context.delivery_id
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and not _let_go.is_set():
            if context.signal.aborted:
                _seen["told"] = context.signal.reason
                if not _deaf.is_set():
                    break
            time.sleep(0.02)
        _seen["returned"] = time.monotonic()
        return Outcome.complete()


registry.register("tests.held.waits_to_be_told", CompletesThenWaitsToBeTold)


def _holding(make_host: Any, mode: str = "Ordered", **fields: Any) -> tuple[Subscription, str]:
    """A host running a handler that completed its first message in its transaction and
    holds key ``k``; a second message of the key waits. The second message's id."""
    _seen.clear()
    _let_go.clear()
    _deaf.clear()
    s = sub(handler_key="tests.held.waits_to_be_told", partition_mode=mode, **fields)
    make_host(one(s, concurrency=2)).start()
    publish(s.topic.name, {"n": "first"}, partition_key="k")
    second = publish(s.topic.name, {"n": "second"}, partition_key="k").message_id
    wait_until(lambda: "holder" in _seen, timeout=20)
    return s, second


@pytest.mark.parametrize("mode", ["Ordered", "Exclusive"])
def test_a_discard_asks_a_handler_that_holds_its_key_to_stop(make_host, client, mode):
    # Renewed every 20 s: the cancel reaches the handler through the check its announcement
    # sets off (which read InFlight rows only), well before the next renewal would.
    s, second = _holding(make_host, mode, lease_seconds=60)
    holder = _seen["holder"]
    try:
        out = io.StringIO()
        call_command(
            "workqueue",
            "discard",
            "-s",
            s.name,
            "--delivery",
            holder,
            "--reason",
            "3am",
            stdout=out,
        )
        wait_until(lambda: "returned" in _seen, timeout=10)
        again = call(
            client,
            "post",
            f"/subscriptions/{s.name}/deliveries/{holder}/discard",
            {"reason": "again"},
            key=operator(),
        )
    finally:
        _let_go.set()

    said = out.getvalue()
    assert _seen["told"] == AbortReason.CANCELLED
    assert "completed in its handler's own transaction" in said and "tells it to stop" in said, said
    wait_until(lambda: status_of(second) == "Completed", timeout=15)
    assert _seen["later_started"] >= _seen["returned"]
    row = Delivery.objects.get(pk=holder)
    assert (row.status, row.resolved_by is not None, row.cancel_requested_at is not None) == (
        "Completed",
        True,
        True,
    ), "the completed work stays Completed: only its handler's run was cancelled"
    # Asked again after the handler returned and let go: nothing to cancel any more.
    assert again.status_code == 200
    assert again.json()["cancelRequested"] is False and again.json()["discarded"] is False


def test_a_second_discard_while_the_handler_still_runs_says_a_cancel_was_asked(make_host):
    """The handler ignores the cancel for a moment: the second operator hears it was asked.
    (It must ignore it: a handler that stops at once may let go of its key between the two
    discards, and the second then rightly finds nothing to cancel.)"""
    s, _ = _holding(make_host, lease_seconds=30)
    holder = _seen["holder"]
    _deaf.set()
    try:
        first = operations.discard(s.name, holder, reason="first")
        second = operations.discard(s.name, holder, reason="second")
    finally:
        _let_go.set()
    assert (first.cancel_requested, first.discarded, first.holds_key) == (True, True, True)
    assert (second.cancel_requested, second.discarded, second.holds_key) == (True, False, True)


def test_the_partition_listing_heads_a_held_key_with_the_handler_that_holds_it(make_host):
    """An InFlight key's head is the delivery that runs: discarding it cancels the run. A held
    key's head was the next message, which the same move then discarded."""
    s, second = _holding(make_host, lease_seconds=30)
    try:
        (item,) = operations.list_partitions(s.name).items
        listing = io.StringIO()
        call_command("workqueue", "partitions", "-s", s.name, stdout=listing)
    finally:
        _let_go.set()
    assert (item.condition, item.head_delivery_id, item.waiting_items) == (
        "InFlight",
        _seen["holder"],
        1,
    )
    assert _seen["holder"] in listing.getvalue()
    wait_until(lambda: status_of(second) == "Completed", timeout=15)


def test_retiring_waits_for_a_handler_that_holds_its_key(make_host):
    s, _ = _holding(make_host, lease_seconds=5)
    said: list[str] = []
    try:
        with pytest.raises(Exception, match=r"1 deliveries of .* were still running after 2 s"):
            retire_subscription(s.name, wait_seconds=2, discard_pending=True, say=said.append)
        assert Subscription.objects.filter(pk=s.pk).exists(), said
        assert "told" not in _seen, f"the handler was told {_seen.get('told')!r} ({said})"
    finally:
        _let_go.set()
    wait_until(lambda: "returned" in _seen, timeout=10)
    wait_until(
        lambda: not Delivery.objects.filter(
            subscription=s, lease_expires_at__isnull=False
        ).exists(),
        timeout=10,
    )
    assert retire_subscription(s.name, wait_seconds=5, discard_pending=True).deleted


def test_the_retention_purge_leaves_a_live_hold_alone():
    """A tail hung for longer than its topic's retention (a day at least), its hold renewed
    all along: the purge deleted the row that held the key."""
    s = SubscriptionFactory(partition_mode="Ordered", lease_seconds=60)
    s.topic.retention_days = 1
    s.topic.save(update_fields=["retention_days"])
    publish(s.topic.name, {}, partition_key="k")
    publish(s.topic.name, {}, partition_key="k")
    holder = Receiver(str(s.id), "host-a")
    (held,) = holder.receive(1).deliveries
    with transaction.atomic():
        assert holder.complete(held, connection=transaction.get_connection(), holding_key=True)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE workqueue_delivery SET completed_at = now() - interval '25 hours' "
            "WHERE id = %s",
            [held.delivery_id],
        )
    assert holder.extend_lease(held).state == LeaseState.HELD

    passed = Sweeper().run_once()

    assert Receiver(str(s.id), "host-b").receive(5).deliveries == [], passed
    assert holder.extend_lease(held).state == LeaseState.HELD
    holder.release_key(held)
    assert Sweeper().run_once().purged["terminal_deliveries"] == 1  # let go of: purged


_capped: dict[str, Any] = {}


class CompleteThenDeafTail(BaseWorkHandler):
    def handle(self, message: Any, context: Any) -> Outcome:
        with transaction.atomic():
            context.complete(enlist=True)
        wait_until(lambda: context.signal.has(AbortReason.LEASE_LOST), timeout=20)
        _capped["told"] = True
        return Outcome.complete()


registry.register("tests.held.deaf_tail", CompleteThenDeafTail)


def test_a_hold_the_time_cap_ended_is_logged_as_the_caps_doing(make_host, caplog):
    """The hold's end was logged as "renewals failed for a lease" whatever ended it."""
    caplog.set_level(logging.ERROR, logger="workqueue")
    s = sub(
        handler_key="tests.held.deaf_tail",
        partition_mode="Ordered",
        lease_seconds=5,
        max_processing_seconds=1,
    )
    make_host(one(s, concurrency=1)).start()
    publish(s.topic.name, {}, partition_key="k")
    wait_until(lambda: "told" in _capped, timeout=20)
    (line,) = [r.getMessage() for r in caplog.records if "partition key held" in r.getMessage()]
    assert "max_processing_seconds" in line and "renewals failed" not in line, line


def test_a_retirements_purge_leaves_a_live_hold_alone():
    """The procedure itself, should a retirement's count have missed the hold (a handler that
    completed just after it): its row is the key's hold, and its subscription's delete is then
    refused while it lasts."""
    s = SubscriptionFactory(partition_mode="Exclusive", lease_seconds=60)
    publish(s.topic.name, {}, partition_key="k")
    holder = Receiver(str(s.id), "host-a")
    (held,) = holder.receive(1).deliveries
    with transaction.atomic():
        assert holder.complete(held, connection=transaction.get_connection(), holding_key=True)
    Subscription.objects.filter(pk=s.pk).update(status="Disabled")

    assert transport.retire_purge(str(s.id), 100) == 0
    assert holder.extend_lease(held).state == LeaseState.HELD
    holder.release_key(held)
    assert transport.retire_purge(str(s.id), 100) == 1


def _hold(receiver: Receiver) -> Any:
    """Claim the next delivery and complete it holding its key, as a handler's block does."""
    (held,) = receiver.receive(1).deliveries
    with transaction.atomic():
        assert receiver.complete(held, connection=transaction.get_connection(), holding_key=True)
    return held


def test_the_listing_heads_a_held_key_with_its_live_holder_not_a_lapsed_one():
    """Review helper-200: a host died holding the key (its row keeps the lapsed lease until the
    sweeper clears it), then the key's next delivery completed in its handler's transaction
    and holds it. The listing named the dead host's delivery, whose discard changed nothing."""
    s = SubscriptionFactory(partition_mode="Ordered", lease_seconds=60)
    for _ in range(3):
        publish(s.topic.name, {}, partition_key="k")
    stale = _hold(Receiver(str(s.id), "host-dead"))
    with connection.cursor() as cursor:  # the host died and its hold ran out
        cursor.execute(
            "UPDATE workqueue_delivery SET lease_expires_at = now() - interval '1 minute' "
            "WHERE id = %s",
            [stale.delivery_id],
        )
    live = _hold(Receiver(str(s.id), "host-live"))

    (item,) = operations.list_partitions(s.name).items
    assert (item.condition, item.head_delivery_id, item.lease_owner) == (
        "InFlight",
        live.delivery_id,
        "host-live",
    )
    assert operations.discard(s.name, item.head_delivery_id, reason="stuck").holds_key


@pytest.mark.parametrize("asked", [None, "InFlight"])
def test_a_key_let_go_while_it_was_listed_is_listed_as_it_is_now(monkeypatch, asked):
    """Review helper-200: the listing reads the key's condition, then its holder; a handler
    that let go in between left the key listed InFlight and headed by its next message, which
    the operator's "discard the running one" then discarded before it ever ran."""
    from workqueue.transports.database import DatabaseTransport

    s = SubscriptionFactory(partition_mode="Ordered", lease_seconds=60)
    publish(s.topic.name, {}, partition_key="k")
    following = publish(s.topic.name, {}, partition_key="k").message_id
    holder = Receiver(str(s.id), "host-a")
    held = _hold(holder)
    listed = DatabaseTransport.list_partitions

    def then_the_handler_returns(self: Any, *args: Any, **kwargs: Any) -> Any:
        found = listed(self, *args, **kwargs)
        holder.release_key(held)
        return found

    monkeypatch.setattr(DatabaseTransport, "list_partitions", then_the_handler_returns)
    items = operations.list_partitions(s.name, condition=asked).items

    assert items == [], "a key nobody holds any more was listed InFlight, headed by its next"
    assert status_of(following) == "Pending"
