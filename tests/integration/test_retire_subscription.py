"""Retiring a subscription (issue 17 §9): ``manage.py workqueue retire-subscription NAME
[--dry-run] [--discard-pending] [--wait-seconds N]`` disables it, waits for its running work,
discards what waits only when asked, purges its settled deliveries through the procedures and
deletes it; other subscriptions of the topic are untouched."""

from __future__ import annotations

import io
import threading
import time

import pytest
from django.core.management import CommandError, call_command

from tests.factories import SubscriptionFactory, TopicFactory
from workqueue import publish, transport
from workqueue.models import Delivery, Message, Subscription
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")


def retire(*args: str) -> str:
    out = io.StringIO()
    call_command("workqueue", "retire-subscription", *args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def with_every_status(sub: Subscription) -> dict[str, str]:
    """One delivery of ``sub`` in each of Completed, DeadLettered and Pending; returns the
    message id of each."""
    ids = {name: publish(sub.topic.name, {"n": name}).message_id for name in ("done", "dead")}
    receiver = Receiver(sub.id)
    claimed = {c.message_id: c for c in receiver.receive(2).deliveries}
    assert receiver.complete(claimed[ids["done"]]).settled
    assert receiver.dead_letter(claimed[ids["dead"]], "Poison", "boom").settled
    ids["waiting"] = publish(sub.topic.name, {"n": "waiting"}).message_id
    return ids


def statuses(sub: Subscription) -> list[str]:
    return sorted(Delivery.objects.filter(subscription=sub).values_list("status", flat=True))


def test_it_refuses_while_work_waits_and_changes_nothing():
    sub = SubscriptionFactory()
    with_every_status(sub)

    with pytest.raises(CommandError, match="has 1 Pending and 1 dead-lettered deliveries"):
        retire(sub.name)

    sub.refresh_from_db()
    assert sub.status == "Active"
    assert statuses(sub) == ["Completed", "DeadLettered", "Pending"]


def test_a_dry_run_says_what_it_would_do_and_changes_nothing():
    sub = SubscriptionFactory()
    with_every_status(sub)

    out = retire(sub.name, "--dry-run", "--discard-pending")

    assert "Would disable" in out
    assert "Would discard 2 Pending or dead-lettered deliveries." in out
    assert "Would purge 3 settled deliveries." in out
    assert "Dry run: nothing was changed." in out
    sub.refresh_from_db()
    assert sub.status == "Active" and statuses(sub) == ["Completed", "DeadLettered", "Pending"]


def test_discard_pending_retires_it_and_leaves_the_topics_other_subscriptions_alone():
    topic = TopicFactory()
    sub = SubscriptionFactory(topic=topic)
    other = SubscriptionFactory(topic=topic)
    ids = with_every_status(sub)
    before_other = statuses(other)

    out = retire(sub.name, "--discard-pending")

    assert "Discarded 2 Pending or dead-lettered deliveries." in out
    assert "Purged 3 settled deliveries." in out
    assert f"Deleted subscription {sub.name}." in out
    assert not Subscription.objects.filter(pk=sub.pk).exists()
    assert not Delivery.objects.filter(subscription_id=sub.pk).exists()
    assert statuses(other) == before_other == ["Pending"] * 3
    # The messages stay for the other subscription (retention purges them later).
    assert Message.objects.filter(id__in=ids.values()).count() == 3


def test_it_waits_for_running_work_then_retires():
    sub = SubscriptionFactory()
    publish(sub.topic.name, {"n": 1})
    receiver = Receiver(sub.id)
    [running] = receiver.receive(1).deliveries
    finished = threading.Thread(
        target=lambda: (time.sleep(1.0), receiver.complete(running)), daemon=True
    )
    finished.start()

    out = retire(sub.name, "--wait-seconds", "20")

    finished.join()
    assert "Purged 1 settled deliveries." in out
    assert not Subscription.objects.filter(pk=sub.pk).exists()


def test_running_work_past_the_wait_leaves_it_disabled_and_says_so():
    sub = SubscriptionFactory()
    publish(sub.topic.name, {"n": 1})
    Receiver(sub.id).receive(1)

    with pytest.raises(CommandError, match=r"1 deliveries of .* were still running after 0\.3 s"):
        retire(sub.name, "--wait-seconds", "0.3")

    sub.refresh_from_db()
    assert sub.status == "Disabled"
    assert statuses(sub) == ["InFlight"]


def test_discards_made_before_the_wait_ran_out_are_reported_with_the_backlog_command():
    """Past --wait-seconds the command failed without saying it had discarded the Pending
    work (4 went from Pending to Discarded unmentioned), and its hint read `backlog -s NAME`."""
    sub = SubscriptionFactory()
    for n in range(3):
        publish(sub.topic.name, {"n": n})
    Receiver(sub.id).receive(1)
    out = io.StringIO()

    with pytest.raises(CommandError) as refused:
        call_command(
            "workqueue",
            "retire-subscription",
            sub.name,
            "--discard-pending",
            "--wait-seconds",
            "0.3",
            stdout=out,
        )

    assert "Discarded 2 Pending or dead-lettered deliveries." in out.getvalue()
    assert f"`manage.py workqueue backlog -s {sub.name}`" in str(refused.value)


def test_the_purge_of_a_disabled_subscription_deletes_only_settled_deliveries():
    """What keeps retiring from losing work silently is that the purge leaves every unsettled
    row, whatever its caller asked: no test ran it on a subscription still holding one
    (audit helper-106: a purge of dead letters too went unseen)."""
    sub = SubscriptionFactory()
    with_every_status(sub)
    publish(sub.topic.name, {"n": "another"})
    receiver = Receiver(sub.id)
    (running,) = receiver.receive(1).deliveries  # one of the two waiting: InFlight now
    Subscription.objects.filter(pk=sub.pk).update(status="Disabled")

    assert transport.retire_purge(str(sub.id), 100) == 1

    assert statuses(sub) == ["DeadLettered", "InFlight", "Pending"]
    assert receiver.complete(running).settled


def test_the_procedures_touch_nothing_of_a_subscription_that_is_not_disabled():
    sub = SubscriptionFactory()
    with_every_status(sub)

    assert transport.retire_discard(str(sub.id), "me", "why", 100) == 0
    assert transport.retire_purge(str(sub.id), 100) == 0
    assert statuses(sub) == ["Completed", "DeadLettered", "Pending"]
