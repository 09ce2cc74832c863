"""Review helper-173: what one call of a granted procedure may make the database do or store is
bounded by the procedure, whatever the caller passes (the runtime passes bounded values; a role
calling the procedures itself need not). Each test failed on the code before migration 0055, or
0056 for those after the first two."""

from __future__ import annotations

import io
import json

import psycopg
import pytest
from django.core.management import call_command

from tests.factories import SubscriptionFactory
from tests.support.database import psycopg_params
from tests.support.roles import connect_as, database_role
from tests.support.seeding import seed_deliveries
from workqueue import publish
from workqueue.conf import MAX_CLAIM_ROWS
from workqueue.models import Delivery
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")


@pytest.fixture
def role(pg_conn):
    with database_role(pg_conn, "wq_r173") as name:
        yield name


@pytest.mark.parametrize("batch", [None, 2_000_000_000])
def test_a_runtime_role_cannot_make_one_sweeper_call_unbounded(role, pg_conn, batch):
    """The sweeper works in batches of 1000 (PURGE_BATCH), and the operator procedures clamp
    their batches to 5000 because "any role that may call ... passes its own caps"; the sweeper
    procedures clamp nothing: LIMIT NULL is no limit. One call of a runtime role deletes (and
    first locks) every due row in one transaction."""
    call_command("workqueue", "grant-runtime", role, stdout=io.StringIO())
    topic = SubscriptionFactory().topic
    pg_conn.execute(
        "INSERT INTO workqueue_deduplication (id, topic_id, deduplication_key, message_id, "
        "status, expires_at) SELECT gen_random_uuid(), %s, 'k' || g, gen_random_uuid(), "
        "'Confirmed', now() - interval '1 day' FROM generate_series(1, 6000) g",
        [topic.id],
    )
    with connect_as(role) as sweeper:
        [(purged,)] = sweeper.execute(
            "SELECT affected_rows FROM wq_purge_expired_deduplications(%s)", [batch]
        ).fetchall()
    assert purged <= 5000, f"one call of runtime role {role} purged {purged} rows (batch {batch})"


def test_a_lease_holder_cannot_store_progress_past_the_limit(role):
    """The runtime keeps a handler's progress within 4000 characters of JSON (executor
    _progress), and the procedures cut error text at 16,000 characters because a caller's word
    is bounded where it is stored (README, Database security). wq_extend_lease stores any
    progress whole, and the admin's delivery list loads every listed row's progress (the
    default manager defers only the lease token): 8 MB per held delivery, 100 rows a page."""
    call_command("workqueue", "grant-runtime", role, stdout=io.StringIO())
    subscription = SubscriptionFactory()
    publish(subscription.topic.name, {"n": 1})
    with connect_as(role) as host:
        [(delivery_id, token)] = host.execute(
            "SELECT delivery_id, lease_token FROM wq_claim(%s, 'host-x', 1, NULL) "
            "WHERE kind = 'Claimed'",
            [subscription.id],
        ).fetchall()
        [(state,)] = host.execute(
            "SELECT lease_state FROM wq_extend_lease(%s, %s, jsonb_build_object('message', "
            "repeat('p', 8000000)))",
            [delivery_id, token],
        ).fetchall()
    assert state == "Held"
    [(stored,)] = Delivery.objects.filter(pk=delivery_id).values_list("progress")
    size = len(json.dumps(stored))
    listed = "progress" in str(Delivery.objects.order_by("-id").query)
    assert size <= 16_000, (
        f"runtime role {role} stored {size} characters of progress on its delivery; the "
        f"admin's delivery list reads the column for every row: {listed}"
    )


# Migration 0056: what 0055 left unbounded. Each test below failed on the code before it.


@pytest.mark.parametrize("max_rows", [None, 100_000, 2_000_000_000])
def test_a_runtime_role_cannot_claim_past_the_claim_cap_in_one_call(role, pg_conn, max_rows):
    """A host asks for its free slots and what it may claim ahead (MAX_CONCURRENCY plus its
    prefetch); wq_claim took whatever it was passed: 100,000 deliveries leased (and locked, and
    read with their payloads) in one transaction; NULL took every keyless one, then looped for
    ever (NULL rows left never reached 0: 20 minutes until cancelled); and the window of
    p_max_rows * 4 + 32 overflowed into an error past 536 million."""
    call_command("workqueue", "grant-runtime", role, stdout=io.StringIO())
    subscription = SubscriptionFactory()
    seed_deliveries(pg_conn, subscription, MAX_CLAIM_ROWS + 500)
    with connect_as(role) as host:
        host.execute("SET statement_timeout = '60s'")
        [(claimed,)] = host.execute(
            "SELECT count(*) FROM wq_claim(%s, 'host-x', %s, NULL) WHERE kind = 'Claimed'",
            [subscription.id, max_rows],
        ).fetchall()
    # NULL claims nothing, as on SQL Server (where NULL compares as no room).
    assert claimed == (0 if max_rows is None else MAX_CLAIM_ROWS), (
        f"one wq_claim call of runtime role {role} leased {claimed} deliveries (max_rows "
        f"{max_rows})"
    )


