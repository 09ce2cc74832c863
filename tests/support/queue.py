"""Queue states reached the way production reaches them: through publish, claim and settle."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import psycopg

from tests.support.database import psycopg_params
from workqueue import publish
from workqueue.models import Delivery, Subscription
from workqueue.transport import Receiver


def pending(subscription: Subscription, payload: Any = None, **fields: Any) -> str:
    """Publish one message to ``subscription``'s topic; the id of its Pending delivery there.
    ``fields`` are publish()'s keyword arguments."""
    if payload is None and "payload_ref" not in fields:
        payload = {"n": 1}
    result = publish(subscription.topic.name, payload, **fields)
    return str(Delivery.objects.get(message_id=result.message_id, subscription=subscription).pk)


def dead_letter(
    subscription: Subscription,
    payload: Any = None,
    *,
    reason: str = "Poison",
    error: str = "ValueError: boom",
    **fields: Any,
) -> str:
    """Publish one message, claim its delivery and dead-letter it with ``reason`` and
    ``error``; the delivery's id. ``fields`` are publish()'s keyword arguments."""
    delivery_id = pending(subscription, payload, **fields)
    receiver = Receiver(subscription.id)
    (claimed,) = receiver.receive(1).deliveries
    assert str(claimed.delivery_id) == delivery_id, "another delivery was waiting"
    assert receiver.dead_letter(claimed, reason, error).settled
    return delivery_id


@contextmanager
def row_held(delivery_id: str) -> Iterator[None]:
    """Hold delivery ``delivery_id``'s row locked in an open transaction of another session, as
    a handler completing it inside ``transaction.atomic()`` holds it until its block ends."""
    with psycopg.connect(**psycopg_params()) as holder:
        # Should the code under test wait for the row, the server ends this session after 8 s
        # instead of leaving the test hung on a lock it holds itself.
        holder.execute("SET idle_in_transaction_session_timeout = '8s'")
        holder.execute(
            "SELECT 1 FROM workqueue_delivery WHERE id = %s FOR UPDATE", [delivery_id]
        ).fetchone()
        yield
        with suppress(psycopg.OperationalError):
            holder.rollback()
