"""Queue states reached the way production reaches them: through publish, claim and settle;
and a publish whose answer is lost after it committed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import psycopg
import pytest

from tests.support.database import psycopg_params
from workqueue import publish
from workqueue.driver import get_driver
from workqueue.exceptions import TransientDriverError
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


def answers_lost_once(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The driver's next publish commits, then its connection drops before the answer comes
    back (a transient error); the publishes it was sent, by procedure."""
    driver = get_driver()
    original = driver.publish
    calls: list[str] = []

    def answer_lost(name: str, params: Any = None, **kwargs: Any) -> Any:
        calls.append(name)
        rows = original(name, params, **kwargs)
        if len(calls) == 1:
            raise TransientDriverError("server closed the connection unexpectedly (test)")
        return rows

    monkeypatch.setattr(driver, "publish", answer_lost)
    return calls
