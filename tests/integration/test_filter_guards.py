"""A subscription's filter never breaks publishing, whatever the database holds.

The database refuses an invalid filter from any writer (the CHECK constraint
``wq_sub_filter_valid``). A filter that is invalid in the table all the same (written by raw SQL
with the guard dropped, or stored before the guard existed) matches nothing for its own
subscription: the publish is accepted and the topic's other subscriptions get their deliveries.
``validate-bindings`` (CLI and REST) reports it as an Error naming the subscription, and a host
running the subscription logs it once.
"""

from __future__ import annotations

import io
import json
import logging
import uuid
from typing import Any

import psycopg
import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.db import IntegrityError, connection, transaction
from psycopg.types.json import Jsonb

from tests.factories import ApiKeyFactory, SubscriptionFactory, TopicFactory, write_unchecked
from tests.support.database import psycopg_params
from tests.support.filter_cases import leaf, root
from tests.support.handlers import registry
from workqueue import publish, publish_many
from workqueue.models import Delivery, Subscription
from workqueue.operators.permissions import READ
from workqueue.runtime.host import Host, HostConfig

pytestmark = pytest.mark.usefixtures("queue_db")

ROOT_OR = {"logic": "or", "filters": [leaf("a", "eq", "x"), leaf("b", "eq", "y")]}
INVALID_FILTERS = [
    # Read as "and" by the SQL before, so the subscription received what Python says it cannot.
    pytest.param(ROOT_OR, id="root-or"),
    # Raised inside wq_filter_matches before, failing every publish to the topic.
    pytest.param(root(leaf("a", "contains", "x")), id="unknown-operator"),
    pytest.param(root(leaf("a", "eq")), id="eq-without-value"),
    pytest.param({"logic": "and", "filters": {"field": "a"}}, id="filters-not-a-list"),
    # Quietly evaluated before: six fields, each satisfied.
    pytest.param(root(*(leaf(f, "isnotnull") for f in "abcdef")), id="six-fields"),
]
ATTRIBUTES = {f: "x" for f in "abcdef"}


def _delivered(subscription: Subscription) -> set[str]:
    return {str(m) for m in subscription.deliveries.values_list("message_id", flat=True)}


# -- the database guard ---------------------------------------------------------------------


def test_the_database_refuses_an_invalid_filter_from_raw_sql():
    sub = SubscriptionFactory()

    with (
        pytest.raises(IntegrityError, match="wq_sub_filter_valid"),
        transaction.atomic(),
        connection.cursor() as cursor,
    ):
        cursor.execute(
            "UPDATE workqueue_subscription SET filter = %s::jsonb WHERE id = %s",
            [json.dumps(ROOT_OR), sub.pk],
        )
    with (
        pytest.raises(IntegrityError, match="wq_sub_filter_valid"),
        transaction.atomic(),
        connection.cursor() as cursor,
    ):
        # A whole new row: a copy of the subscription with another id, name and a bad filter.
        cursor.execute(
            "INSERT INTO workqueue_subscription SELECT (jsonb_populate_record(s, "
            "jsonb_build_object('id', gen_random_uuid(), 'name', 'raw.copy', 'filter', %s::jsonb)"
            ")).* FROM workqueue_subscription s WHERE s.id = %s",
            [json.dumps(root(leaf("a.b", "eq", "x"))), sub.pk],
        )

    valid = root(leaf("a", "eq", "x"))
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE workqueue_subscription SET filter = %s::jsonb WHERE id = %s",
            [json.dumps(valid), sub.pk],
        )
    assert Subscription.objects.get(pk=sub.pk).filter == valid
    assert not Subscription.objects.filter(name="raw.copy").exists()


