"""A publish's fan-out reads the topic's subscriptions as they stand when its statement runs,
not when its transaction commits (helper-148). A publish still open in its transaction when a
subscription is disabled gives that subscription its delivery all the same, and one enabled
meanwhile gets none from it; only the changes that would break an Ordered key's order wait for
publishes in progress (tests/integration/test_safety.py). Nothing is lost either way: the
delivery of a Disabled subscription waits, claimed by no one, until it is enabled again (or
retire-subscription, which stops and asks to be run again, discards it).
"""

from __future__ import annotations

import threading
import uuid

import psycopg
import pytest
from django.db import connections

from tests.factories import SubscriptionFactory, TopicFactory
from tests.support.database import psycopg_params
from workqueue.models import Delivery
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")


def _save_in_a_thread(subscription, status: str) -> threading.Thread:
    def save() -> None:
        subscription.status = status
        subscription.save()
        connections.close_all()

    thread = threading.Thread(target=save, daemon=True)
    thread.start()
    return thread


def test_a_publish_open_across_a_status_change_fans_out_as_its_statement_saw_the_subscriptions():
    topic = TopicFactory()
    disabled_meanwhile = SubscriptionFactory(topic=topic, partition_mode="Exclusive")
    enabled_meanwhile = SubscriptionFactory(topic=topic, status="Disabled")
    message_id = uuid.uuid4()

    with psycopg.connect(**psycopg_params()) as publisher:  # a transaction until commit()
        (status,) = publisher.execute(
            "SELECT status FROM wq_publish(%s, %s, 'k', NULL, '{}'::jsonb, NULL, NULL, NULL,"
            " NULL, 10, false, 'app', NULL, NULL, 0, NULL)",
            (topic.name, message_id),
        ).fetchone()
        assert status == "Accepted"
        # Neither change waits for the open publish.
        changes = [
            _save_in_a_thread(disabled_meanwhile, "Disabled"),
            _save_in_a_thread(enabled_meanwhile, "Active"),
        ]
        for change in changes:
            change.join(10)
            assert not change.is_alive(), "a status change waited for the open publish"
        publisher.commit()

    (delivery,) = Delivery.objects.filter(message_id=message_id)
    assert (delivery.subscription_id, delivery.status) == (disabled_meanwhile.id, "Pending")
    # Disabled at the commit: it waits, claimed by no one, until the subscription is enabled.
    receiver = Receiver(disabled_meanwhile.id)
    assert receiver.receive(10).deliveries == []
    _save_in_a_thread(disabled_meanwhile, "Active").join(10)
    (claimed,) = receiver.receive(10).deliveries
    assert claimed.message_id == str(message_id)
    assert Receiver(enabled_meanwhile.id).receive(10).deliveries == []
