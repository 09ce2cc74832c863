"""Upgrading a live queue: a database at the previous release (migration 0006_claim_key_walk, with
that release's procedures) holding Pending, InFlight (a live lease) and DeadLettered deliveries
and a confirmed deduplication key is migrated to the latest; then the current code claims and
settles every one of them, and the old lease holder's token still holds.

Runs in a scratch database (the shared per-worker test database is never migrated backwards).
The procedures of the previous release are kept in ``releases/0006_claim_key_walk/`` exactly as
they shipped (``git show f796efd:workqueue/sql/postgresql/<name>.sql``), installed in that
release's order, as its migration did.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import psycopg
import pytest

from tests.support.processes import run_python, subprocess_environment

pytestmark = pytest.mark.processes

RELEASE = Path(__file__).resolve().parent / "releases" / "0006_claim_key_walk"
RELEASE_INSTALL_ORDER = ("filters", "publish", "claim", "lease", "settle", "operator", "sweeper")
PREVIOUS_RELEASE_MIGRATION = "0006_claim_key_walk"

TOPIC = "upgrade.orders"
SUBSCRIPTION = "upgrade.orders-billing"
FILTER = {"logic": "and", "filters": [{"field": "region", "operator": "eq", "value": "eu"}]}

# Runs in a subprocess on the scratch database with the current code, after the upgrade.
AFTER_UPGRADE = r"""
import dataclasses, json, sys
import django
django.setup()
from workqueue import publish
from workqueue.models import Delivery, Subscription
from workqueue.transport import Receiver, replay
from workqueue.types import ClaimedDelivery

seed = json.loads(sys.argv[1])
sub = Subscription.objects.get(name=seed["subscription"])
new_host = Receiver(sub.id, "new-host")
out = {}

def ids(deliveries):
    return sorted(d.delivery_id for d in deliveries)

# The old holder's handle: what a host that was running across the upgrade still has.
blank = {f.name: None for f in dataclasses.fields(ClaimedDelivery)}
held = ClaimedDelivery(**{**blank, "delivery_id": seed["in_flight"],
                          "subscription_id": str(sub.id), "lease_token": seed["token"]})

behind_held = publish(seed["topic"], {"n": 4}, partition_key="b", attributes={"region": "eu"})
first = new_host.receive(10).deliveries
out["first_claim"] = ids(first)
out["behind_held_accepted"] = behind_held.status
old_holder = Receiver(sub.id, "old-host")
out["old_holder_renews"] = old_holder.extend_lease(held).state
out["old_holder_completes"] = old_holder.complete(held).outcome
second = new_host.receive(10).deliveries
out["second_claim_messages"] = sorted(d.message_id for d in second)
out["replayed"] = replay(str(sub.id), seed["dead_letter"], "upgrade-test", "after the upgrade")
third = new_host.receive(10).deliveries
out["third_claim"] = [(d.delivery_id, d.attempt, d.is_replay) for d in third]
out["completed"] = {d.delivery_id: new_host.complete(d).outcome for d in first + second + third}
again = publish(seed["topic"], {"n": 5}, attributes={"region": "eu"},
                deduplication_key=seed["dedup_key"])
