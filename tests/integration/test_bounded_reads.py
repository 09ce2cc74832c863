"""Operator and autoscaler reads cost what their caps and pages allow, never what the backlog
holds: ``wq_backlog`` clamps its cap (a NULL or huge cap from the scaler role is 1000) and walks
a bounded number of keys however many are blocked; ``wq_list_partitions`` walks keys one index
probe at a time up to a budget (handing back where it stopped) instead of aggregating every
open delivery before its LIMIT; ``wq_list_dead_letters`` clamps its page.

Deliveries are seeded with test-only SQL (fast and exact): tests/support/seeding.py.
"""

from __future__ import annotations

import re

import pytest
from django.core.management import call_command

from tests.factories import SubscriptionFactory
from tests.support.roles import connect_as, database_role
from tests.support.seeding import seed_deliveries
from workqueue.operators import operations

pytestmark = pytest.mark.usefixtures("queue_db")


@pytest.fixture
def scaler(pg_conn):
    with database_role(pg_conn, "wq_scaler") as role:
        call_command("workqueue", "grant-scaler", role)
        yield role


@pytest.mark.parametrize("cap", [None, 1_000_000])
def test_the_backlog_cap_is_clamped_inside_sql(pg_conn, scaler, cap):
    subscription = SubscriptionFactory()
    seed_deliveries(pg_conn, subscription, 1200, status="Pending")
    seed_deliveries(pg_conn, subscription, 1100, status="InFlight")

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
    seed_deliveries(
        pg_conn, subscription, BLOCKED_KEYS, status="InFlight", keys="'k' || lpad(g::text, 5)"
    )

    rows, steps = _next_open_key_calls(
        pg_conn, "SELECT claimable, in_flight FROM wq_backlog(%s, 10)", [subscription.id]
    )
    assert rows == [(0, 10)]
    assert steps <= 4 * 10 + 64 + 1, f"{steps} key steps for a cap of 10"


def test_listing_partitions_walks_a_bounded_number_of_keys_and_says_where_it_stopped(pg_conn):
    # Thousands of idle keys before the one in flight: the default listing (keys that are not
    # Idle) must not read them all in one call, yet paging on finds the busy key.
    subscription = SubscriptionFactory(partition_mode="Exclusive")
    seed_deliveries(
        pg_conn, subscription, BLOCKED_KEYS, status="Pending", keys="'k' || lpad(g::text, 5)"
    )
    seed_deliveries(pg_conn, subscription, 1, status="InFlight", keys="'zz'")

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
    seed_deliveries(pg_conn, subscription, 1500, status="Pending", keys="'hot'")
    seed_deliveries(pg_conn, subscription, 1, status="InFlight", keys="'hot'")

    [item] = operations.list_partitions(subscription.name).items
    assert (item.partition_key, item.condition, item.waiting_items) == ("hot", "InFlight", 1000)


@pytest.mark.parametrize("page_size", [None, 1_000_000])
def test_a_dead_letter_page_is_clamped_inside_sql(pg_conn, page_size):
    subscription = SubscriptionFactory()
    seed_deliveries(pg_conn, subscription, 1100, status="DeadLettered")

    rows = pg_conn.execute(
        "SELECT count(*) FROM wq_list_dead_letters(%s, NULL, %s)", [subscription.id, page_size]
    ).fetchone()
    assert rows == (1000,)


def test_a_bulk_discards_rows_are_not_read_past_the_cap_by_the_stats(pg_conn):
    """Review helper-131: the completions were counted up to the cap after the Discarded rows
    were passed over, so the hour after a bulk discard of a million deliveries every stats call
    (dashboard, REST) read all of them. The cap bounds the settled rows read."""
    subscription = SubscriptionFactory()
    seed_deliveries(pg_conn, subscription, 3000, status="Completed")
    pg_conn.execute(
        "UPDATE workqueue_delivery SET status = 'Discarded' WHERE subscription_id = %s",
        [subscription.id],
    )
    seed_deliveries(pg_conn, subscription, 2, status="Completed")
    pg_conn.execute("ANALYZE workqueue_delivery")

    stats = "SELECT * FROM wq_subscription_stats(%s, %s)"
    assert _most_rows_read(pg_conn, stats, [subscription.id, 100]) <= 100
    [row] = operations.subscription_stats(subscription.name, cap=100).subscriptions
    assert row.capped  # the completions are at least what they say
    [row] = operations.subscription_stats(subscription.name, cap=10_000).subscriptions
    assert (row.completed_last_hour, row.capped) == (2, False)


def test_stats_read_the_subscriptions_own_rows_up_to_the_cap(pg_conn):
    """Audit helper-96: the Pending count and the oldest Pending age were each a sequential scan
    of the whole delivery table, and the completions of the last hour a walk of every
    subscription's: a reader allowed one small subscription had all of them read, about half a
    second a call at a few million rows. Each count now walks the subscription's own index
    entries, up to the cap; the completions too since 0048 (they were counted among every
    subscription's newest cap, so beside a busier one the small one's read low, capped)."""
    busy, small = SubscriptionFactory(), SubscriptionFactory()
    for status in ("Pending", "Completed", "DeadLettered"):
        seed_deliveries(pg_conn, busy, 3000, status=status)
    seed_deliveries(pg_conn, small, 3, status="Pending")
    seed_deliveries(pg_conn, small, 2, status="Completed")
    pg_conn.execute("ANALYZE workqueue_delivery")

    stats = "SELECT * FROM wq_subscription_stats(%s, %s)"
    assert _most_rows_read(pg_conn, stats, [small.id, 100]) <= 100
    assert _most_rows_read(pg_conn, stats, [busy.id, 100]) <= 100

    [row] = operations.subscription_stats(small.name, cap=100).subscriptions
    assert (row.pending, row.completed_last_hour, row.capped) == (3, 2, False)
    [row] = operations.subscription_stats(small.name, cap=10_000).subscriptions
    assert (row.pending, row.completed_last_hour, row.capped) == (3, 2, False)
    [row] = operations.subscription_stats(busy.name, cap=100).subscriptions
    # Its own completions, up to the cap.
    assert (row.pending, row.dead_lettered, row.completed_last_hour, row.capped) == (
        100,
        100,
        100,
        True,
    )
    [row] = operations.subscription_stats(busy.name).subscriptions  # STATS_COUNT_CAP
    assert (row.pending, row.dead_lettered, row.completed_last_hour, row.capped) == (
        3000,
        3000,
        3000,
        False,
    )


def test_stats_and_gauges_of_a_subscription_with_nothing_pending_have_no_oldest_age(pg_conn):
    """Review helper-97: the gauges' age was GREATEST(age, 0), which PostgreSQL makes 0 when
    the age is NULL (nothing pending); stats, now read through them, said 0 instead of none
    (and SQL Server says NULL)."""
    idle = SubscriptionFactory()
    seed_deliveries(pg_conn, idle, 2, status="Completed")

    [row] = operations.subscription_stats(idle.name).subscriptions
    assert row.oldest_pending_age_seconds is None
    [(age,)] = pg_conn.execute(
        "SELECT oldest_pending_age_seconds FROM wq_queue_gauges(%s, 10)", [idle.id]
    ).fetchall()
    assert age is None
