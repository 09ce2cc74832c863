"""Operator and autoscaler reads cost what their caps and pages allow, never what the backlog
holds: ``wq_backlog`` clamps its cap (a NULL or huge cap from the scaler role is 1000) and walks
a bounded number of keys however many are blocked; ``wq_list_partitions`` walks keys one index
probe at a time up to a budget (handing back where it stopped) instead of aggregating every
open delivery before its LIMIT; ``wq_list_dead_letters`` clamps its page.

Deliveries are seeded with test-only SQL (fast and exact), as in test_query_plans.py.
"""

from __future__ import annotations

import re

import pytest
from django.core.management import call_command

from tests.factories import SubscriptionFactory
from tests.roles import connect_as, database_role
from workqueue.operators import operations

pytestmark = pytest.mark.usefixtures("queue_db")


def _seed(pg_conn, subscription, count: int, *, status: str, keys: str | None) -> None:
    """``count`` deliveries in ``status``; ``keys`` is a SQL expression of g (or None)."""
    key = keys or "NULL"
    pg_conn.execute(
        f"""
        WITH m AS (
            INSERT INTO workqueue_message (id, publish_ordinal, topic_id, partition_key,
                                           payload, published_at)
            SELECT gen_random_uuid(), nextval('wq_publish_ordinal_seq'), %(topic)s, {key},
                   '{{}}'::jsonb, now()
              FROM generate_series(1, %(count)s) g
            RETURNING id, publish_ordinal, partition_key
        )
        INSERT INTO workqueue_delivery (id, message_id, subscription_id, status, partition_key,
                                        order_key, attempt_count, is_replay, visible_at,
                                        lease_owner, lease_token, lease_expires_at,
                                        dead_letter_reason, dead_lettered_at)
        SELECT gen_random_uuid(), m.id, %(sub)s, %(status)s::text, m.partition_key,
               m.publish_ordinal, 1, false, now() - interval '1 minute',
               CASE WHEN %(status)s::text = 'InFlight' THEN 'elsewhere' END,
               CASE WHEN %(status)s::text = 'InFlight' THEN gen_random_uuid() END,
               CASE WHEN %(status)s::text = 'InFlight' THEN now() + interval '1 hour' END,
               CASE WHEN %(status)s::text = 'DeadLettered' THEN 'Poison' END,
               CASE WHEN %(status)s::text = 'DeadLettered' THEN now() END
          FROM m
        """,
        {"topic": subscription.topic_id, "sub": subscription.id, "count": count, "status": status},
    )


@pytest.fixture
def scaler(pg_conn):
    with database_role(pg_conn, "wq_scaler") as role:
        call_command("workqueue", "grant-scaler", role)
        yield role


@pytest.mark.parametrize("cap", [None, 1_000_000])
def test_the_backlog_cap_is_clamped_inside_sql(pg_conn, scaler, cap):
    subscription = SubscriptionFactory()
    _seed(pg_conn, subscription, 1200, status="Pending", keys=None)
    _seed(pg_conn, subscription, 1100, status="InFlight", keys=None)

    with connect_as(scaler) as conn:
        row = conn.execute(
            "SELECT claimable, in_flight FROM wq_backlog(%s, %s)", [subscription.id, cap]
        ).fetchone()
    assert row == (1000, 1000)


def _next_open_key_calls(pg_conn, sql: str, params: list) -> tuple[list, int]:
    """Run ``sql`` in a transaction that counts calls of wq_next_open_key (one per key step)."""
    with pg_conn.transaction():
        pg_conn.execute("SET LOCAL track_functions = 'pl'")
        rows = pg_conn.execute(sql, params).fetchall()
        [(calls,)] = pg_conn.execute(
            "SELECT coalesce(sum(calls), 0) FROM pg_stat_xact_user_functions "
            "WHERE funcname = 'wq_next_open_key'"
        ).fetchall()
    return rows, int(calls)


