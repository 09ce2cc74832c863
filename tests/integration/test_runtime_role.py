"""The database roles: the runtime role (hosts and publishers) has EXECUTE on the claim, settle,
publish and sweeper procedures and SELECT on the tables, never DML on the queue tables nor the
lease tokens; the operator role has the operator procedures; the scaler role reads only what its
query needs. So the claim/settle/sweep rules and fencing cannot be bypassed."""

from __future__ import annotations

import datetime as dt
import io
import time
import uuid
from typing import Any

import psycopg
import pytest
from django.apps import apps
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import connection
from django.db.models.signals import post_migrate
from django.urls import reverse

from tests.factories import SubscriptionFactory, TopicFactory
from tests.support.roles import connect_as, database_role, queue_connections_as
from workqueue import publish, publish_many, transport
from workqueue.driver import get_driver
from workqueue.driver.base import (
    DELIVERY_READABLE_COLUMNS,
    LEASE_TOKEN_COLUMN,
    PROCEDURE_WRITTEN_TABLES,
    RUNTIME_READABLE_COUNTS,
    canonical_json,
)
from workqueue.driver.procedures import PROCEDURES, Grant, get_procedure
from workqueue.models import Deduplication, Delivery, HostRecord, TaskResult
from workqueue.models.hosts import database_now
from workqueue.runtime.executor import MAX_ERROR_LENGTH
from workqueue.runtime.sweeper import Sweeper
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")


@pytest.fixture
def runtime_role(pg_conn):
    with database_role(pg_conn, "wq_runtime") as role:
        yield role


