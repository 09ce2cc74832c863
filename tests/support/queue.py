"""Queue states reached the way production reaches them: through publish, claim and settle."""

from __future__ import annotations

from typing import Any

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