out["dedup_after_upgrade"] = [again.status, again.message_id]
out["statuses"] = {str(d.id): d.status for d in Delivery.objects.filter(subscription=sub)}
print(json.dumps(out))
"""


def _run(database_url: str, *args: str) -> str:
    env = subprocess_environment(database_url)
    return run_python(*args, env=env, timeout=180, check=True).stdout


def _install_release_procedures(conn: psycopg.Connection) -> None:
    """What the release's latest procedure migration did: its files, in its order, in one
    transaction with the search path the SECURITY DEFINER functions pin."""
    with conn.transaction():
        conn.execute(
            "SELECT set_config('search_path', quote_ident(current_schema()) || ', pg_temp', true)"
        )
        for name in RELEASE_INSTALL_ORDER:
            conn.execute((RELEASE / f"{name}.sql").read_text("utf-8"))


def _seed_topology(conn: psycopg.Connection) -> str:
    """A topic and an Exclusive, filtered subscription, written as rows of that release."""
    (transport_id,) = conn.execute(
        "SELECT id FROM workqueue_transport WHERE name = 'Database'"
    ).fetchone()
    topic_id, sub_id = uuid.uuid4(), uuid.uuid4()
    conn.execute(
        "INSERT INTO workqueue_topic (id, name, description, transport_id, is_fifo, "
        "allow_external_publish, max_payload_bytes, default_deduplication_ttl_seconds, "
        "retention_days, binding_config, status) "
        "VALUES (%s, %s, '', %s, false, false, 262144, 86400, 7, NULL, 'Active')",
        [topic_id, TOPIC, transport_id],
    )
    conn.execute(
        "INSERT INTO workqueue_subscription (id, topic_id, name, description, filter, "
        "partition_mode, max_attempts, backoff_base_seconds, backoff_max_seconds, lease_seconds, "
        "heartbeat_mode, max_processing_seconds, host_type, handler_key, external_ref, "
        "binding_config, status) VALUES (%s, %s, %s, '', %s, 'Exclusive', 3, 10, 900, 600, "
        "'Auto', NULL, 'Worker', 'upgrade.noop', '', NULL, 'Active')",
        [sub_id, topic_id, SUBSCRIPTION, json.dumps(FILTER)],
    )
    return str(sub_id)


def _old_publish(conn: psycopg.Connection, key: str, n: int, dedup_key: str | None = None) -> str:
    message_id = str(uuid.uuid4())
    status = conn.execute(
        "SELECT status FROM wq_publish(p_topic_name => %s, p_message_id => %s::uuid, "
        "p_partition_key => %s, p_attributes => %s::jsonb, p_payload => %s::jsonb, "
        "p_payload_ref => NULL, p_correlation_id => NULL, p_deduplication_key => %s, "
        "p_deduplication_ttl_seconds => NULL, p_envelope_bytes => 100, p_external => false, "
        "p_published_by => 'release-0006')",
        [TOPIC, message_id, key, json.dumps({"region": "eu"}), json.dumps({"n": n}), dedup_key],
    ).fetchone()[0]
    assert status == "Accepted"
    return message_id


def _old_claim(conn: psycopg.Connection, sub_id: str) -> list[tuple[str, str, str]]:
    rows = conn.execute(
        "SELECT kind, delivery_id, lease_token, message_id FROM wq_claim("
        "p_subscription_id => %s::uuid, p_lease_owner => 'old-host', p_max_rows => 10, "
        "p_after_key => NULL)",
        [sub_id],
    ).fetchall()
    return [(str(d), str(t), str(m)) for kind, d, t, m in rows if kind == "Claimed"]


def _statuses(conn: psycopg.Connection) -> dict[str, str]:
    return {
        str(m): s
        for m, s in conn.execute("SELECT message_id, status FROM workqueue_delivery").fetchall()
    }


def test_pending_in_flight_and_dead_lettered_deliveries_survive_the_upgrade(scratch_database):
    _run(scratch_database, "manage.py", "migrate", "workqueue", PREVIOUS_RELEASE_MIGRATION, "-v0")
    with psycopg.connect(scratch_database, autocommit=True) as conn:
        _install_release_procedures(conn)
        sub_id = _seed_topology(conn)
        # The previous release's procedures write the live data: "a" will stay Pending; "b"
        # and "c" are claimed by a host of that release, "c" then dead-lettered by it.
        _old_publish(conn, "b", 2)
        _old_publish(conn, "c", 3)
        claimed = {message: (delivery, token) for delivery, token, message in _old_claim(
            conn, sub_id)}  # fmt: skip
        pending = _old_publish(conn, "a", 1, dedup_key="order-1")
        in_flight_message, dead_message = sorted(
            claimed, key=lambda m: _key_of(conn, m)
        )  # "b" then "c"
        dead_delivery, dead_token = claimed[dead_message]
        (dead_lettered,) = conn.execute(
            "SELECT affected_rows FROM wq_dead_letter(p_delivery_id => %s::uuid, "
            "p_lease_token => %s::uuid, p_reason => 'Fatal', p_error => 'boom')",
            [dead_delivery, dead_token],
        ).fetchone()
        assert dead_lettered == 1
        assert _statuses(conn) == {
            pending: "Pending",
            in_flight_message: "InFlight",
            dead_message: "DeadLettered",
        }
        (lease_left,) = conn.execute(
            "SELECT lease_expires_at - now() > interval '5 minutes' FROM workqueue_delivery "
            "WHERE id = %s",
            [claimed[in_flight_message][0]],
        ).fetchone()
        assert lease_left, "the InFlight delivery's lease must still be live"
        pending_delivery = conn.execute(
            "SELECT id FROM workqueue_delivery WHERE message_id = %s", [pending]
        ).fetchone()[0]

    _run(scratch_database, "manage.py", "migrate", "-v0")

    seed = {
        "topic": TOPIC,
        "subscription": SUBSCRIPTION,
        "in_flight": claimed[in_flight_message][0],
        "token": claimed[in_flight_message][1],
        "dead_letter": dead_delivery,
        "dedup_key": "order-1",
    }
    out = json.loads(_run(scratch_database, "-c", AFTER_UPGRADE, json.dumps(seed)))

    # The new host claims the Pending delivery only: "b" is still held by the old host (its
    # key stays busy, so the message published behind it waits), "c" is a dead letter.
    assert out["first_claim"] == [str(pending_delivery)]
    assert out["behind_held_accepted"] == "Accepted"
    # The old holder's token, issued before the upgrade, still renews and settles.
    assert (out["old_holder_renews"], out["old_holder_completes"]) == ("Held", "Settled")
    assert len(out["second_claim_messages"]) == 1  # the message behind "b", now free
    assert out["replayed"] is True
    assert out["third_claim"] == [[dead_delivery, 1, True]]
    assert set(out["completed"].values()) == {"Settled"} and len(out["completed"]) == 3
    assert out["dedup_after_upgrade"] == ["Duplicate", pending]
    assert sorted(out["statuses"].values()) == ["Completed"] * 4


def _key_of(conn: psycopg.Connection, message_id: str) -> str:
    return conn.execute(
        "SELECT partition_key FROM workqueue_message WHERE id = %s", [message_id]
    ).fetchone()[0]
