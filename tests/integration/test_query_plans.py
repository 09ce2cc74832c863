"""Claim cost must not grow with the backlog: with 100k pending deliveries, the statements inside
the hot procedures use the partial indexes, never a sequential scan of the delivery table. And
a fan-out pays for filters only where a subscription has one.

auto_explain logs the plan of every statement nested in a procedure; the logs reach the client
as notices, so the test reads the plans PostgreSQL actually chose.
"""

from __future__ import annotations

import json
import re
import uuid

import pytest
from django.db import connection

from tests.factories import SubscriptionFactory, TopicFactory
from tests.support.filter_cases import leaf, root
from tests.support.seeding import seed_deliveries
from workqueue.driver import get_driver
from workqueue.driver.base import QUEUE_TABLES
from workqueue.driver.procedures import get_procedure
from workqueue.models import TaskResult
from workqueue.tasks.messages import HANDLER_KEY

pytestmark = pytest.mark.usefixtures("queue_db", "truncated_queue_tables")

BACKLOG = 100_000


def _call(pg_conn, procedure: str, params: dict) -> list:
    """Call ``procedure`` on ``pg_conn`` as the driver renders the call; its rows, undecoded."""
    driver = get_driver()
    proc = get_procedure(procedure)
    values = [driver.adapt(p, params.get(p.name)) for p in proc.params]
    return pg_conn.execute(driver.render_call(proc), values).fetchall()


def _nested_plans(
    pg_conn,
    procedure: str,
    params: dict,
    analyze: bool = False,
    buffers: bool = False,
    verbose: bool = False,
) -> str:
    notices: list[str] = []
    pg_conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
    pg_conn.execute("LOAD 'auto_explain'")
    for setting in (
        "auto_explain.log_min_duration = 0",
        "auto_explain.log_nested_statements = on",
        f"auto_explain.log_analyze = {'on' if analyze else 'off'}",
        f"auto_explain.log_buffers = {'on' if buffers else 'off'}",
        f"auto_explain.log_verbose = {'on' if verbose else 'off'}",
        "client_min_messages = log",
    ):
        pg_conn.execute(f"SET {setting}")
    _call(pg_conn, procedure, params)
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


def test_a_subscription_owning_the_table_claims_through_its_index_call_after_call(pg_conn):
    # wq_claim keeps one plan per session, costed without the batch size: with a single
    # subscription owning every row, a sequential scan and a sort must not look cheaper.
    subscription = SubscriptionFactory(topic=TopicFactory())
    seed_deliveries(pg_conn, subscription, 20_000)
    # Due times in no particular order on disk (delays, retries), which is what makes the
    # claim index look dear to a plan costed for a tenth of the rows.
    pg_conn.execute(
        "UPDATE workqueue_delivery SET visible_at = now() - random() * interval '1 hour'"
    )
    pg_conn.execute("ANALYZE workqueue_delivery")
    pg_conn.execute("ANALYZE workqueue_message")
    # Index reads priced far above a sequential scan, so that any plan free to scan takes it
    # (a churned table's scattered heap did the same to a generic plan in the drain benchmark,
    # which this test could not reproduce at a test's size): the claim must still read its
    # index. Seen failing with `SET enable_seqscan = off` taken off wq_claim.
    pg_conn.execute("SET random_page_cost = 1000")
    params = {"subscription_id": subscription.id, "lease_owner": "plan-test", "max_rows": 8}

    for call in range(8):  # past the five custom plans PostgreSQL makes before a generic one
        plans = _nested_plans(pg_conn, "wq_claim", params)
        assert "Seq Scan on workqueue_delivery" not in plans, f"call {call + 1}:\n{plans}"


