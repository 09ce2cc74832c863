"""Review helper-173: what the runtime, operator and scaler grants leave a role that a broad
grant (GRANT ALL ON ALL TABLES or SEQUENCES) or an earlier release's grant gave more: nothing
but the owner may hold TRIGGER, TRUNCATE or REFERENCES on any of the work queue's tables, or
anything on the procedures' sequences, and no scaler reads a lease token. Each test failed on
the code before."""

from __future__ import annotations

import io

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection

from tests.factories import SubscriptionFactory
from tests.support.roles import connect_as, database_role
from workqueue import publish
from workqueue.driver.install import renew_grants
from workqueue.models import Delivery, Subscription
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")


@pytest.fixture
def role(pg_conn):
    with database_role(pg_conn, "wq_r173") as name:
        yield name


def test_a_runtime_role_granted_all_tables_before_plants_a_trigger_that_runs_as_the_owner(
    role, pg_conn
):
    """grant-runtime takes back TRIGGER only on the tables the procedures write. After the
    GRANT ALL ON ALL TABLES the grants say they undo, the role keeps TRIGGER (and TRUNCATE,
    REFERENCES) on the topology tables, which the owner's own sessions write (sync-topology in a
    deploy, an admin edit as the owner). A trigger the role puts there runs as the owner: here it
    gives the role the lease tokens and UPDATE on the deliveries."""
    pg_conn.execute(f'GRANT ALL ON ALL TABLES IN SCHEMA public TO "{role}"')
    call_command("workqueue", "grant-runtime", role, stdout=io.StringIO())
    subscription = SubscriptionFactory()
    publish(subscription.topic.name, {"n": 1})
    [held] = Receiver(subscription.id).receive(1).deliveries  # another host's delivery

    with connect_as(role) as attacker:
        attacker.execute(
            "CREATE FUNCTION pg_temp.as_owner() RETURNS trigger LANGUAGE plpgsql AS $f$ BEGIN "
            f'GRANT SELECT, UPDATE ON workqueue_delivery TO "{role}"; RETURN NULL; END $f$'
        )
        try:
            attacker.execute(
                "CREATE TRIGGER wq_review173 AFTER UPDATE ON workqueue_subscription "
                "FOR EACH STATEMENT EXECUTE FUNCTION pg_temp.as_owner()"
            )
        except psycopg.errors.InsufficientPrivilege:
            return  # what the grants promise
        # The owner's next topology write (a deploy's sync-topology, an admin edit).
        Subscription.objects.filter(pk=subscription.pk).update(max_attempts=7)
        [(token,)] = attacker.execute(
            "SELECT lease_token FROM workqueue_delivery WHERE id = %s", [held.delivery_id]
        ).fetchall()
        attacker.execute(
            "UPDATE workqueue_delivery SET status = 'Completed', lease_token = NULL WHERE id = %s",
            [held.delivery_id],
        )
    status = Delivery.objects.get(pk=held.delivery_id).status
    pytest.fail(
        f"runtime role {role} kept TRIGGER on workqueue_subscription; its trigger ran as the "
        f"owner at a topology write and gave it the lease token ({token}) and UPDATE on "
        f"deliveries: another host's delivery is now {status} without its token"
    )


def test_a_runtime_role_granted_all_sequences_before_reorders_an_ordered_key(role, pg_conn):
    """The publish ordinals come from wq_publish_ordinal_seq, which only the procedures should
    move. grant-runtime takes nothing back on it, so after GRANT ALL ON ALL SEQUENCES a runtime
    role can setval it back: the next publish of an Ordered key gets an order key below the
    waiting ones and runs first (or, landing on a stored ordinal, is refused)."""
    pg_conn.execute(f'GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO "{role}"')
    call_command("workqueue", "grant-runtime", role, stdout=io.StringIO())
    pg_conn.execute(
        "SELECT setval('wq_publish_ordinal_seq', GREATEST(nextval('wq_publish_ordinal_seq'), 2000))"
    )
    subscription = SubscriptionFactory(partition_mode="Ordered")
    topic = subscription.topic.name
    first = publish(topic, {"n": 1}, partition_key="acct-1")
    assert first.status == "Accepted"

    with connect_as(role) as attacker:
        try:
            attacker.execute("SELECT setval('wq_publish_ordinal_seq', 1000)")
        except psycopg.errors.InsufficientPrivilege:
            return  # what the grants promise
    second = publish(topic, {"n": 2}, partition_key="acct-1")
    assert second.status == "Accepted"
    [claimed] = Receiver(subscription.id).receive(5).deliveries
    assert str(claimed.message_id) == str(first.message_id), (
        f"runtime role {role} moved wq_publish_ordinal_seq back: the Ordered key ran the "
        "second publish before the first"
    )


