"""An Ordered key's publishes lock the key as it is stored, whoever calls the procedures and
whatever writes the topology (attack review helper-179): real PostgreSQL sessions racing one
another. Each test here failed on the code it was written against."""

from __future__ import annotations

import io
import json
import threading
import uuid
from typing import Any

import psycopg
import pytest
from django.core.management import call_command
from django.db import connections

from tests.factories import SubscriptionFactory, TopicFactory
from tests.support.database import lock_waits
from tests.support.roles import connect_as, database_role
from tests.support.waiting import wait_until
from workqueue import publish

pytestmark = pytest.mark.usefixtures("queue_db")

_PUBLISH = (
    "SELECT status, error_code FROM wq_publish(%(topic)s, %(id)s, %(key)s, NULL, "
    "'{\"n\": 1}'::jsonb, NULL, NULL, NULL, NULL, NULL, false, NULL, NULL, NULL, NULL)"
)


def _open_rows_of(pg_conn, subscription_id) -> list[tuple[Any, ...]]:
    """(message id, partition key, publish ordinal, status) of the subscription's open
    deliveries, by ordinal."""
    return pg_conn.execute(
        "SELECT d.message_id, d.partition_key, m.publish_ordinal, d.status "
        "FROM workqueue_delivery d JOIN workqueue_message m ON m.id = d.message_id "
        "WHERE d.subscription_id = %s AND d.status IN ('Pending', 'InFlight', 'DeadLettered') "
        "ORDER BY m.publish_ordinal",
        [subscription_id],
    ).fetchall()


