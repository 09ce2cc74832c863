"""A deduplication key is stored in a varchar(200) column, which PostgreSQL cuts to 200
characters without an error when the rest is spaces, while the publish's later statements (the
confirmation, the owner's lookup) compare the key as given (attack review helper-193). The
runtime role calls the procedures itself: its key of 200 characters and a space was never
confirmed, held for the 120 s reservation instead of its window, and then a duplicate was
accepted. The procedures refuse such a key, as 0057 refuses such a partition key."""

from __future__ import annotations

import io
import json
import uuid

import psycopg
import pytest
from django.core.management import call_command

from tests.factories import SubscriptionFactory, TopicFactory
from tests.support.roles import connect_as, database_role
from workqueue import publish
from workqueue.models import Deduplication

pytestmark = pytest.mark.usefixtures("queue_db")

_PUBLISH = (
    "SELECT message_id, status, error_code FROM wq_publish(%(topic)s, %(id)s, NULL, NULL, "
    "'{\"n\": 1}'::jsonb, NULL, NULL, %(dedup)s, 3600, NULL, false, NULL, NULL, NULL, NULL)"
)
_PUBLISH_MANY = (
    "SELECT status, error_code FROM wq_publish_many(%(topic)s, %(items)s::jsonb, false, NULL)"
)


def test_a_deduplication_key_the_column_would_cut_is_refused_and_the_stored_key_keeps_working(
    pg_conn,
):
    topic = TopicFactory()
    SubscriptionFactory(topic=topic)
    stored_key = "d" * 200
    with database_role(pg_conn, "wq_h193") as role:
        call_command("workqueue", "grant-runtime", role, stdout=io.StringIO())
        with connect_as(role) as runtime:
            [(_, status, code)] = runtime.execute(
                _PUBLISH, {"topic": topic.name, "id": uuid.uuid4(), "dedup": stored_key + " "}
            ).fetchall()
    ledger = list(Deduplication.objects.filter(topic=topic).values_list("status", "expires_at"))

    first = publish(topic.name, {"n": 2}, deduplication_key=stored_key)
    again = publish(topic.name, {"n": 3}, deduplication_key=stored_key)

    assert (status, code, ledger) == ("Rejected", "InvalidDeduplication", []), (
        f"a key of 200 characters and a space was {status} {code}; ledger {ledger}"
    )
    assert (first.status, again.status) == ("Accepted", "Duplicate")
    assert again.message_id == first.message_id


@pytest.mark.parametrize(
    "key",
    ["", "d ", "d" * 200 + " ", "d" * 201],
    ids=["empty", "a trailing space", "200 and a space", "201 characters"],
)
def test_the_publish_procedures_refuse_the_deduplication_keys_the_application_refuses(pg_conn, key):
    topic = TopicFactory()
    SubscriptionFactory(topic=topic)
    [(_, *single)] = pg_conn.execute(
        _PUBLISH, {"topic": topic.name, "id": uuid.uuid4(), "dedup": key}
    ).fetchall()
    items = [{"message_id": str(uuid.uuid4()), "deduplication_key": key, "payload": {}}]
    [batch] = pg_conn.execute(
        _PUBLISH_MANY, {"topic": topic.name, "items": json.dumps(items)}
    ).fetchall()

    assert tuple(single) == batch == ("Rejected", "InvalidDeduplication")
    assert not Deduplication.objects.filter(topic=topic).exists()


@pytest.mark.parametrize(
    "key", ["", "d ", "d" * 201], ids=["empty", "a trailing space", "201 characters"]
)
def test_a_reservation_of_a_key_the_column_would_cut_is_refused(pg_conn, key):
    """The AWS transport's ledger reserves keys with wq_reserve_deduplication, which the
    runtime role may call too: it raises, as the key could never be confirmed."""
    topic = TopicFactory()
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="200 characters"):
        pg_conn.execute(
            "SELECT * FROM wq_reserve_deduplication(%s, %s, %s)", [topic.name, key, uuid.uuid4()]
        )
    assert not Deduplication.objects.filter(topic=topic).exists()
