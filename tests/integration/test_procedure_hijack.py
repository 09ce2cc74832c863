"""The ``wq_*`` functions run as their owner (SECURITY DEFINER). A role that may create objects
in the schema they live in must not be able to make them run its code: not by planting a
better-matching overload of a built-in function the bodies call (``make_interval(secs =>
integer)``, ``hashtextextended(text, integer)``), nor an operator (``varchar = varchar`` wins
over the built-in ``text = text`` for every status comparison). PostgreSQL 14 and older grant
CREATE on ``public`` to every role; here it is granted to the attacker explicitly.

Migrating, ``grant-runtime`` and ``validate-bindings`` refuse or report such a schema, and no
``wq_*`` function that reads or writes the queue is executable by PUBLIC.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connection, transaction

from tests.factories import SubscriptionFactory
from tests.support.roles import database_role
from workqueue import publish, publish_many, transport
from workqueue.driver import get_driver
from workqueue.driver.postgresql import GUARD_FUNCTIONS
from workqueue.exceptions import WorkQueueConfigurationError
from workqueue.operators.operations import validate_bindings
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")

# Each shadow notes that it ran, and as whom, then does what the built-in would.
SHADOWS = [
    """CREATE FUNCTION {schema}.make_interval(secs integer) RETURNS interval
       LANGUAGE plpgsql AS $$BEGIN
           INSERT INTO {schema}.shadow_log VALUES ('make_interval', current_user);
           RETURN pg_catalog.make_interval(secs => secs::double precision);
       END$$""",
    """CREATE FUNCTION {schema}.hashtextextended(text, integer) RETURNS bigint
       LANGUAGE plpgsql AS $$BEGIN
           INSERT INTO {schema}.shadow_log VALUES ('hashtextextended', current_user);
           RETURN pg_catalog.hashtextextended($1, $2::bigint);
       END$$""",
    """CREATE FUNCTION {schema}.shadow_eq(varchar, varchar) RETURNS boolean
       LANGUAGE plpgsql AS $$BEGIN
           INSERT INTO {schema}.shadow_log VALUES ('=', current_user);
           RETURN $1::text OPERATOR(pg_catalog.=) $2::text;
       END$$""",
    """CREATE OPERATOR {schema}.= (LEFTARG = varchar, RIGHTARG = varchar,
                                  FUNCTION = {schema}.shadow_eq)""",
]


@pytest.fixture
def schema(pg_conn) -> str:
    return pg_conn.execute("SELECT quote_ident(current_schema())").fetchone()[0]


@pytest.fixture
def creator(pg_conn, schema) -> Iterator[str]:
    """A role that may create objects in the work queue's schema and has no other privilege."""
    with database_role(pg_conn, "wq_creator") as role:
        pg_conn.execute(f'GRANT CREATE ON SCHEMA {schema} TO "{role}"')
        yield role


@pytest.fixture
def shadows(pg_conn, schema, creator) -> Iterator[psycopg.Connection]:
    """The creator's overloads, planted after the procedures were installed; yields the
    connection on which to read what ran. Dropped (with the creator's rights) afterwards."""
    pg_conn.execute(f"CREATE TABLE {schema}.shadow_log (shadow text, as_role text)")
    pg_conn.execute(f"GRANT INSERT ON {schema}.shadow_log TO PUBLIC")
    try:
        pg_conn.execute(f'SET ROLE "{creator}"')
        for statement in SHADOWS:
            pg_conn.execute(statement.format(schema=schema))
        pg_conn.execute("RESET ROLE")
        yield pg_conn
    finally:
        pg_conn.execute("RESET ROLE")
        pg_conn.execute(f'DROP OWNED BY "{creator}" CASCADE')
        pg_conn.execute(f"DROP TABLE {schema}.shadow_log")


