"""Bulk backlogs written with test-only SQL, past the procedures: fast and exact, for the tests
that measure what a read or a claim costs with many rows (a hundred thousand published one by
one would take minutes)."""

from __future__ import annotations

from typing import Any

import psycopg

STATUSES = ("Pending", "InFlight", "DeadLettered", "Completed")


def seed_deliveries(
    conn: psycopg.Connection,
    subscription: Any,
    count: int,
    *,
    status: str = "Pending",
    keys: str | None = None,
) -> None:
    """``count`` messages on ``subscription``'s topic, each with one delivery to it in
    ``status``, as the procedures would have left them: an InFlight row holds a live lease of
    another owner, a dead letter has its reason, a Completed row was completed just now, a
    Pending row has no attempt yet.

    ``keys`` is a SQL expression of ``g`` (1..count) giving each row's partition key, or None
    for none. Rows become visible in publish order, all in the past.
    """
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, not {status!r}")
    conn.execute(
        f"""
        WITH m AS (
            INSERT INTO workqueue_message (id, publish_ordinal, topic_id, partition_key,
                                           payload, published_at)
            SELECT gen_random_uuid(), nextval('wq_publish_ordinal_seq'), %(topic)s,
                   {keys or "NULL"}, '{{}}'::jsonb, now()
              FROM generate_series(1, %(count)s) g
            RETURNING id, publish_ordinal, partition_key
        )
        INSERT INTO workqueue_delivery (id, message_id, subscription_id, status, partition_key,
                                        order_key, attempt_count, is_replay, visible_at,
                                        lease_owner, lease_token, lease_expires_at,
                                        dead_letter_reason, dead_lettered_at, completed_at)
        SELECT gen_random_uuid(), m.id, %(sub)s, %(status)s::text, m.partition_key,
               m.publish_ordinal, CASE WHEN %(status)s::text = 'Pending' THEN 0 ELSE 1 END,
               false, now() - interval '1 hour' + m.publish_ordinal * interval '1 microsecond',
               CASE WHEN %(status)s::text = 'InFlight' THEN 'elsewhere' END,
               CASE WHEN %(status)s::text = 'InFlight' THEN gen_random_uuid() END,
               CASE WHEN %(status)s::text = 'InFlight' THEN now() + interval '1 hour' END,
               CASE WHEN %(status)s::text = 'DeadLettered' THEN 'Poison' END,
               CASE WHEN %(status)s::text = 'DeadLettered' THEN now() END,
               CASE WHEN %(status)s::text = 'Completed' THEN now() END
          FROM m
        """,
        {"topic": subscription.topic_id, "sub": subscription.id, "count": count, "status": status},
    )
