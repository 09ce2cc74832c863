"""Claim cost must not grow with the backlog: with 100k pending deliveries, the statements inside
the hot procedures use the partial indexes, never a sequential scan of the delivery table.

auto_explain logs the plan of every statement nested in a procedure; the logs reach the client
as notices, so the test reads the plans PostgreSQL actually chose.
"""

from __future__ import annotations

import re
import uuid

import pytest

from tests.factories import SubscriptionFactory, TopicFactory
from tests.support.seeding import seed_deliveries
from workqueue.driver import get_driver
from workqueue.driver.procedures import get_procedure

pytestmark = pytest.mark.usefixtures("queue_db")

BACKLOG = 100_000


def _nested_plans(pg_conn, procedure: str, params: dict, analyze: bool = False) -> str:
    notices: list[str] = []
    pg_conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
    pg_conn.execute("LOAD 'auto_explain'")
    for setting in (
        "auto_explain.log_min_duration = 0",
        "auto_explain.log_nested_statements = on",
        f"auto_explain.log_analyze = {'on' if analyze else 'off'}",
        "client_min_messages = log",
    ):
        pg_conn.execute(f"SET {setting}")
    driver = get_driver()
    proc = get_procedure(procedure)
    values = [driver.adapt(p, params.get(p.name)) for p in proc.params]
    pg_conn.execute(driver.render_call(proc), values).fetchall()
    pg_conn.execute("SET client_min_messages = notice")
    return "\n".join(notices)


def test_hot_paths_use_indexes_with_a_large_backlog(pg_conn):
    # One table holding 100k pending deliveries for each partition mode: for any one
    # subscription, the other two thirds of the rows stand in for the rest of a live queue.
    subscriptions = {
        mode: SubscriptionFactory(topic=TopicFactory(), partition_mode=mode)
        for mode in ("None", "Exclusive", "Ordered")
    }
    for mode, subscription in subscriptions.items():
        seed_deliveries(
            pg_conn, subscription, BACKLOG, keys="'k' || mod(g, 500)" if mode != "None" else None
        )
    pg_conn.execute("ANALYZE workqueue_delivery")
    pg_conn.execute("ANALYZE workqueue_message")

    for mode, subscription in subscriptions.items():
        params = {
            "subscription_id": subscription.id,
            "lease_owner": "plan-test",
            "max_rows": 100,
            "delivery_id": str(uuid.uuid4()),
            "lease_token": str(uuid.uuid4()),
            "batch_size": 500,
        }
        # The per-delivery paths. (Stats and backlog count rows, so their cost follows the
        # counted rows by nature; the planner may rightly scan for them.)
        for procedure in ("wq_claim", "wq_extend_lease", "wq_complete", "wq_expire_leases"):
            plans = _nested_plans(pg_conn, procedure, params)
            assert "workqueue_delivery" in plans, f"{mode} {procedure}: no nested plan logged"
            assert "Seq Scan on workqueue_delivery" not in plans, f"{mode} {procedure}:\n{plans}"

        claimed = pg_conn.execute(
            "SELECT count(*) FROM workqueue_delivery WHERE subscription_id = %s "
            "AND status = 'InFlight'",
            [subscription.id],
        ).fetchone()[0]
        assert claimed == 100, mode


HOT_BACKLOG = 20_000


def _rows_read(plans: str) -> list[int]:
    """Rows each plan node returned, and rows it read only to throw away."""
    returned = re.findall(r"actual time=[\d.]+\.\.[\d.]+ rows=(\d+) loops=(\d+)", plans)
    discarded = re.findall(r"Rows Removed by (?:Filter|Index Recheck): (\d+)", plans)
    return [int(rows) * int(loops) for rows, loops in returned] + [int(n) for n in discarded]


def _seed_hot_key(pg_conn, subscription, head_status: str) -> None:
    """HOT_BACKLOG deliveries of key 'hot' (the oldest rows, its head in ``head_status``), then
    one Pending delivery for each of 50 other keys."""
    seed_deliveries(pg_conn, subscription, HOT_BACKLOG, keys="'hot'")
    seed_deliveries(pg_conn, subscription, 50, keys="'k' || g")
    leased = head_status == "InFlight"
    pg_conn.execute(
        "UPDATE workqueue_delivery SET status = %(status)s, attempt_count = 1, "
        "lease_owner = %(owner)s, lease_token = %(token)s, "
        "lease_expires_at = now() + %(lease)s * interval '1 hour', "
        "dead_letter_reason = %(reason)s, dead_lettered_at = %(dead_lettered_at)s "
        "WHERE id = (SELECT id FROM workqueue_delivery WHERE subscription_id = %(sub)s "
        "AND partition_key = 'hot' ORDER BY order_key LIMIT 1)",
        {
            "status": head_status,
            "sub": subscription.id,
            "owner": "elsewhere" if leased else None,
            "token": uuid.uuid4() if leased else None,
            "lease": 1 if leased else None,
            "reason": None if leased else "Poison",
            "dead_lettered_at": None if leased else "now",
        },
    )


@pytest.mark.parametrize(
    ("mode", "head_status"), [("Exclusive", "InFlight"), ("Ordered", "DeadLettered")]
)
def test_a_hot_keys_blocked_backlog_is_not_read_by_claims(pg_conn, mode, head_status):
    # Statistics taken while the table was small, then a burst: the planner believes the new
    # subscription has about one row, which is when a wrong index choice would hurt most.
    SubscriptionFactory(topic=TopicFactory(), partition_mode=mode)
    pg_conn.execute("ANALYZE workqueue_delivery")
    subscription = SubscriptionFactory(topic=TopicFactory(), partition_mode=mode)
    _seed_hot_key(pg_conn, subscription, head_status)

    params = {"subscription_id": subscription.id, "lease_owner": "plan-test", "max_rows": 8}
    plans = _nested_plans(pg_conn, "wq_claim", params, analyze=True)

    assert "Seq Scan on workqueue_delivery" not in plans, plans
    rows_read = _rows_read(plans)
    assert rows_read, plans
    # The whole claim reads a window of rows and a few index entries per key, never the backlog.
    assert max(rows_read) < 200, plans
    claimed = pg_conn.execute(
        "SELECT count(*), count(*) FILTER (WHERE partition_key = 'hot') FROM workqueue_delivery "
        "WHERE subscription_id = %s AND status = 'InFlight' AND lease_owner = 'plan-test'",
        [subscription.id],
    ).fetchone()
    assert claimed == (8, 0), mode

    # The operators' and autoscaler's count walks keys the same way: the hot key is one step.
    plans = _nested_plans(pg_conn, "wq_backlog", {**params, "cap": 1000}, analyze=True)
    assert "Seq Scan on workqueue_delivery" not in plans, plans
    assert max(_rows_read(plans)) < 200, plans
    backlog = pg_conn.execute(
        "SELECT claimable, in_flight FROM wq_backlog(%s, 1000)", [subscription.id]
    ).fetchone()
    assert backlog == (42, 8 + (head_status == "InFlight")), mode
