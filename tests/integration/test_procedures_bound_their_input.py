"""Review helper-173: what one call of a granted procedure may make the database do or store is
bounded by the procedure, whatever the caller passes (the runtime passes bounded values; a role
calling the procedures itself need not). Each test failed on the code before migration 0055."""

from __future__ import annotations

import io
import json

import pytest
from django.core.management import call_command

from tests.factories import SubscriptionFactory
from tests.support.roles import connect_as, database_role
from workqueue import publish
from workqueue.models import Delivery

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