def test_batched_completions_probe_each_row_by_primary_key_call_after_call(pg_conn):
    # Statistics taken before a burst of claims: the planner believes nothing is InFlight, and
    # a plan free to read wq_dlv_open_ix (or wq_dlv_lease_ix) for the status fence would read
    # every InFlight row of every subscription on every call. wq_complete_many keeps one plan
    # per session, so it must be a probe of the primary key per item from the first call on.
    # Seen failing with the status fence compared with the literal 'InFlight' (custom plans
    # and-ed the primary key with wq_dlv_open_ix and read all 20,000 entries).
    subscription = SubscriptionFactory(topic=TopicFactory())
    seed_deliveries(pg_conn, subscription, 20_000)
    pg_conn.execute("ANALYZE workqueue_delivery")
    pg_conn.execute(
        "UPDATE workqueue_delivery SET status = 'InFlight', attempt_count = 1, "
        "lease_owner = 'elsewhere', lease_token = gen_random_uuid(), "
        "lease_expires_at = now() + interval '1 hour' WHERE subscription_id = %s",
        [subscription.id],
    )
    held = pg_conn.execute(
        "SELECT id::text, lease_token::text FROM workqueue_delivery WHERE subscription_id = %s "
        "ORDER BY id LIMIT 17",
        [subscription.id],
    ).fetchall()
    stale = held.pop()

    for call in range(8):  # past the five custom plans PostgreSQL makes before a generic one
        # Two held deliveries each call (completed), and one stale token (left alone).
        batch = held[2 * call : 2 * call + 2]
        items = [{"delivery_id": d, "lease_token": t} for d, t in batch]
        items.append({"delivery_id": stale[0], "lease_token": str(uuid.uuid4())})
        plans = _nested_plans(pg_conn, "wq_complete_many", {"items": items}, analyze=True)
        assert "workqueue_delivery_pkey" in plans, f"call {call + 1}:\n{plans}"
        assert max(_rows_read(plans)) <= len(items), f"call {call + 1}:\n{plans}"
        completed = pg_conn.execute(
            "SELECT count(*) FROM workqueue_delivery WHERE id = ANY (%s::uuid[]) "
            "AND status = 'Completed'",
            [[d for d, _ in batch]],
        ).fetchone()[0]
        assert completed == 2, f"call {call + 1}"
    [(stale_status,)] = pg_conn.execute(
        "SELECT status FROM workqueue_delivery WHERE id = %s", [stale[0]]
    ).fetchall()
    assert stale_status == "InFlight"


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


SCHEDULED_BACKLOG = 100_000


def _seed_scheduled(pg_conn, subscription, keyed: bool) -> None:
    """SCHEDULED_BACKLOG Pending deliveries due tomorrow, spread over all 201 priorities, and
    20 due now with priorities -10, -9, ... 9 (published in that order)."""
    key = "'k' || g" if keyed else "NULL"
    pg_conn.execute(
        f"""
        WITH m AS (
            INSERT INTO workqueue_message (id, publish_ordinal, topic_id, partition_key,
                                           payload, published_at)
            SELECT gen_random_uuid(), nextval('wq_publish_ordinal_seq'), %(topic)s, {key},
                   '{{}}'::jsonb, now()
              FROM generate_series(1, %(n)s + 20) g
            RETURNING id, publish_ordinal, partition_key
        ), r AS (
            SELECT m.*, row_number() OVER (ORDER BY m.publish_ordinal) AS g FROM m
        )
        INSERT INTO workqueue_delivery (id, message_id, subscription_id, status, partition_key,
                                        order_key, attempt_count, is_replay, visible_at,
                                        priority)
        SELECT gen_random_uuid(), r.id, %(sub)s, 'Pending', r.partition_key, r.publish_ordinal,
               0, false,
               CASE WHEN r.g <= %(n)s THEN now() + interval '1 day'
                    ELSE now() - interval '1 minute' + (r.g - %(n)s) * interval '1 ms' END,
               CASE WHEN r.g <= %(n)s THEN r.g %% 201 - 100 ELSE r.g - %(n)s - 11 END
          FROM r
        """,
        {"topic": subscription.topic_id, "sub": subscription.id, "n": SCHEDULED_BACKLOG},
    )