def test_runtime_role_cannot_write_queue_tables_but_can_publish_claim_and_complete(
    runtime_role,
):
    subscription = SubscriptionFactory()
    call_command("workqueue", "grant-runtime", runtime_role)
    driver = get_driver()

    with connect_as(runtime_role) as conn:
        publish_sql = driver.render_call(get_procedure("wq_publish"))
        message_id = str(uuid.uuid4())
        row = conn.execute(
            publish_sql,
            [
                subscription.topic.name,
                message_id,
                None,
                None,
                '{"a": 1}',
                None,
                None,
                None,
                None,
                10,
                False,
                "runtime",
                None,
                None,
                None,
                None,
            ],
        ).fetchone()
        assert row[1] == "Accepted"

        for statement in (
            "UPDATE workqueue_delivery SET attempt_count = 0",
            "DELETE FROM workqueue_delivery",
            "INSERT INTO workqueue_deduplication (id, topic_id, deduplication_key, message_id, "
            "status, expires_at) VALUES (gen_random_uuid(), gen_random_uuid(), 'k', "
            "gen_random_uuid(), 'Confirmed', now())",
            "DELETE FROM workqueue_message",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(statement)

        claimed = conn.execute(
            "SELECT delivery_id, lease_token FROM wq_claim(p_subscription_id => %s, "
            "p_lease_owner => 'runtime', p_max_rows => 10, p_after_key => NULL) "
            "WHERE kind = 'Claimed'",
            [subscription.id],
        ).fetchall()
        assert len(claimed) == 1
        completed = conn.execute(
            "SELECT affected_rows FROM wq_complete(p_delivery_id => %s, p_lease_token => %s)",
            claimed[0],
        ).fetchone()
        assert completed == (1,)
        status = conn.execute(
            "SELECT status FROM workqueue_delivery WHERE id = %s", [claimed[0][0]]
        ).fetchone()
        assert status == ("Completed",)


def test_a_role_without_the_grant_cannot_call_the_procedures(runtime_role):
    subscription = SubscriptionFactory()
    with connect_as(runtime_role) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute(
            "SELECT * FROM wq_claim(p_subscription_id => %s, p_lease_owner => 'x', "
            "p_max_rows => 1, p_after_key => NULL)",
            [subscription.id],
        )


def test_a_scaler_role_runs_the_scaler_query_and_reads_no_delivery(runtime_role):
    subscription = SubscriptionFactory(partition_mode="Ordered")
    for key in ("a", "a", "b"):
        publish(subscription.topic.name, {}, partition_key=key)
    call_command("workqueue", "grant-scaler", runtime_role)
    sql = get_driver().scaler_query(subscription.name)

    with connect_as(runtime_role) as conn:
        assert conn.execute(sql).fetchall() == [(2,)]  # the heads of "a" and "b"
        assert conn.execute(get_driver().scaler_query("no.such.subscription")).fetchall() == [(0,)]
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT count(*) FROM workqueue_delivery")


def test_the_scaler_query_caps_claimable_and_in_flight_at_1000_each_in_a_backlog_column(
    runtime_role,
):
    # 1,250 claimable and 1,250 in flight: each half is capped on its own, as the reference's
    # query does, so the scaler sees 2,000 and never loses sight of its running jobs.
    subscription = SubscriptionFactory()
    for _ in range(25):
        publish_many(subscription.topic.name, [{"payload": {}} for _ in range(100)])
    assert len(Receiver(subscription.id).receive(1250).deliveries) == 1250
    call_command("workqueue", "grant-scaler", runtime_role)

    with connect_as(runtime_role) as conn:
        cursor = conn.execute(get_driver().scaler_query(subscription.name))
        assert [column.name for column in cursor.description] == ["Backlog"]
        assert cursor.fetchall() == [(2000,)]


# -- attacks by a role holding the runtime grant ----------------------------------------------


def _call(conn: psycopg.Connection, name: str, **params: object) -> list[tuple]:
    """Call procedure ``name`` on ``conn`` as the driver renders it."""
    driver = get_driver()
    procedure = get_procedure(name)
    values = [driver.adapt(p, params.get(p.name)) for p in procedure.params]
    return conn.execute(driver.render_call(procedure), values).fetchall()


def _publish_as(role: str, topic: Any, **params: object) -> tuple:
    """Call wq_publish as ``role`` on ``topic`` with a new message id; its one row."""
    with connect_as(role) as conn:
        [row] = _call(
            conn,
            "wq_publish",
            topic_name=topic.name,
            message_id=str(uuid.uuid4()),
            external=False,
            published_by="runtime",
            **params,
        )
    return row


def test_the_runtime_role_cannot_read_lease_tokens_to_settle_another_hosts_delivery(
    runtime_role,
):
    subscription = SubscriptionFactory()
    publish(subscription.topic.name, {"n": 1})
    [held] = Receiver(subscription.id, "host-a").receive(1).deliveries
    call_command("workqueue", "grant-runtime", runtime_role)

    with connect_as(runtime_role) as conn:
        # Everything but the token stays readable (the admin and the ORM read the table).
        assert conn.execute(
            "SELECT status, lease_owner FROM workqueue_delivery WHERE id = %s",
            [held.delivery_id],
        ).fetchall() == [("InFlight", "host-a")]
        try:
            stolen = conn.execute(
                "SELECT id, lease_token FROM workqueue_delivery WHERE status = 'InFlight'"
            ).fetchall()
        except psycopg.errors.InsufficientPrivilege as refused:
            assert "workqueue_delivery" in str(refused)
            stolen = []
        for delivery_id, token in stolen:
            _call(conn, "wq_complete", delivery_id=delivery_id, lease_token=token)
    settled = Receiver(subscription.id, "host-a").complete(held).outcome
    assert settled == "Settled", "the runtime role settled host-a's delivery with its token"
    assert stolen == []


def test_a_role_that_had_select_on_the_whole_table_loses_the_lease_tokens(runtime_role, pg_conn):
    # A role granted by an older grant-runtime (or GRANT SELECT ON ALL TABLES) read them all.
    pg_conn.execute(f'GRANT SELECT ON ALL TABLES IN SCHEMA public TO "{runtime_role}"')
    call_command("workqueue", "grant-runtime", runtime_role)
    with connect_as(runtime_role) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute("SELECT lease_token FROM workqueue_delivery")


@pytest.mark.parametrize("claimed_bytes", [1, None], ids=["understated", "missing"])
def test_the_database_counts_the_envelope_a_caller_understates(runtime_role, claimed_bytes):
    topic = TopicFactory(max_payload_bytes=1000)
    SubscriptionFactory(topic=topic)
    call_command("workqueue", "grant-runtime", runtime_role)
    oversized = {"text": "x" * 3000}

    row = _publish_as(runtime_role, topic, payload=oversized, envelope_bytes=claimed_bytes)
    assert row[1:] == ("Rejected", "PayloadTooLarge")
    assert not Delivery.objects.filter(subscription__topic=topic).exists()


@pytest.mark.parametrize("ttl", [-10, 0, 59, 2_592_001, 2_147_483_647])
def test_the_database_refuses_a_deduplication_window_outside_its_bounds(runtime_role, ttl):
    """Python refused these windows; wq_publish took them: a negative one switched the key's
    deduplication off (the same key published twice was Accepted twice), the largest held
    a key until 2094."""
    topic = SubscriptionFactory().topic
    call_command("workqueue", "grant-runtime", runtime_role)

    row = _publish_as(
        runtime_role, topic, payload={}, deduplication_key="order-1", deduplication_ttl_seconds=ttl
    )
    assert row[1:3] == ("Rejected", "InvalidDeduplication")
    assert publish(topic.name, {}, deduplication_key="order-1").status == "Accepted"


def test_the_runtime_role_cannot_reconfirm_another_publishers_deduplication_key(runtime_role):
    """wq_confirm_deduplication confirmed any row it was given the owner's message id for,
    with any window: a runtime role holder made another publisher's confirmed key expire at
    once, and that publisher's retry was Accepted: the message was delivered twice."""
    topic = SubscriptionFactory().topic
    owner = publish(topic.name, {}, deduplication_key="order-1").message_id
    call_command("workqueue", "grant-runtime", runtime_role)

    with connect_as(runtime_role) as conn:
        for ttl in (-1, 60):
            [(affected,)] = _call(
                conn,
                "wq_confirm_deduplication",
                topic_name=topic.name,
                deduplication_key="order-1",
                message_id=owner,
                deduplication_ttl_seconds=ttl,
            )
            assert affected == 0

    retry = publish(topic.name, {}, deduplication_key="order-1")
    assert (retry.status, retry.message_id) == ("Duplicate", owner)


def test_a_reservation_is_confirmed_for_a_window_past_thirty_days():
    """A message id's ledger entry is held for its topic's retention, which may pass 30 days:
    a confirm capped at 30 days left it Reserved, lapsed after 120 s, and the same id was sent
    again (helper-79's review of the cap above)."""
    topic = TopicFactory(retention_days=90)

    owner = str(uuid.uuid4())
    assert transport.reserve_deduplication(topic.name, "k", owner) == ("Reserved", owner)

    assert transport.confirm_deduplication(topic.name, "k", owner, 90 * 86_400) is True
    assert Deduplication.objects.get(topic=topic).status == "Confirmed"


@pytest.mark.parametrize("many", [False, True], ids=["publish", "publish_many"])
def test_a_topology_lock_held_by_any_role_stops_publishes_for_seconds_not_for_ever(
    runtime_role, pg_conn, monkeypatch, many
):
    """The topology lock is an advisory lock, which any role that may connect can take (an
    autoscaler's login, say): held, every publish to the topic waited for it with no limit,
    and the publishers' threads piled up. Now a publish waits at most 5 s, then is rejected
    as retryable (TransportUnavailable), as on SQL Server."""
    from workqueue import transport as transport_module

    monkeypatch.setattr(transport_module, "TRANSIENT_RETRIES", 0)
    topic = SubscriptionFactory().topic
    call_command("workqueue", "grant-scaler", runtime_role)
    with connect_as(runtime_role) as holder:
        holder.execute(
            "SELECT pg_advisory_lock(hashtextextended('wq-topology:' || %s, 0))", [str(topic.id)]
        )
        began = time.monotonic()
        if many:
            results = publish_many(topic.name, [{"payload": {"n": n}} for n in range(3)])
        else:
            results = [publish(topic.name, {"n": 1})]
        waited = time.monotonic() - began

    assert {(r.status, r.error.code) for r in results} == {("Rejected", "TransportUnavailable")}
    assert "lock timeout" in results[0].error.message
    assert waited < 30
    assert publish(topic.name, {"n": 2}).status == "Accepted"  # released with its session


@pytest.mark.parametrize("grant", [None, "grant-operator", "grant-runtime"])
def test_no_session_but_a_sweepers_holds_the_sweep_lock(runtime_role, grant):
    """The sweep lock was an advisory lock, which any role that may connect can take: a session
    of a reporting login, or of an operator, that took it stopped every sweeper's passes (no
    lease expired, nothing was purged) for as long as it liked. It is a row lock now, on a table
    no granted role may read, lock or write: only the procedures take it."""
    if grant:
        call_command("workqueue", grant, runtime_role, stdout=io.StringIO())
    with connect_as(runtime_role) as holder:
        holder.execute("SELECT pg_advisory_lock(hashtextextended('wq-sweep', 0))")
        with transport.sweep_lock() as acquired:
            assert acquired
        for statement in (
            "SELECT 1 FROM workqueue_sweep_lock FOR UPDATE",
            "SELECT 1 FROM workqueue_sweep_lock FOR KEY SHARE",
            "LOCK TABLE workqueue_sweep_lock IN ACCESS SHARE MODE",
            "INSERT INTO workqueue_sweep_lock (id) VALUES (2)",
            "DELETE FROM workqueue_sweep_lock",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege), holder.transaction():
                holder.execute(statement)


@pytest.mark.parametrize("settle", ["wq_retry", "wq_dead_letter"])
def test_a_lease_holder_cannot_store_an_error_text_past_the_limit(runtime_role, settle):
    """The procedures stored any error text whole: 30 dead letters of 8 MB errors made one
    dead-letter page read 252 MB. The runtime cuts its own at MAX_ERROR_LENGTH; so do they."""
    subscription = SubscriptionFactory()
    publish(subscription.topic.name, {})
    [held] = Receiver(subscription.id, "host-a").receive(1).deliveries
    call_command("workqueue", "grant-runtime", runtime_role)
    params = {"delay_seconds": 0} if settle == "wq_retry" else {"reason": "X"}

    with connect_as(runtime_role) as conn:
        [(affected,)] = _call(
            conn,
            settle,
            delivery_id=held.delivery_id,
            lease_token=held.lease_token,
            error="e" * 1_000_000,
            **params,
        )
    assert affected == 1
    stored = Delivery.objects.get(pk=held.delivery_id).last_error
    assert stored == "e" * MAX_ERROR_LENGTH


@pytest.mark.parametrize(("extra", "status"), [(0, "Accepted"), (1, "Rejected")])
def test_an_honest_publish_keeps_the_exact_size_rule(extra, status):
    # The canonical envelope (sorted keys, no spaces) of exactly max_payload_bytes is accepted,
    # one byte more is not: many separators, so jsonb's own text is far longer than canonical.
    topic = TopicFactory(max_payload_bytes=1000)
    payload = {f"k{i:03}": i for i in range(64)}
    envelope = {
        "attributes": None,
        "correlation_id": None,
        "partition_key": None,
        "payload": payload,
        "payload_ref": None,
    }
    payload["pad"] = "x" * (1000 + extra - len(canonical_json(envelope)) - len(',"pad":""'))
    assert len(canonical_json({**envelope, "payload": payload})) == 1000 + extra

    assert publish(topic.name, payload).status == status


def test_the_readable_delivery_columns_are_all_but_the_lease_token():
    columns = [field.column for field in Delivery._meta.concrete_fields]
    assert list(DELIVERY_READABLE_COLUMNS) == [c for c in columns if c != LEASE_TOKEN_COLUMN]


OPERATOR_CALLS = {
    "wq_replay": {"note": "x"},
    "wq_discard": {"allow_pending": True, "reason": "x"},
    "wq_cancel": {"reason": "x"},
    "wq_lock_topology": {},
    "wq_subscription_stats": {},
    "wq_list_dead_letters": {"page_size": 10},
    "wq_list_partitions": {"page_size": 10},
    "wq_backlog": {"cap": 10},
    "wq_read_committed_snapshot_state": {},
    "wq_retire_discard": {"actor": "x", "reason": "x", "batch_size": 10},
    "wq_retire_purge": {"batch_size": 10},
    "wq_resolve_dead_letters": {"action": "Replay", "dry_run": True},
    "wq_queue_gauges": {"cap": 10},
    "wq_discard_pending": {"keyed": False, "dry_run": True},
}


def test_the_runtime_role_cannot_operate(runtime_role):
    subscription = SubscriptionFactory()
    call_command("workqueue", "grant-runtime", runtime_role)
    ids = {
        "subscription_id": subscription.id,
        "topic_id": subscription.topic_id,
        "delivery_id": str(uuid.uuid4()),
    }
    with connect_as(runtime_role) as conn:
        for name, params in OPERATOR_CALLS.items():
            wanted = set(get_procedure(name).param_names)
            arguments = {k: v for k, v in {**ids, **params}.items() if k in wanted}
            if name in RUNTIME_READABLE_COUNTS:
                # Read-only counts a host's metrics port serves: the runtime role may.
                _call(conn, name, **arguments)
                continue
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match=name):
                _call(conn, name, **arguments)


