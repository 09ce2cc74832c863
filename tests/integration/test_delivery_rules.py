"""The database's own rules for a delivery's columns: a status among the five, a priority from
-100 to 100, a count of attempts never below 0. Only the procedures write deliveries and they
write nothing else, so these rules guard against a mistake in a procedure, or a table owner's
hand-written SQL: whatever writes the row, an INSERT or an UPDATE, the database refuses it.

Since migration 0047 PostgreSQL keeps the rules in the columns' types (domains) instead of
CHECK constraints, which it planned again at every statement that wrote a delivery; migrating
back below 0047 puts the CHECK constraints back (tests/integration/test_migrations.py goes back
and forth)."""

from __future__ import annotations

import psycopg
import pytest
from django.db import IntegrityError, connection, transaction

from tests.factories import SubscriptionFactory, TopicFactory
from workqueue import publish
from workqueue.driver import get_driver
from workqueue.models import Delivery

pytestmark = pytest.mark.usefixtures("queue_db")

BREAKING_WRITES = [
    ("status", "'Bogus'"),
    ("status", "'pending'"),
    ("priority", "101"),
    ("priority", "-101"),
    ("attempt_count", "-1"),
]


@pytest.fixture
def delivery() -> Delivery:
    topic = TopicFactory()
    SubscriptionFactory(topic=topic)
    result = publish(topic.name, {"n": 1})
    assert result.accepted
    return Delivery.objects.get(message_id=result.message_id)


@pytest.mark.parametrize(("column", "value"), BREAKING_WRITES)
def test_an_update_outside_the_rules_is_refused_by_the_database(pg_conn, delivery, column, value):
    with pytest.raises(psycopg.errors.CheckViolation):
        pg_conn.execute(
            f"UPDATE workqueue_delivery SET {column} = {value} WHERE id = %s", [delivery.id]
        )

    unchanged = pg_conn.execute(
        f"SELECT {column}::text FROM workqueue_delivery WHERE id = %s", [delivery.id]
    ).fetchone()[0]
    assert unchanged == str(getattr(delivery, column))


@pytest.mark.parametrize(("column", "value"), BREAKING_WRITES)
def test_an_insert_outside_the_rules_is_refused_by_the_database(pg_conn, delivery, column, value):
    # A copy of a real delivery (for another subscription, so that only the broken rule can
    # refuse it) with one column broken: every other column as the procedures wrote it.
    copied = ["message_id", "status", "partition_key", "order_key", "attempt_count"]
    copied += ["is_replay", "visible_at", "priority"]
    values = {name: f"d.{name}" for name in copied}
    values[column] = value
    with pytest.raises(psycopg.errors.CheckViolation):
        pg_conn.execute(
            f"INSERT INTO workqueue_delivery (id, subscription_id, {', '.join(values)}) "
            f"SELECT gen_random_uuid(), gen_random_uuid(), {', '.join(values.values())} "
            "FROM workqueue_delivery d WHERE d.id = %s",
            [delivery.id],
        )


def test_the_rules_let_every_value_the_procedures_write_through(pg_conn, delivery):
    for status in ("Pending", "InFlight", "Completed", "DeadLettered", "Discarded"):
        pg_conn.execute(
            "UPDATE workqueue_delivery SET status = %s WHERE id = %s", [status, delivery.id]
        )
    for priority in (-100, 0, 100):
        pg_conn.execute(
            "UPDATE workqueue_delivery SET priority = %s WHERE id = %s", [priority, delivery.id]
        )
    pg_conn.execute("UPDATE workqueue_delivery SET attempt_count = 0 WHERE id = %s", [delivery.id])
    row = pg_conn.execute(
        "SELECT status, priority, attempt_count FROM workqueue_delivery WHERE id = %s",
        [delivery.id],
    ).fetchone()
    # Read back as the base types (a client sees no domain).
    assert row == ("Discarded", 100, 0)


class Rollback(Exception):
    """Raised to leave a ``transaction.atomic()`` block by rolling it back."""


@pytest.mark.parametrize("column", ["status", "priority", "attempt_count"])
def test_a_column_turned_back_into_its_plain_type_gets_its_rule_again_at_the_next_install(
    delivery, column
):
    # An AlterField of one of these fields would make its column a plain type again, with no
    # rule: the next install (every migrate that reinstalls) gives it its domain back, column
    # by column (audit helper-111: only the status's type was looked at).
    plain = {"status": "varchar(20)", "priority": "smallint", "attempt_count": "integer"}
    breaking = dict(BREAKING_WRITES)
    with pytest.raises(Rollback), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE workqueue_delivery ALTER COLUMN {column} TYPE {plain[column]}")
        get_driver().install_procedures(connection)
        with pytest.raises(IntegrityError), transaction.atomic():
            cursor.execute(
                f"UPDATE workqueue_delivery SET {column} = {breaking[column]} WHERE id = %s",
                [delivery.id],
            )
        raise Rollback