def test_planted_overloads_never_run_inside_the_procedures(shadows, schema):
    ordered = SubscriptionFactory(partition_mode="Ordered", lease_seconds=30)
    plain = SubscriptionFactory(topic=ordered.topic)
    topic = ordered.topic.name
    # Only procedure calls from here on: Django's own queries resolve operators through the
    # session's search_path, which includes the schema (that is what the install check is for).
    shadows.execute(f"TRUNCATE {schema}.shadow_log")

    first = publish(topic, {"n": 1}, partition_key="k", deduplication_key="d-1")
    assert first.status == "Accepted"
    assert [r.status for r in publish_many(topic, [{"partition_key": "k"}] * 2)] == [
        "Accepted",
        "Accepted",
    ]

    receiver = Receiver(ordered.id)
    [head] = receiver.receive(10).deliveries  # one per key at a time on an Ordered subscription
    assert receiver.extend_lease(head).state == "Held"
    assert receiver.retry(head, delay_seconds=0, error="again").outcome == "Settled"
    [head] = receiver.receive(10).deliveries
    assert receiver.dead_letter(head, reason="Poison").outcome == "Settled"
    blocked, _ = transport.list_partitions(str(ordered.id), "Blocked", None, 10)
    assert [p.partition_key for p in blocked] == ["k"]
    assert [d.delivery_id for d in transport.list_dead_letters(str(ordered.id), None, 10)] == [
        head.delivery_id
    ]
    assert transport.replay(str(ordered.id), head.delivery_id, "ops", None)
    [head] = receiver.receive(10).deliveries
    assert receiver.complete(head).outcome == "Settled"

    others = Receiver(plain.id)
    claimed = others.receive(10).deliveries
    assert len(claimed) == 3
    assert others.release(claimed[0]).outcome == "Settled"
    assert transport.discard_or_cancel(str(plain.id), claimed[1].delivery_id, "ops", "x").changed
    assert others.acknowledge_cancel(claimed[1]).outcome == "Settled"
    assert [r.outcome for r in others.complete_many(claimed[2:]).values()] == ["Settled"]
    assert transport.subscription_stats(str(plain.id))["pending"] == 1
    assert transport.backlog(str(ordered.id)) is not None

    with transport.sweep_lock() as acquired:
        assert acquired
        transport.expire_leases_all()
        for step in ("terminal_deliveries", "orphan_messages", "expired_deduplications"):
            transport.purge(step, 100)
    driver = get_driver()
    with driver.transaction() as conn:
        driver.call("wq_lock_topology", {"topic_id": str(ordered.topic_id)}, connection=conn)

    ran = shadows.execute(f"SELECT DISTINCT shadow, as_role FROM {schema}.shadow_log").fetchall()
    assert ran == [], f"planted code ran inside the procedures: {ran}"


def test_installing_refuses_a_schema_where_other_roles_may_create(creator, schema):
    refused = rf'{creator}.*REVOKE CREATE ON SCHEMA {schema} FROM "'
    with pytest.raises(WorkQueueConfigurationError, match=refused), transaction.atomic():
        get_driver().install_procedures(connection)


def test_granting_refuses_and_validation_reports_such_a_schema(creator, pg_conn):
    refused = pytest.raises(CommandError, match=rf"{creator}.*REVOKE CREATE ON SCHEMA")
    with database_role(pg_conn, "wq_runtime") as runtime, refused:
        call_command("workqueue", "grant-runtime", runtime)
    [issue] = [i for i in validate_bindings() if creator in i.message]
    assert (issue.severity, issue.subject) == ("Error", "database")
    assert "REVOKE CREATE ON SCHEMA" in issue.message


def test_public_may_create_in_the_schema_is_reported_as_public(pg_conn, schema):
    pg_conn.execute(f"GRANT CREATE ON SCHEMA {schema} TO PUBLIC")
    try:
        messages = [i.message for i in validate_bindings() if i.subject == "database"]
    finally:
        pg_conn.execute(f"REVOKE CREATE ON SCHEMA {schema} FROM PUBLIC")
    assert any(f"REVOKE CREATE ON SCHEMA {schema} FROM PUBLIC" in m for m in messages), messages