def test_a_host_asking_past_the_claim_cap_asks_for_the_cap_and_is_not_told_it_drained(pg_conn):
    """The host's own ask is held to the cap: asked for more than the procedure hands out, a
    full claim would read as a short one, "drained", and the loop would idle with work left."""
    subscription = SubscriptionFactory()
    seed_deliveries(pg_conn, subscription, MAX_CLAIM_ROWS + 500)
    result = Receiver(subscription.id, lease_owner="host-x").receive(MAX_CLAIM_ROWS + 100)
    assert (len(result.deliveries), result.drained) == (MAX_CLAIM_ROWS, False)


@pytest.mark.parametrize(
    ("batch", "expected"), [(None, 1000), (2_000_000_000, 5000)], ids=["null", "huge"]
)
def test_an_operator_role_cannot_make_one_retirement_call_unbounded(role, pg_conn, batch, expected):
    """The retirement procedures clamped their batch from below only (NULL: 1), where every
    other batch of the operator and sweeper procedures is 1..5000 (NULL: 1000): one call
    discarded or deleted every row of a retired subscription in one transaction."""
    call_command("workqueue", "grant-operator", role, stdout=io.StringIO())
    subscription = SubscriptionFactory()
    seed_deliveries(pg_conn, subscription, 5500)
    seed_deliveries(pg_conn, subscription, 5500, status="Completed")
    pg_conn.execute(
        "UPDATE workqueue_subscription SET status = 'Disabled' WHERE id = %s", [subscription.id]
    )
    with connect_as(role) as operator:
        [(discarded,)] = operator.execute(
            "SELECT affected_rows FROM wq_retire_discard(%s, 'op', 'retired', %s)",
            [subscription.id, batch],
        ).fetchall()
        [(purged,)] = operator.execute(
            "SELECT affected_rows FROM wq_retire_purge(%s, %s)", [subscription.id, batch]
        ).fetchall()
    assert (discarded, purged) == (expected, expected), f"batch {batch}"


def test_a_bulk_discard_batch_walks_no_further_than_its_size_past_locked_rows(role, pg_conn):
    """wq_discard_pending skipped rows other sessions held locked (SKIP LOCKED) without
    counting them, and walked on until it had examined a batch of unlocked ones: behind
    locked rows (a claim in progress, a transaction held open by any role granted a claim or
    a bulk operation) a batch of 100 went through as many of them as there were, one bound
    read and one locking read per batch size, in one call."""
    call_command("workqueue", "grant-operator", role, stdout=io.StringIO())
    subscription = SubscriptionFactory()
    seed_deliveries(pg_conn, subscription, 3000)
    order = pg_conn.execute(
        "SELECT priority, visible_at, id FROM workqueue_delivery WHERE subscription_id = %s "
        "ORDER BY priority, visible_at, id",
        [subscription.id],
    ).fetchall()
    with (
        connect_as(role) as operator,
        psycopg.connect(**psycopg_params()) as holder,
        holder.transaction(),
    ):
        holder.execute(
            "SELECT 1 FROM workqueue_delivery WHERE subscription_id = %s "
            "ORDER BY priority, visible_at, id LIMIT 2900 FOR UPDATE",
            [subscription.id],
        )  # as claims in progress would: 2,900 rows locked until the holder's commit
        [(examined, changed, *last)] = operator.execute(
            "SELECT * FROM wq_discard_pending(%s, false, NULL, NULL, NULL, NULL, NULL, NULL, "
            "NULL, 100, false, 'op', 'discarded')",
            [subscription.id],
        ).fetchall()
    walked = order.index(tuple(last)) + 1 if tuple(last) in order else len(order)
    assert walked <= 100, (
        f"a batch of 100 walked {walked} rows past 2,900 locked ones (examined {examined}, "
        f"changed {changed})"
    )
    # The locked rows count as examined (walked over, skipped): the batch was full, so the
    # bulk operation goes on after it.
    assert (examined, changed) == (100, 0)