def _in_flight_behind_an_open_head(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The InFlight rows that an earlier open delivery of their key precedes."""
    bad = []
    for i, row in enumerate(rows):
        if row[3] == "InFlight" and any(r[1] == row[1] for r in rows[:i]):
            bad.append(row)
    return bad


_PUBLISH_MANY = (
    "SELECT status, error_code FROM wq_publish_many(%(topic)s, %(items)s::jsonb, false, NULL)"
)


@pytest.mark.parametrize("path", ["wq_publish", "wq_publish_many"])
def test_a_key_the_column_would_cut_short_is_refused_not_locked_apart_from_it(pg_conn, path):
    """wq_publish locks the Ordered key as the caller spelled it ('wq:<topic>:<key>') and stores
    it in a varchar(200) column, which PostgreSQL silently cuts to 200 characters when the rest
    is spaces. The runtime role calls wq_publish directly (README, Database security), so a key
    of 200 characters and the same key with a trailing space are one key in every table (the
    claim's, the handler's) but two publish locks: a publish of the longer spelling held open
    does not hold back a publish of the shorter, whose later ordinal commits first and is
    claimed while the earlier delivery of the key is still to come. The procedures now refuse
    a key the column would change, as the application does."""
    topic = TopicFactory()
    sub = SubscriptionFactory(topic=topic, partition_mode="Ordered")
    key = "k" * 200
    with database_role(pg_conn, "wq_h179") as role:
        call_command("workqueue", "grant-runtime", role, stdout=io.StringIO())
        first_id, second_id = uuid.uuid4(), uuid.uuid4()
        first = connect_as(role)
        second = connect_as(role)
        claimer = connect_as(role)
        try:
            first.execute("BEGIN")
            if path == "wq_publish":
                [(status, code)] = first.execute(
                    _PUBLISH, {"topic": topic.name, "id": first_id, "key": key + " "}
                ).fetchall()
            else:
                items = [{"message_id": str(first_id), "partition_key": key + " ", "payload": {}}]
                [(status, code)] = first.execute(
                    _PUBLISH_MANY, {"topic": topic.name, "items": json.dumps(items)}
                ).fetchall()
            # Refused, as the application refuses it: stored, it would share the key's line
            # under a lock of its own.
            assert (status, code) == ("Rejected", "InvalidPartitionKey")
            second.execute("SET statement_timeout = '8s'")
            [(status, code)] = second.execute(
                _PUBLISH, {"topic": topic.name, "id": second_id, "key": key}
            ).fetchall()
            claimed = claimer.execute(
                "SELECT message_id, partition_key FROM wq_claim(%s, 'host-a', 10, NULL) "
                "WHERE kind = 'Claimed'",
                [sub.id],
            ).fetchall()
            first.execute("COMMIT")
        finally:
            for conn in (first, second, claimer):
                conn.close()

    rows = _open_rows_of(pg_conn, sub.id)
    stored_keys = {row[1] for row in rows}
    bad = _in_flight_behind_an_open_head(rows)
    assert not bad, (
        f"second publish {status}/{code}; claimed {[(str(m)[:8], len(k)) for m, k in claimed]}"
        f" (id, key length); stored keys "
        f"{[len(k) for k in stored_keys]} chars; open deliveries by ordinal: "
        f"{[(str(r[0])[:8], r[2], r[3]) for r in rows]}: the key's later publish is in flight "
        "while its earlier one waits Pending"
    )


@pytest.mark.parametrize("key", ["", "k ", "k" * 200 + " ", "k" * 201])
def test_the_procedures_refuse_the_keys_the_application_refuses(pg_conn, key):
    """Empty, ending in a space (which SQL Server's comparisons leave out), or longer than the
    column: refused by wq_publish and wq_publish_many as by publish()."""
    topic = TopicFactory()
    SubscriptionFactory(topic=topic, partition_mode="Ordered")
    [single] = pg_conn.execute(
        _PUBLISH, {"topic": topic.name, "id": uuid.uuid4(), "key": key}
    ).fetchall()
    items = [{"message_id": str(uuid.uuid4()), "partition_key": key, "payload": {}}]
    [batch] = pg_conn.execute(
        _PUBLISH_MANY, {"topic": topic.name, "items": json.dumps(items)}
    ).fetchall()

    assert single == batch == ("Rejected", "InvalidPartitionKey")


class _OpenPublish(threading.Thread):
    """A publish run on a session of its own inside a transaction that is left open until
    ``release`` is set, then committed (or rolled back)."""

    def __init__(self, params: dict[str, Any], *, roll_back: bool = False) -> None:
        super().__init__(daemon=True)
        self.params = params
        self.roll_back = roll_back
        self.worked = threading.Event()
        self.release = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        from tests.support.database import psycopg_params

        try:
            with psycopg.connect(autocommit=True, **psycopg_params()) as conn:
                conn.execute("BEGIN")
                self.result = conn.execute(_PUBLISH, self.params).fetchall()
                self.worked.set()
                self.release.wait(15)
                conn.execute("ROLLBACK" if self.roll_back else "COMMIT")
        except BaseException as exc:  # surfaced by the test
            self.error = exc
        finally:
            self.worked.set()


def test_an_ordered_subscription_enabled_by_a_plain_update_mid_publish_keeps_its_keys_order(
    pg_conn,
):
    """A publish looks for the topic's Ordered subscriptions (to lock the key) before it fans
    out; a subscription enabled in between gets the publish's delivery with its key never
    locked. The model takes the topology lock for such a save (test_safety's
    test_an_ordered_subscription_made_during_a_keyed_publish_waits_for_it), and since review
    helper-173 the database guards a plain UPDATE of partition_mode "whatever writes the row";
    a plain UPDATE of status (or of filter, topic_id, or an INSERT) takes no lock. The publish
    is held between its check and its fan-out by an uncommitted publish of its message id."""
    topic = TopicFactory()
    sub = SubscriptionFactory(topic=topic, partition_mode="Ordered", status="Disabled")
    message_id = uuid.uuid4()
    holder = _OpenPublish({"topic": topic.name, "id": message_id, "key": None}, roll_back=True)
    holder.start()
    assert holder.worked.wait(10) and holder.error is None
    first = _OpenPublish({"topic": topic.name, "id": message_id, "key": "k"})
    first.start()
    wait_until(lambda: lock_waits() == 1, timeout=10)  # past its Ordered check, at its insert
    # Enabled with a plain UPDATE, as a role that writes topology (or a script) may.
    enabling = threading.Thread(
        target=lambda: pg_conn.execute(
            "UPDATE workqueue_subscription SET status = 'Active' WHERE id = %s", [sub.id]
        ),
        daemon=True,
    )
    enabling.start()
    wait_until(lambda: not enabling.is_alive() or lock_waits() == 2, timeout=10)
    holder.release.set()  # rolled back: the first publish goes on to its fan-out
    holder.join(10)
    assert first.worked.wait(10) and first.error is None, first.error
    # A later publish of the key, through the application: it should wait for the first's
    # order lock until that commits.
    later = threading.Thread(
        target=lambda: (publish(topic.name, {"n": 3}, partition_key="k"), connections.close_all()),
        daemon=True,
    )
    later.start()
    later.join(1.0)
    with connect_as_owner() as claimer:
        claimed = claimer.execute(
            "SELECT message_id FROM wq_claim(%s, 'host-a', 10, NULL) WHERE kind = 'Claimed'",
            [sub.id],
        ).fetchall()
    first.release.set()
    first.join(10)
    later.join(10)
    enabling.join(10)
    assert first.error is None, first.error

    rows = _open_rows_of(pg_conn, sub.id)
    bad = _in_flight_behind_an_open_head(rows)
    assert not bad, (
        f"claimed {claimed} while the first publish was open; open deliveries by ordinal: "
        f"{[(str(r[0])[:8], r[2], r[3]) for r in rows]}: key k's later publish is in flight "
        "while its earlier one waits Pending"
    )


def connect_as_owner() -> psycopg.Connection:
    from tests.support.database import psycopg_params

    return psycopg.connect(autocommit=True, **psycopg_params())
