"""The runtime role: EXECUTE on the procedures and SELECT on the tables, never DML on the queue
tables, so the claim/settle/sweep rules cannot be bypassed."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from django.core.management import call_command

from tests.database import psycopg_params
from tests.factories import SubscriptionFactory
from workqueue import publish, publish_many
from workqueue.driver import get_driver
from workqueue.driver.procedures import get_procedure
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")


@pytest.fixture
def runtime_role(pg_conn):
    role = f"wq_runtime_{uuid.uuid4().hex[:8]}"
    pg_conn.execute(f'CREATE ROLE "{role}" LOGIN')
    yield role
    pg_conn.execute(f'DROP OWNED BY "{role}"')
    pg_conn.execute(f'DROP ROLE "{role}"')


def _connect_as(role: str) -> psycopg.Connection:
    params = psycopg_params()
    params["user"] = role
    return psycopg.connect(autocommit=True, **params)


def test_runtime_role_cannot_write_queue_tables_but_can_publish_claim_and_complete(
    runtime_role,
):
    subscription = SubscriptionFactory()
    call_command("workqueue", "grant-runtime", runtime_role)
    driver = get_driver()

    with _connect_as(runtime_role) as conn:
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
    with _connect_as(runtime_role) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
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

    with _connect_as(runtime_role) as conn:
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

    with _connect_as(runtime_role) as conn:
        cursor = conn.execute(get_driver().scaler_query(subscription.name))
        assert [column.name for column in cursor.description] == ["Backlog"]
        assert cursor.fetchall() == [(2000,)]