@pytest.mark.parametrize("mode", ["None", "Exclusive", "Ordered"])
def test_claims_read_only_due_rows_by_priority_whatever_is_scheduled(pg_conn, mode):
    # Statistics from before the burst, as in the hot-key test above.
    SubscriptionFactory(topic=TopicFactory(), partition_mode=mode)
    pg_conn.execute("ANALYZE workqueue_delivery")
    subscription = SubscriptionFactory(topic=TopicFactory(), partition_mode=mode)
    _seed_scheduled(pg_conn, subscription, keyed=mode != "None")

    params = {"subscription_id": subscription.id, "lease_owner": "plan-test", "max_rows": 10}
    plans = _nested_plans(pg_conn, "wq_claim", params, analyze=True, buffers=True)

    assert "Seq Scan on workqueue_delivery" not in plans, plans
    # Index entries skipped inside a scan are not counted as rows: the pages each statement
    # touched are (a scan through the scheduled rows' index entries touches hundreds).
    assert max(_pages_touched(plans)) < 50, plans
    index = "wq_dlv_claim_keyed_pri_ix" if mode != "None" else "wq_dlv_claim_keyless_pri_ix"
    # Each priority present is found by one probe that never visits the table.
    assert f"Index Only Scan Backward using {index}" in plans, plans
    # Visiting every priority present (all 201) costs a few entries each; the 100k rows
    # scheduled for tomorrow are never read.
    assert max(_rows_read(plans)) < 500, plans
    claimed = pg_conn.execute(
        "SELECT array_agg(priority::integer ORDER BY priority DESC) FROM workqueue_delivery "
        "WHERE subscription_id = %s AND status = 'InFlight'",
        [subscription.id],
    ).fetchone()[0]
    assert claimed == list(range(9, -1, -1)), mode

    plans = _nested_plans(
        pg_conn, "wq_backlog", {**params, "cap": 1000}, analyze=True, buffers=True
    )
    assert "Seq Scan on workqueue_delivery" not in plans, plans
    backlog = pg_conn.execute(
        "SELECT claimable, in_flight FROM wq_backlog(%s, 1000)", [subscription.id]
    ).fetchone()
    assert backlog == (10, 10), mode
    if mode == "None":
        # (Exclusive's count walks the keys, so it reads as many as its cap allows.)
        assert max(_pages_touched(plans)) < 50, plans


@pytest.mark.parametrize("mode", ["Exclusive", "Ordered"])
def test_a_claim_takes_keys_and_keyless_rows_by_priority_reading_only_due_rows(pg_conn, mode):
    # Both kinds scheduled for tomorrow over all 201 priorities, and due now at -10..9: the
    # claim interleaves them by priority and reads neither kind's scheduled rows.
    SubscriptionFactory(topic=TopicFactory(), partition_mode=mode)
    pg_conn.execute("ANALYZE workqueue_delivery")
    subscription = SubscriptionFactory(topic=TopicFactory(), partition_mode=mode)
    _seed_scheduled(pg_conn, subscription, keyed=True)
    _seed_scheduled(pg_conn, subscription, keyed=False)

    params = {"subscription_id": subscription.id, "lease_owner": "plan-test", "max_rows": 10}
    plans = _nested_plans(pg_conn, "wq_claim", params, analyze=True, buffers=True)

    assert "Seq Scan on workqueue_delivery" not in plans, plans
    assert max(_pages_touched(plans)) < 50, plans
    assert max(_rows_read(plans)) < 500, plans
    claimed = pg_conn.execute(
        "SELECT array_agg(priority::integer ORDER BY priority DESC), count(partition_key) "
        "FROM workqueue_delivery WHERE subscription_id = %s AND status = 'InFlight'",
        [subscription.id],
    ).fetchone()
    assert claimed == ([9, 9, 8, 8, 7, 7, 6, 6, 5, 5], 5), mode


def _pages_touched(plans: str) -> list[int]:
    """Buffer pages each statement inside the procedure touched (hit, read or dirtied); the
    logged plan of the procedure call itself, which adds up all of them, is left out."""
    touched = []
    for plan in plans.split("duration: ")[1:]:
        if re.search(r"Query Text: SELECT .* FROM wq_\w+\(", plan):
            continue
        touched.append(
            max(
                (
                    sum(int(n) for n in re.findall(r"=(\d+)", line))
                    for line in re.findall(r"Buffers: shared ([^\n]*)", plan)
                ),
                default=0,
            )
        )
    return touched


def test_operator_reads_of_a_large_prioritised_backlog_stay_bounded(pg_conn):
    # The metrics gauges and a bulk discard of waiting work walk the claim indexes (ordered by
    # priority first): with 100k waiting rows over 21 priorities, neither may read its way
    # through the backlog.
    subscription, other = (SubscriptionFactory(topic=TopicFactory()) for _ in range(2))
    seed_deliveries(pg_conn, subscription, BACKLOG)
    seed_deliveries(pg_conn, other, BACKLOG, keys="'k' || mod(g, 500)")  # the rest of a queue
    pg_conn.execute("UPDATE workqueue_delivery SET priority = mod(order_key, 21) - 10")
    pg_conn.execute("ANALYZE workqueue_delivery")
    walks = {
        "wq_queue_gauges": {"subscription_id": subscription.id, "cap": 1000},
        "wq_discard_pending": {
            "subscription_id": subscription.id,
            "keyed": False,
            "batch_size": 500,
            "dry_run": True,
            "reason": "plan test",
        },
    }
    for procedure, params in walks.items():
        plans = _nested_plans(pg_conn, procedure, params, analyze=True)
        assert "Seq Scan on workqueue_delivery" not in plans, f"{procedure}:\n{plans}"
        assert max(_rows_read(plans)) <= 1100, f"{procedure} read too much:\n{plans}"