def test_the_operator_role_operates_and_neither_claims_nor_publishes(runtime_role):
    assert {n for n, p in PROCEDURES.items() if p.grant is Grant.OPERATOR} == set(OPERATOR_CALLS)
    subscription = SubscriptionFactory()
    publish(subscription.topic.name, {"n": 1})
    [held] = Receiver(subscription.id).receive(1).deliveries
    call_command("workqueue", "grant-operator", runtime_role)

    with connect_as(runtime_role) as conn:
        cancelled = _call(
            conn,
            "wq_cancel",
            subscription_id=subscription.id,
            delivery_id=held.delivery_id,
            actor="ops",
            reason="stop",
        )
        assert cancelled == [(1,)]
        [stats] = _call(conn, "wq_subscription_stats", subscription_id=subscription.id)
        assert stats[1] == 1  # in flight
        # Bulk recovery writes through its procedure alone, as the single operations do.
        resolved = _call(
            conn,
            "wq_resolve_dead_letters",
            subscription_id=subscription.id,
            action="Discard",
            dry_run=False,
            actor="ops",
            note="x",
        )
        assert resolved == [(0, 0, None)]  # nothing dead-lettered yet
        for name in ("wq_claim", "wq_complete", "wq_publish", "wq_purge_orphan_messages"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match=name):
                _call(conn, name)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT lease_token FROM workqueue_delivery")