def test_a_role_that_only_writes_topology_passes_the_guard_with_a_valid_filter(pg_conn):
    # PostgreSQL checks EXECUTE on a CHECK constraint's function as the role writing the row:
    # an admin site's database role must not need the work queue's grants to save a filter.
    sub = SubscriptionFactory()
    role = f"wq_topology_{uuid.uuid4().hex[:8]}"
    pg_conn.execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        pg_conn.execute(f'GRANT SELECT, UPDATE ON workqueue_subscription TO "{role}"')
        with psycopg.connect(autocommit=True, **{**psycopg_params(), "user": role}) as conn:
            update = "UPDATE workqueue_subscription SET filter = %s WHERE id = %s"
            conn.execute(update, [Jsonb(root(leaf("a", "eq", "x"))), sub.pk])
            with pytest.raises(psycopg.errors.CheckViolation, match="wq_sub_filter_valid"):
                conn.execute(update, [Jsonb(ROOT_OR), sub.pk])
    finally:
        pg_conn.execute(f'DROP OWNED BY "{role}"')
        pg_conn.execute(f'DROP ROLE "{role}"')
    assert Subscription.objects.get(pk=sub.pk).filter == root(leaf("a", "eq", "x"))


# -- publishing past an invalid filter -----------------------------------------------------------


@pytest.mark.parametrize("invalid", INVALID_FILTERS)
def test_an_invalid_filter_in_the_table_costs_only_its_own_subscription_its_deliveries(
    invalid: Any,
):
    topic = TopicFactory()
    everything = SubscriptionFactory(topic=topic)
    matching = SubscriptionFactory(topic=topic, filter=root(leaf("a", "eq", "x")))
    # Ordered: the publish also asks which Ordered subscriptions match before taking key locks.
    broken = SubscriptionFactory(topic=topic, partition_mode="Ordered")
    write_unchecked(broken, filter=invalid)

    results = [
        publish(topic.name, {"n": 1}, partition_key="k", attributes=ATTRIBUTES),
        *publish_many(
            topic.name,
            [
                {"payload": {"n": 2}, "partition_key": "k", "attributes": ATTRIBUTES},
                {"payload": {"n": 3}, "attributes": ATTRIBUTES},
            ],
        ),
    ]

    assert [r.status for r in results] == ["Accepted"] * 3, results
    published = {r.message_id for r in results}
    assert _delivered(everything) == published
    assert _delivered(matching) == published
    assert _delivered(broken) == set()


# -- reporting it --------------------------------------------------------------------------------


def test_validate_bindings_reports_an_invalid_stored_filter_as_an_error_naming_the_subscription(
    client,
):
    SubscriptionFactory(filter=root(leaf("a", "eq", "x")))  # valid: no Error
    broken = SubscriptionFactory()
    write_unchecked(broken, filter=ROOT_OR)

    out = io.StringIO()
    with pytest.raises(CommandError, match="validate-bindings found errors"):
        call_command("workqueue", "validate-bindings", "--json", stdout=out, stderr=io.StringIO())
    response = client.get(
        "/work-queue/bindings/validate", headers={"X-API-Key": ApiKeyFactory(scopes=[READ]).raw_key}
    )

    assert response.status_code == 200, response.content
    for issues in (json.loads(out.getvalue()), response.json()["issues"]):
        [error] = [i for i in issues if i["severity"] == "Error"]
        assert error["subject"] == f"subscription {broken.name}"
        assert "filter.logic: the root logic must be 'and'" in error["message"]
        assert "matches no message" in error["message"]


def test_a_host_running_the_subscription_logs_its_invalid_filter_once(caplog):
    get_user_model().objects.create_user("workqueue-system")
    broken = SubscriptionFactory(handler_key="t.script")
    write_unchecked(broken, filter=ROOT_OR)
    host = Host(
        HostConfig(subscriptions=[{"name": broken.name}], sweeper_interval_ms=0),
        registry=registry,
    )

    with caplog.at_level(logging.ERROR, logger="workqueue"):
        for _ in range(3):  # start, then two reconciles
            assert host.plan()[broken.name].state == "Running"

    logged = [r.getMessage() for r in caplog.records if broken.name in r.getMessage()]
    assert len(logged) == 1, logged
    assert "filter.logic: the root logic must be 'and'" in logged[0]
    assert "matches no message" in logged[0]
    # Another invalid filter is news, and logged again.
    write_unchecked(broken, filter=root(leaf("a", "contains", "x")))
    with caplog.at_level(logging.ERROR, logger="workqueue"):
        host.plan()
    assert len([r for r in caplog.records if broken.name in r.getMessage()]) == 2
    assert not Delivery.objects.filter(subscription=broken).exists()