def test_a_purge_batch_reads_what_it_purges_not_what_longer_retentions_keep(pg_conn):
    """Audit helper-130: the purge read every subscription's settled deliveries in one order of
    age from the shortest retention's cutoff, keeping those past their own topic's: beside a
    topic of a longer retention, every batch read all that topic still keeps (20,010 rows
    returned and 40,010 thrown away to delete 10), and fell behind as that history grew."""
    kept = SubscriptionFactory(topic=TopicFactory(retention_days=30))
    purged = SubscriptionFactory(topic=TopicFactory(retention_days=1))
    seed_deliveries(pg_conn, kept, 20_000, status="Completed")
    seed_deliveries(pg_conn, purged, 10, status="Completed")
    for subscription in (kept, purged):  # two days on: past one retention, well within the other
        get_driver().shift_time(2 * 86_400, subscription_id=str(subscription.id))
    pg_conn.execute("ANALYZE workqueue_delivery")

    plans = _nested_plans(
        pg_conn, "wq_purge_terminal_deliveries", {"batch_size": 1000}, analyze=True
    )

    assert max(_rows_read(plans)) <= 1000, plans
    left = dict(
        pg_conn.execute(
            "SELECT subscription_id, count(*) FROM workqueue_delivery GROUP BY 1"
        ).fetchall()
    )
    assert left == {kept.id: 20_000}


def test_a_subscriptions_completions_are_counted_among_its_own(pg_conn):
    """Its completions of the last hour were counted among the newest ``cap`` of every
    subscription's: beside a busier one, a subscription's count read 0 (capped) however many
    it had completed, and a caller reading one small subscription had the busy one's read."""
    small, busy = (SubscriptionFactory(topic=TopicFactory()) for _ in range(2))
    seed_deliveries(pg_conn, small, 30, status="Completed")
    seed_deliveries(pg_conn, busy, 20_000, status="Completed")
    pg_conn.execute("ANALYZE workqueue_delivery")
    params = {"subscription_id": small.id, "cap": 1000}

    plans = _nested_plans(pg_conn, "wq_subscription_stats", params, analyze=True)
    [row] = _call(pg_conn, "wq_subscription_stats", params)

    assert max(_rows_read(plans)) <= 1000, plans
    assert (row[5], row[7]) == (30, False)  # completed_last_hour, capped


def test_a_bulk_discard_batch_past_the_start_reads_its_batch_not_the_rest_of_the_backlog(pg_conn):
    """Audit helper-96: a batch ordered by (priority, visible_at, id), which the claim index
    cannot give, so each one past the first read and sorted every row after its cursor: a bulk
    discard of a million waiting deliveries ran a thousand batches, quadratic (191 s for a dry
    run). A batch now reads the range of due times its rows fill."""
    subscription = SubscriptionFactory()
    seed_deliveries(pg_conn, subscription, 20_000)
    pg_conn.execute("ANALYZE workqueue_delivery")
    [(priority, visible_at, delivery_id)] = pg_conn.execute(
        "SELECT priority, visible_at, id FROM workqueue_delivery WHERE subscription_id = %s "
        "ORDER BY priority, visible_at, id OFFSET 5000 LIMIT 1",
        [subscription.id],
    ).fetchall()
    params = {
        "subscription_id": subscription.id,
        "keyed": False,
        "after_priority": priority,
        "after_visible_at": visible_at,
        "after_delivery_id": delivery_id,
        "batch_size": 500,
        "dry_run": True,
        "reason": "plan test",
    }

    plans = _nested_plans(pg_conn, "wq_discard_pending", params, analyze=True)

    assert max(_rows_read(plans)) <= 1100, plans
    [(examined, changed, *_)] = _call(pg_conn, "wq_discard_pending", params)
    assert (examined, changed) == (500, 500)