def test_the_admin_and_the_orm_read_deliveries_as_the_application_role(
    runtime_role, pg_conn, client
):
    # The web process holds both grants, plus what Django itself needs on its own tables.
    subscription = SubscriptionFactory()
    publish(subscription.topic.name, {"n": 1})
    [held] = Receiver(subscription.id).receive(1).deliveries
    client.force_login(User.objects.create_superuser("admin", password="pw"))
    pg_conn.execute(
        f'GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO "{runtime_role}"'
    )
    pg_conn.execute(f'GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO "{runtime_role}"')
    call_command("workqueue", "grant-runtime", runtime_role)
    call_command("workqueue", "grant-operator", runtime_role)

    owner = connection.settings_dict["USER"]
    connection.close()
    connection.settings_dict["USER"] = runtime_role
    try:
        assert [d.status for d in Delivery.objects.filter(pk=held.delivery_id)] == ["InFlight"]
        changelist = client.get(reverse("admin:workqueue_delivery_changelist"))
        change = client.get(reverse("admin:workqueue_delivery_change", args=[held.delivery_id]))
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_user")
            assert cursor.fetchone() == (runtime_role,)
    finally:
        connection.close()
        connection.settings_dict["USER"] = owner
    assert changelist.status_code == 200
    assert change.status_code == 200
    assert held.delivery_id in change.content.decode()
    assert held.lease_token not in change.content.decode()