def _most_rows_read(pg_conn, sql: str, params: list) -> int:
    """The most rows any plan node of any statement inside ``sql`` returned or threw away
    (auto_explain logs the nested statements' plans as notices)."""
    notices: list[str] = []
    pg_conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
    pg_conn.execute("LOAD 'auto_explain'")
    for setting in (
        "auto_explain.log_min_duration = 0",
        "auto_explain.log_nested_statements = on",
        "auto_explain.log_analyze = on",
        "client_min_messages = log",
    ):
        pg_conn.execute(f"SET {setting}")
    try:
        pg_conn.execute(sql, params).fetchall()
    finally:
        pg_conn.execute("SET client_min_messages = notice")
        pg_conn.execute("SET auto_explain.log_min_duration = -1")
    plans = "\n".join(notices)
    returned = re.findall(r"actual time=[\d.]+\.\.[\d.]+ rows=(\d+) loops=(\d+)", plans)
    discarded = re.findall(r"Rows Removed by (?:Filter|Index Recheck): (\d+)", plans)
    counts = [int(r) * int(n) for r, n in returned] + [int(n) for n in discarded]
    assert counts, "no nested plan was logged"
    return max(counts)


BLOCKED_KEYS = 5000


def test_the_backlog_walks_a_bounded_number_of_blocked_keys(pg_conn):
    # Exclusive keys whose head is in flight cannot be claimed: each costs a step of the walk
    # and adds nothing to the count, so only a step budget ends the walk before the last key.
    subscription = SubscriptionFactory(partition_mode="Exclusive")
    _seed(pg_conn, subscription, BLOCKED_KEYS, status="InFlight", keys="'k' || lpad(g::text, 5)")

    rows, steps = _next_open_key_calls(
        pg_conn, "SELECT claimable, in_flight FROM wq_backlog(%s, 10)", [subscription.id]
    )
    assert rows == [(0, 10)]
    assert steps <= 4 * 10 + 64 + 1, f"{steps} key steps for a cap of 10"


def test_listing_partitions_walks_a_bounded_number_of_keys_and_says_where_it_stopped(pg_conn):
    # Thousands of idle keys before the one in flight: the default listing (keys that are not
    # Idle) must not read them all in one call, yet paging on finds the busy key.
    subscription = SubscriptionFactory(partition_mode="Exclusive")
    _seed(pg_conn, subscription, BLOCKED_KEYS, status="Pending", keys="'k' || lpad(g::text, 5)")
    _seed(pg_conn, subscription, 1, status="InFlight", keys="'zz'")

    listing = "SELECT * FROM wq_list_partitions(%s, NULL, NULL, 11)"
    assert _most_rows_read(pg_conn, listing, [subscription.id]) < 200
    first, steps = _next_open_key_calls(pg_conn, listing, [subscription.id])
    assert steps <= 4 * 11 + 64 + 1, f"{steps} key steps for a page of 11"
    assert "zz" not in [row[1] for row in first]

    pages, cursor, found = 0, None, []
    while True:
        page = operations.list_partitions(subscription.name, cursor=cursor, page_size=10)
        pages, found, cursor = pages + 1, found + page.items, page.next_cursor
        if cursor is None:
            break
    assert [(p.partition_key, p.condition) for p in found] == [("zz", "InFlight")]
    assert pages > 1


def test_waiting_items_are_counted_among_a_keys_oldest_1000_open_deliveries(pg_conn):
    subscription = SubscriptionFactory(partition_mode="Exclusive")
    _seed(pg_conn, subscription, 1500, status="Pending", keys="'hot'")
    _seed(pg_conn, subscription, 1, status="InFlight", keys="'hot'")

    [item] = operations.list_partitions(subscription.name).items
    assert (item.partition_key, item.condition, item.waiting_items) == ("hot", "InFlight", 1000)


@pytest.mark.parametrize("page_size", [None, 1_000_000])
def test_a_dead_letter_page_is_clamped_inside_sql(pg_conn, page_size):
    subscription = SubscriptionFactory()
    _seed(pg_conn, subscription, 1100, status="DeadLettered", keys=None)

    rows = pg_conn.execute(
        "SELECT count(*) FROM wq_list_dead_letters(%s, NULL, %s)", [subscription.id, page_size]
    ).fetchone()
    assert rows == (1000,)