def test_a_batch_publish_reads_no_stored_message_after_the_table_grows(pg_conn):
    # A long-lived publisher starts while the message table is small and keeps its plans for
    # the session; then the table grows (a burst, before autovacuum analyzes it). The batch's
    # results must not read the table: only an item whose id was taken looks up the stored
    # message, by primary key. Seen failing with the results as a join on the message table:
    # the plan cached on the small table hashed all of it on every later batch (in the publish
    # benchmark, 14,000 -> 6,000 messages/s within one 60,000-message run).
    topic = TopicFactory()
    SubscriptionFactory(topic=topic)
    pg_conn.execute("ANALYZE workqueue_message")

    def batch() -> dict:
        return {
            "topic_name": topic.name,
            "messages": [
                {"message_id": str(uuid.uuid4()), "payload": {"n": n}, "envelope_bytes": 30}
                for n in range(100)
            ],
            "external": False,
            "published_by": "plan-test",
        }

    for _ in range(8):  # past the five custom plans PostgreSQL makes before a generic one
        sent = batch()
        _nested_plans(pg_conn, "wq_publish_many", sent)
        _nested_plans(pg_conn, "wq_publish_many", sent)  # retried whole: every item a duplicate
    seed_deliveries(pg_conn, SubscriptionFactory(topic=TopicFactory()), HOT_BACKLOG)

    plans = _nested_plans(pg_conn, "wq_publish_many", batch(), analyze=True)
    assert "Seq Scan on workqueue_message" not in plans, plans
    assert max(_rows_read(plans)) <= 200, plans  # the batch itself: 100 items, 100 rows each way

    # A batch retried whole (after a dropped connection, say) looks each stored message up
    # once, by primary key. Seen failing with sequential scans of the message table (a plan
    # kept from the small table) and with two probes per item (the verdict's two columns each
    # ran the lookup).
    retried = batch()
    _nested_plans(pg_conn, "wq_publish_many", retried)
    plans = _nested_plans(pg_conn, "wq_publish_many", retried, analyze=True)
    assert "Seq Scan on workqueue_message" not in plans, plans
    probes = re.findall(r"Index Scan using workqueue_message_pkey on \S+ .*loops=(\d+)\)", plans)
    assert sum(map(int, probes)) == 100, plans

    # An id taken before still gets its verdict from the stored message.
    first = batch()["messages"][0]
    pg_conn.execute(
        "SELECT * FROM wq_publish_many(%s, %s::jsonb, false, 'plan-test')",
        [topic.name, json.dumps([first])],
    )
    rows = pg_conn.execute(
        "SELECT status, error_code FROM wq_publish_many(%s, %s::jsonb, false, 'plan-test') "
        "ORDER BY item_index",
        [topic.name, json.dumps([first, {**first, "payload": {"n": -1}}])],
    ).fetchall()
    assert rows == [("Duplicate", None), ("Rejected", "MessageIDConflict")]


def test_a_large_batch_publish_tells_accepted_items_by_one_hashed_lookup(pg_conn):
    # Which items' rows went in decides both the fan-out and each item's result. Searching the
    # inserted ordinals once per item (= ANY of their array, or a join the planner runs as a
    # nested loop, sure from a CTE's estimate that one row is in play) made a batch's database
    # time grow with the square of its size: a batch of 5,000 took a second. Seen failing with
    # the membership test written as a join condition (two million rows removed by the join
    # filter) and as = ANY of an array (no hashed lookup).
    topic = TopicFactory()
    SubscriptionFactory(topic=topic)
    size = 2_000
    params = {
        "topic_name": topic.name,
        "messages": [
            {"message_id": str(uuid.uuid4()), "payload": {"n": n}, "envelope_bytes": 30}
            for n in range(size)
        ],
        "external": False,
        "published_by": "plan-test",
    }
    plans = _nested_plans(pg_conn, "wq_publish_many", params, analyze=True, verbose=True)
    assert "hashed SubPlan" in plans, plans
    removed = [int(n) for n in re.findall(r"Rows Removed by Join Filter: (\d+)", plans)]
    assert max(removed, default=0) <= size, plans
    [(deliveries,)] = pg_conn.execute(
        "SELECT count(*) FROM workqueue_delivery d JOIN workqueue_message m "
        "ON m.id = d.message_id WHERE m.topic_id = %s",
        [topic.id],
    ).fetchall()
    assert deliveries == size


#: The procedures a host or a publisher calls over and over on one connection.
HOT_PROCEDURES = (
    "wq_publish",
    "wq_publish_many",
    "wq_reserve_deduplication",
    "wq_confirm_deduplication",
    "wq_release_deduplication",
    "wq_claim",
    "wq_extend_lease",
    "wq_complete",
    "wq_complete_many",
    "wq_retry",
    "wq_dead_letter",
    "wq_release",
    "wq_acknowledge_cancel",
    "wq_expire_leases",
    "wq_take_rate_tokens",
    "wq_queue_gauges",
    "wq_expire_leases_all",
    "wq_purge_terminal_deliveries",
    "wq_purge_orphan_messages",
    "wq_purge_expired_deduplications",
    "wq_replay",
    "wq_discard",
    "wq_cancel",
    "wq_list_dead_letters",
    "wq_list_partitions",
    "wq_backlog",
    "wq_discard_pending",
    "wq_resolve_dead_letters",
)