def test_a_migrate_renews_the_grants_that_roles_held_before_the_upgrade(pg_conn):
    """Grants name each procedure and each readable column, so a role granted before an
    upgrade lacked what the upgrade added (the admin failed with "permission denied") until
    someone re-ran grant-runtime / grant-operator. Every migrate renews them, one with nothing
    of ours left to apply too: a migrate that failed after the workqueue migrations committed
    sent no post_migrate, and the next one applied nothing of ours, so the roles kept lacking
    what the upgrade added (a runtime role could not sweep the host records). A flush
    (post_migrate without a plan) and roles without a grant are left be."""
    app = apps.get_app_config("workqueue")
    resolve = pg_conn.execute(
        "SELECT oid::regprocedure::text FROM pg_proc WHERE proname = 'wq_resolve_dead_letters'"
    ).fetchone()[0]

    def holds(role: str) -> tuple[bool, bool, bool]:
        return pg_conn.execute(
            "SELECT has_column_privilege(%s, 'workqueue_delivery', 'priority', 'SELECT'), "
            "has_function_privilege(%s, %s, 'EXECUTE'), "
            "has_function_privilege(%s, 'wq_claim'::regproc::oid, 'EXECUTE')",
            [role, role, resolve, role],
        ).fetchone()

    def migrated(plan: Any) -> None:
        post_migrate.send(
            sender=app,
            app_config=app,
            verbosity=0,
            interactive=False,
            using="default",
            apps=apps,
            plan=plan,
        )

    with (
        database_role(pg_conn, "wq_runtime") as runtime,
        database_role(pg_conn, "wq_operator") as operator,
        database_role(pg_conn, "wq_neither") as neither,
    ):
        call_command("workqueue", "grant-runtime", runtime)
        call_command("workqueue", "grant-operator", operator)
        # As granted before 0013 (bulk recovery) and 0015 (priorities) were applied.
        pg_conn.execute(f'REVOKE SELECT (priority) ON workqueue_delivery FROM "{runtime}"')
        pg_conn.execute(f'REVOKE SELECT (priority) ON workqueue_delivery FROM "{operator}"')
        pg_conn.execute(f'REVOKE EXECUTE ON FUNCTION {resolve} FROM "{operator}"')
        pg_conn.execute(f'GRANT SELECT ON workqueue_topic TO "{neither}"')

        migrated(None)  # a flush
        assert holds(runtime) == (False, False, True)
        assert holds(operator) == (False, False, False)

        migrated([])  # nothing of ours left to apply
        assert holds(runtime) == (True, False, True)
        assert holds(operator) == (True, True, False)
        assert holds(neither) == (False, False, False)
        with connect_as(runtime) as conn:
            conn.execute("SELECT id, priority FROM workqueue_delivery LIMIT 1")