@pytest.mark.parametrize(
    "before",
    [
        # What grant-scaler gave until 0006_claim_key_walk (git show b1ec90b^).
        "GRANT SELECT ON workqueue_subscription, workqueue_delivery TO {role}",
        # The broad grant that grant-runtime and grant-operator say they undo.
        "GRANT ALL ON ALL TABLES IN SCHEMA public TO {role}",
    ],
    ids=["pre-0006-scaler-grant", "grant-all-tables"],
)
def test_a_scaler_role_granted_before_keeps_the_lease_tokens(role, pg_conn, before):
    """grant-scaler takes nothing back, and migrate renews only the runtime and operator
    grants: a scaler role granted by a release before 0006 (table-wide SELECT on the
    deliveries) keeps reading every lease token after the upgrade and after grant-scaler is run
    again, unlike a freshly granted one (README: scaler may do "anything else": no; "never a
    delivery's lease token"). After GRANT ALL it keeps DML on the queue tables too."""
    pg_conn.execute(before.format(role=f'"{role}"'))
    subscription = SubscriptionFactory()
    publish(subscription.topic.name, {"n": 1})
    [held] = Receiver(subscription.id).receive(1).deliveries
    renew_grants(connection)  # what every migrate runs
    call_command("workqueue", "grant-scaler", role, stdout=io.StringIO())

    with connect_as(role) as scaler:
        try:
            [(token,)] = scaler.execute(
                "SELECT lease_token FROM workqueue_delivery WHERE id = %s", [held.delivery_id]
            ).fetchall()
        except psycopg.errors.InsufficientPrivilege:
            return  # what a freshly granted scaler role gets
    writes = pg_conn.execute(
        "SELECT array_agg(p ORDER BY p) FROM unnest(ARRAY['INSERT','UPDATE','DELETE','TRIGGER']) p "
        "WHERE has_table_privilege(%s, 'workqueue_delivery', p)",
        [role],
    ).fetchone()[0]
    pytest.fail(
        f"scaler role {role} still reads another host's lease token ({token} == "
        f"{held.lease_token}) after migrate's renewal and grant-scaler; it also holds {writes} "
        "on workqueue_delivery"
    )


def test_a_topology_writing_role_changes_the_partition_mode_under_live_deliveries(role, pg_conn):
    """The partition mode may not change once a subscription has deliveries, but the rule lives
    in the model's validation only. The web process's role (grant-runtime plus the topology DML
    the README tells to give a process whose users edit topology) turns an Ordered subscription
    whose key is blocked by a dead-lettered head into Exclusive with one UPDATE: the key's next
    delivery runs past its dead-lettered head (Ordered's rule), where the delete guard, for
    comparison, is a trigger that holds "whatever deletes it"."""
    call_command("workqueue", "grant-runtime", role, stdout=io.StringIO())
    pg_conn.execute(
        "GRANT INSERT, UPDATE, DELETE ON workqueue_transport, workqueue_topic, "
        f'workqueue_subscription TO "{role}"'
    )
    subscription = SubscriptionFactory(partition_mode="Ordered")
    topic = subscription.topic.name
    publish(topic, {"n": 1}, partition_key="acct")
    publish(topic, {"n": 2}, partition_key="acct")
    receiver = Receiver(subscription.id)
    [head] = receiver.receive(5).deliveries
    assert receiver.dead_letter(head, "Poison").outcome == "Settled"
    assert receiver.receive(5).deliveries == []  # the dead-lettered head holds the key

    with connect_as(role) as web:
        try:
            web.execute(
                "UPDATE workqueue_subscription SET partition_mode = 'Exclusive' WHERE id = %s",
                [subscription.id],
            )
        except psycopg.errors.Error:
            return  # refused by the database, as the admin refuses it
    receiver = Receiver(subscription.id)
    overtaken = receiver.receive(5).deliveries
    assert overtaken == [], (
        f"role {role} changed the partition mode under live deliveries with one UPDATE; the "
        f"key's second delivery ran past its dead-lettered head: {overtaken}"
    )