@pytest.mark.parametrize("mode", ["None", "Exclusive", "Ordered"])
def test_plans_cached_while_the_tables_were_small_still_probe_indexes_after_a_burst(pg_conn, mode):
    # A host and a publisher start on an empty queue and keep each statement's plan for their
    # session; then a burst fills the tables before autovacuum analyzes them. No hot procedure
    # may then read a queue table from end to end, nor read thousands of rows for a few.
    subscription = SubscriptionFactory(topic=TopicFactory(), partition_mode=mode)
    keys = "'k' || mod(g, 500)" if mode != "None" else None
    seed_deliveries(pg_conn, subscription, 10, keys=keys)
    for table in QUEUE_TABLES:
        pg_conn.execute(f"ANALYZE {table}")

    def params() -> dict:
        delivery = {"delivery_id": str(uuid.uuid4()), "lease_token": str(uuid.uuid4())}
        message = {
            "message_id": str(uuid.uuid4()),
            "partition_key": "k1" if mode != "None" else None,
            "payload": {"n": 1},
            "envelope_bytes": 40,
        }
        return {
            **delivery,
            **message,
            "subscription_id": subscription.id,
            "lease_owner": "plan-test",
            "max_rows": 8,
            "batch_size": 100,
            "wanted": 8,
            "actor": "plan-test",
            "note": "plan-test",
            "allow_pending": False,
            "page_size": 50,
            "dry_run": True,
            "action": "Replay",
            "cap": 100,  # what a gauge may count, well within the bound below
            "delay_seconds": 1,
            "error": "plan-test",
            "reason": "Poison",
            "items": [delivery],
            "topic_name": subscription.topic.name,
            "deduplication_key": str(uuid.uuid4()),
            "messages": [dict(message, message_id=str(uuid.uuid4())) for _ in range(20)],
            "external": False,
            "published_by": "plan-test",
        }

    for _ in range(8):  # past the five custom plans PostgreSQL makes before a generic one
        for procedure in HOT_PROCEDURES:
            _nested_plans(pg_conn, procedure, params())
    seed_deliveries(pg_conn, subscription, HOT_BACKLOG, keys=keys)
    pg_conn.execute(
        "INSERT INTO workqueue_deduplication (id, topic_id, deduplication_key, message_id, "
        "status, expires_at) SELECT gen_random_uuid(), %s, 'burst-' || g, gen_random_uuid(), "
        "'Confirmed', now() + interval '1 hour' FROM generate_series(1, %s) g",
        [subscription.topic_id, HOT_BACKLOG],
    )

    for procedure in HOT_PROCEDURES:
        plans = _nested_plans(pg_conn, procedure, params(), analyze=True)
        for table in QUEUE_TABLES:
            assert f"Seq Scan on {table}" not in plans, f"{mode} {procedure}:\n{plans}"
        assert max(_rows_read(plans), default=0) <= 500, f"{mode} {procedure}:\n{plans}"


def test_a_fan_out_calls_the_filter_matcher_only_for_filtered_subscriptions(pg_conn):
    # A PL/pgSQL call per delivery row was a good part of what each row of a fan-out cost
    # (publish_many of 100 to ten unfiltered subscriptions: 7-13 % of the server's time), and
    # a subscription without a filter receives everything without one. Seen failing with the
    # matcher called for every subscription: 12 calls here instead of 3.
    topic = TopicFactory()
    unfiltered = [SubscriptionFactory(topic=topic) for _ in range(3)]
    red = SubscriptionFactory(topic=topic, filter=root(leaf("colour", "eq", "red")))
    published = {"external": False, "published_by": "test", "caller_announces": True}
    red_message, red_item, plain_item = (str(uuid.uuid4()) for _ in range(3))
    pg_conn.execute("SET track_functions = 'pl'")
    with pg_conn.transaction():
        _call(
            pg_conn,
            "wq_publish",
            {
                **published,
                "topic_name": topic.name,
                "message_id": red_message,
                "attributes": {"colour": "red"},
                "payload": {"n": 1},
                "envelope_bytes": 100,
            },
        )
        items = [
            {"message_id": red_item, "attributes": {"colour": "red"}, "envelope_bytes": 100},
            {"message_id": plain_item, "envelope_bytes": 100},
        ]
        rows = _call(
            pg_conn, "wq_publish_many", {**published, "topic_name": topic.name, "messages": items}
        )
        assert [status for _index, _id, status, _code in rows] == ["Accepted", "Accepted"]
        [(calls,)] = pg_conn.execute(
            "SELECT calls FROM pg_stat_xact_user_functions WHERE funcname = 'wq_filter_matches'"
        ).fetchall()
        # One call per message, for the one filtered subscription.
        assert calls == 3
        delivered = dict(
            pg_conn.execute(
                "SELECT message_id::text, array_agg(subscription_id::text) "
                "FROM workqueue_delivery WHERE message_id = ANY (%s::uuid[]) GROUP BY 1",
                [[red_message, red_item, plain_item]],
            ).fetchall()
        )
    everyone = sorted(str(s.id) for s in [*unfiltered, red])
    assert sorted(delivered[red_message]) == everyone
    assert sorted(delivered[red_item]) == everyone
    assert sorted(delivered[plain_item]) == sorted(str(s.id) for s in unfiltered)