def test_no_queue_function_is_executable_by_public(pg_conn):
    rows = pg_conn.execute(
        """SELECT p.oid::regprocedure::text, p.prosecdef, p.proconfig,
                  has_function_privilege('public', p.oid, 'EXECUTE')
             FROM pg_proc p
            WHERE p.pronamespace = current_schema()::regnamespace AND p.proname LIKE 'wq\\_%%'"""
    ).fetchall()
    assert len(rows) > 20
    public = {signature for signature, *_, executable in rows if executable}
    # The filter guard runs inside a CHECK constraint, as whoever writes a subscription row, so
    # everyone may call it; it runs with the caller's rights and reads no table.
    assert public == GUARD_FUNCTIONS
    for signature, definer, config, _ in rows:
        if definer or signature in GUARD_FUNCTIONS:
            assert "search_path=pg_catalog, pg_temp" in config, signature


def test_function_bodies_name_every_table_and_function_by_schema(pg_conn):
    # With the schema out of their search_path, an unqualified name would fail at run time
    # (or, for a function, resolve only in pg_catalog): a table the installer does not know
    # to qualify shows up here first.
    bodies = pg_conn.execute(
        "SELECT p.proname, p.prosrc FROM pg_proc p "
        "WHERE p.pronamespace = current_schema()::regnamespace AND p.proname LIKE 'wq\\_%%'"
    ).fetchall()
    unqualified = re.compile(r"""(?<![.\w"'])\b(workqueue_\w+\b|wq_\w+\s*\()""")
    found = {name: unqualified.findall(body) for name, body in bodies}
    assert {name: names for name, names in found.items() if names} == {}
    assert any(".workqueue_delivery" in body for _, body in bodies)


class Rollback(Exception):
    """Raised to leave a ``transaction.atomic()`` block by rolling it back."""


def _reinstall_after_losing_create(schema: str, creator: str) -> None:
    """On Django's connection, in its open transaction: the creator loses CREATE on the schema
    (what it made there stays: the install checks who may create now, not what was made), and
    the procedures are installed as they are on a database older than 0047, which makes the
    delivery columns' domains."""
    driver = get_driver()
    with connection.cursor() as cursor:
        cursor.execute(f'REVOKE CREATE ON SCHEMA {schema} FROM "{creator}"')
    driver.revert_delivery_rules(connection)
    driver.install_procedures(connection)


def test_an_operator_planted_before_the_upgrade_is_not_bound_into_the_delivery_rules(
    shadows, schema, creator
):
    # The domains' constraints are made by the migrating session, whose search_path holds the
    # schema: a bare `VALUE IN (...)` took the planted varchar = varchar, and every write of a
    # delivery ran it (seen failing so).
    subscription = SubscriptionFactory()
    with pytest.raises(Rollback), transaction.atomic():
        _reinstall_after_losing_create(schema, creator)
        shadows_before = _shadow_log(schema)
        assert publish(subscription.topic.name, {"n": 1}, enlist=True).accepted
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE workqueue_delivery SET status = 'Completed', priority = 1, "
                "attempt_count = 1"
            )
        assert _shadow_log(schema) == shadows_before == []
        raise Rollback


def _shadow_log(schema: str) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT shadow, as_role FROM {schema}.shadow_log")
        return cursor.fetchall()


@pytest.mark.parametrize("name", ["wq_delivery_status", "wq_priority", "wq_attempt_count"])
def test_installing_refuses_a_type_another_role_made_under_a_domains_name(
    pg_conn, schema, creator, name
):
    # Taken over, the creator's type would be the column's: it could add a constraint that
    # runs as whoever writes a delivery (the procedures' owner), or drop the column with it.
    driver = get_driver()
    refused = pytest.raises(DatabaseError, match="is not the domain this install makes")
    with refused, transaction.atomic(), connection.cursor() as cursor:
        driver.revert_delivery_rules(connection)  # as before 0047: the names are free
        cursor.execute(f'SET ROLE "{creator}"')
        cursor.execute(f"CREATE DOMAIN {schema}.{name} AS integer")
        cursor.execute("RESET ROLE")
        cursor.execute(f'REVOKE CREATE ON SCHEMA {schema} FROM "{creator}"')
        driver.install_procedures(connection)