def test_a_role_given_everything_before_keeps_no_trigger_or_write_on_the_procedures_tables(
    runtime_role, pg_conn
):
    """TRIGGER (and DML on the rate-limit buckets) survived grant-runtime after a GRANT ALL ON
    ALL TABLES: a trigger the role put on workqueue_message ran inside wq_publish as the
    procedures' owner, which then gave the role UPDATE on the deliveries and their tokens."""
    pg_conn.execute(f'GRANT ALL ON ALL TABLES IN SCHEMA public TO "{runtime_role}"')
    call_command("workqueue", "grant-runtime", runtime_role)

    held = pg_conn.execute(
        "SELECT t, p FROM unnest(%s::text[]) t, unnest(%s::text[]) p "
        "WHERE has_table_privilege(%s, t, p)",
        [
            list(PROCEDURE_WRITTEN_TABLES),
            ["INSERT", "UPDATE", "DELETE", "TRUNCATE", "TRIGGER", "REFERENCES"],
            runtime_role,
        ],
    ).fetchall()
    assert held == []
    with connect_as(runtime_role) as conn:
        conn.execute(
            "CREATE FUNCTION pg_temp.as_owner() RETURNS trigger LANGUAGE plpgsql "
            "AS 'BEGIN RETURN NEW; END'"
        )
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(
                "CREATE TRIGGER as_owner BEFORE INSERT ON workqueue_message "
                "FOR EACH ROW EXECUTE FUNCTION pg_temp.as_owner()"
            )


def test_the_runtime_role_runs_every_sweeper_step_and_records_task_runs(runtime_role, pg_conn):
    """grant-runtime gave nothing on workqueue_taskresult: every sweeper pass of a runtime
    role failed its task-results step (and `workqueue_sweep --once` with it), and a host could
    not record a task's run. The host-records step deletes as that role too."""
    call_command("workqueue", "grant-runtime", runtime_role)
    pg_conn.execute(f'GRANT SELECT ON auth_user TO "{runtime_role}"')
    long_ago = database_now() - dt.timedelta(days=365)
    HostRecord.objects.create(
        instance_id="gone", hostname="h", pid=1, started_at=long_ago, last_seen_at=long_ago
    )
    with queue_connections_as(runtime_role):
        result = Sweeper().run_once()
        TaskResult.objects.create(pk=uuid.uuid4(), worker_ids=["w"])

    assert result.failed_steps == []
    assert result.purged["host_records"] == 1


def test_the_operator_role_reads_api_keys_and_stamps_their_last_use_only(runtime_role, pg_conn):
    """The process serving the REST API authenticates keys: under grant-operator every
    key-authenticated request was a 500 (permission denied for table workqueue_apikey)."""
    call_command("workqueue", "grant-operator", runtime_role)

    [(reads, stamps, rewrites)] = pg_conn.execute(
        "SELECT has_table_privilege(%s, 'workqueue_apikey', 'SELECT'), "
        "has_column_privilege(%s, 'workqueue_apikey', 'last_used_at', 'UPDATE'), "
        "has_column_privilege(%s, 'workqueue_apikey', 'scopes', 'UPDATE')",
        [runtime_role] * 3,
    ).fetchall()
    assert (reads, stamps, rewrites) == (True, True, False)