def _plans_made(pg_conn, procedure: str, params: dict) -> int:
    """How many times PostgreSQL plans a statement while ``procedure`` is called once: the call
    itself (sent unprepared here) and each statement inside it not run on a kept plan."""
    notices: list[str] = []
    pg_conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
    pg_conn.execute("SET debug_print_plan = on")
    pg_conn.execute("SET client_min_messages = log")
    try:
        _call(pg_conn, procedure, params)
    finally:
        pg_conn.execute("SET client_min_messages = notice")
        pg_conn.execute("SET debug_print_plan = off")
    return sum(notice.startswith("plan:") for notice in notices)


@pytest.mark.parametrize("procedure", ["wq_publish", "wq_publish_many"])
def test_a_publisher_plans_a_publish_once_whatever_the_statistics_say(pg_conn, procedure):
    # Left to choose, PostgreSQL planned some of a publish's statements afresh at every call:
    # the Ordered check, whose plan for a call without a key is a constant, and, as soon as
    # the statistics showed one topic with many subscriptions, the fan-out, whose plan for one
    # topic then looked cheaper than the kept one. That re-planning was up to a third of a
    # single publish's PostgreSQL CPU (0.48 ms -> 0.31 ms beside a topic of 300 subscriptions;
    # docs/performance.md, twelfth round). Seen failing before migration 0030: three plans, not one.
    busy, topic = TopicFactory(), TopicFactory()
    template = SubscriptionFactory(topic=busy)
    SubscriptionFactory(topic=topic)
    pg_conn.execute(
        "INSERT INTO workqueue_subscription SELECT (jsonb_populate_record("
        "  NULL::workqueue_subscription, to_jsonb(s) || jsonb_build_object("
        "    'id', gen_random_uuid(), 'name', s.name || '-' || g))).* "
        "FROM workqueue_subscription s, generate_series(1, 300) g WHERE s.id = %s",
        [template.id],
    )
    pg_conn.execute("ANALYZE workqueue_subscription")

    def params() -> dict:
        message = {"message_id": str(uuid.uuid4()), "payload": {"n": 1}, "envelope_bytes": 40}
        return {
            **message,
            "messages": [dict(message, message_id=str(uuid.uuid4())) for _ in range(20)],
            "topic_name": topic.name,
            "external": False,
            "published_by": "plan-test",
            "caller_announces": True,
        }

    for _ in range(8):  # past the five custom plans PostgreSQL makes before a generic one
        _call(pg_conn, procedure, params())

    assert _plans_made(pg_conn, procedure, params()) == 1  # the call; nothing inside it


def test_procedures_that_leave_sequential_scans_aside_are_not_jit_compiled(pg_conn):
    # With enable_seqscan = off, a sequential scan a statement cannot avoid (the topics read end
    # to end for their retention) is costed at 10^10, past every JIT threshold, and PostgreSQL
    # compiled the statement at each call: 110-165 ms of CPU a call of the sweeper's purges,
    # which delete in milliseconds (0035). So every procedure that turns sequential scans off
    # turns JIT off too (0037). Seen failing before 0037 (publishing, settling and the
    # operators' walks had no jit = off), and, for the plans, with jit = off taken off the purges.
    rows = pg_conn.execute(
        "SELECT proname, proconfig FROM pg_proc "
        "WHERE proname LIKE 'wq\\_%' AND 'enable_seqscan=off' = ANY(proconfig) ORDER BY proname"
    ).fetchall()
    names = {name for name, _ in rows}
    assert {"wq_publish", "wq_publish_many", "wq_claim", "wq_complete_many"} <= names, names
    assert [name for name, config in rows if "jit=off" not in config] == []

    if not pg_conn.execute("SELECT pg_jit_available()").fetchone()[0]:
        pytest.skip("this PostgreSQL has no JIT (built without LLVM): no plan could show one")
    subscription = SubscriptionFactory(topic=TopicFactory())
    seed_deliveries(pg_conn, subscription, 100)
    for procedure in ("wq_purge_terminal_deliveries", "wq_purge_orphan_messages"):
        plans = _nested_plans(pg_conn, procedure, {"batch_size": 1000})
        assert "workqueue_topic" in plans, f"{procedure}: no nested plan logged"
        assert "JIT" not in plans, f"{procedure}:\n{plans}"


def test_a_task_result_purge_reads_what_it_purges_not_what_longer_retentions_keep(pg_conn):
    """The results' walk read every result older than the shortest retention of any task
    queue, so beside a queue of a longer retention each sweeper pass read all the results
    that queue still keeps (20,000 here, to delete 10), and read more as its history grew.
    Each result now names its queue's topic and is walked from its own topic's cutoff."""
    kept = SubscriptionFactory(topic=TopicFactory(retention_days=30), handler_key=HANDLER_KEY)
    purged = SubscriptionFactory(topic=TopicFactory(retention_days=1), handler_key=HANDLER_KEY)
    seed_deliveries(pg_conn, kept, 20_000)  # tasks waiting for their retry: messages alive
    started = "now() - interval '2 days'"  # past one retention, well within the other
    pg_conn.execute(
        "INSERT INTO workqueue_taskresult (id, topic, started_at, last_attempted_at, "
        f"worker_ids, errors) SELECT id, %s, {started}, {started}, '[]', '[]' "
        "FROM workqueue_message WHERE topic_id = %s",
        (kept.topic.name, kept.topic_id),
    )
    orphans = [uuid.uuid4() for _ in range(10)]  # their messages purged with their topic's
    pg_conn.execute(
        "INSERT INTO workqueue_taskresult (id, topic, started_at, last_attempted_at, "
        f"worker_ids, errors) SELECT id, %s, {started}, {started}, '[]', '[]' "
        "FROM unnest(%s::uuid[]) AS id",
        (purged.topic.name, orphans),
    )
    pg_conn.execute("ANALYZE workqueue_taskresult")
    pg_conn.execute("ANALYZE workqueue_message")

    notices: list[str] = []
    connection.ensure_connection()
    connection.connection.add_notice_handler(
        lambda diag: notices.append(diag.message_primary or "")
    )
    with connection.cursor() as cursor:
        cursor.execute("LOAD 'auto_explain'")
        for setting in (
            "auto_explain.log_min_duration = 0",
            "auto_explain.log_analyze = on",
            "client_min_messages = log",
        ):
            cursor.execute(f"SET {setting}")
    try:
        removed = TaskResult.objects.purge_orphans(1000)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET client_min_messages")
    plans = "\n".join(notices)

    assert removed == 10
    assert "workqueue_taskresult" in plans
    assert max(_rows_read(plans)) <= 1000, plans
    assert TaskResult.objects.count() == 20_000


@pytest.mark.parametrize("mode", ["Exclusive", "Ordered"])
def test_a_claims_probe_for_a_held_key_reads_the_held_key_index(pg_conn, mode):
    """A claim asks, for each key it would start, whether a completed delivery of the key still
    holds it (wq_complete_holding_key): among 50,000 completed rows of the same keys that is
    one probe of wq_dlv_key_held_ix, never a walk of the completed rows (review helper-194)."""
    subscription = SubscriptionFactory(topic=TopicFactory(), partition_mode=mode)
    seed_deliveries(pg_conn, subscription, 50_000, status="Completed", keys="'k' || mod(g, 5)")
    seed_deliveries(pg_conn, subscription, 50, keys="'k' || mod(g, 5)")
    pg_conn.execute("ANALYZE workqueue_delivery")
    pg_conn.execute("ANALYZE workqueue_message")
    params = {"subscription_id": subscription.id, "lease_owner": "plan-test", "max_rows": 10}

    plans = _nested_plans(pg_conn, "wq_claim", params, analyze=True, buffers=True)

    probes = [p for p in plans.split("Query Text:") if "'Completed'" in p]
    assert probes, plans
    for probe in probes:
        assert "wq_dlv_key_held_ix" in probe, probe
