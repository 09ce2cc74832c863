"""What a DBA asks of the queue's health: the queue tables' sizes against their rows and the
oldest transaction horizon holding back vacuum, as metrics, and as warnings in validate-bindings
and ``/health`` once a threshold is passed. Every case holds a real transaction open on a second
connection, the way a forgotten ``BEGIN`` in a psql window does in production.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
from django.core.management import call_command
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from tests.factories import ApiKeyFactory, SubscriptionFactory
from tests.support.database import psycopg_params
from tests.support.roles import connect_as, database_role
from workqueue import metrics, publish, transport
from workqueue.driver import get_driver
from workqueue.models import HostRecord
from workqueue.operators.permissions import READ
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db", "truncated_queue_tables")


@contextmanager
def open_transaction(application_name: str) -> Iterator[int]:
    """A second session inside a transaction that has written (it holds a transaction id, as an
    abandoned migration or a debugging session would); its pid. Rolled back afterwards."""
    params = {**psycopg_params(), "application_name": application_name}
    with psycopg.connect(**params) as conn:
        conn.execute("SELECT txid_current()")  # takes a transaction id: vacuum must wait on it
        try:
            yield conn.info.backend_pid
        finally:
            conn.rollback()


def scraped(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def validate_bindings_warnings() -> list[str]:
    out = io.StringIO()
    call_command("workqueue", "validate-bindings", "--json", stdout=out, stderr=io.StringIO())
    return [i["message"] for i in json.loads(out.getvalue()) if i["subject"] == "database"]


def live_host() -> None:
    now = timezone.now()
    HostRecord.objects.create(
        instance_id="db-health:1",
        hostname="worker-1",
        pid=4242,
        started_at=now - dt.timedelta(minutes=1),
        last_seen_at=now,
        subscriptions=[],
        handler_keys=[],
    )


def test_an_open_transaction_is_named_as_the_vacuum_horizon_with_its_age():
    with open_transaction("forgotten-psql") as pid:
        time.sleep(0.3)
        horizon = transport.vacuum_horizon()

    assert f"session {pid} " in horizon.holder and "forgotten-psql" in horizon.holder
    assert horizon.age_seconds >= 0.3
    assert horizon.age_transactions is not None and horizon.age_transactions >= 1
    assert horizon.sees_every_session  # the suite connects as a superuser

    # Once it ends, nothing of it is left: the horizon is another session's or none.
    assert f"session {pid} " not in transport.vacuum_horizon().holder


def test_a_held_horizon_past_the_threshold_warns_in_validate_bindings_and_degrades_health(
    client, settings
):
    settings.WORKQUEUE = {**settings.WORKQUEUE, "VACUUM_HORIZON_WARNING_SECONDS": 1}
    live_host()
    key = ApiKeyFactory(scopes=[READ])
    limited = ApiKeyFactory(scopes=[READ], subscriptions=[SubscriptionFactory().name])

    def health(api_key) -> dict:
        response = client.get("/work-queue/health", headers={"X-API-Key": api_key.raw_key})
        assert response.status_code == 200, response.content
        return response.json()

    assert validate_bindings_warnings() == []
    assert (health(key)["status"], health(key)["databaseWarnings"]) == ("ok", [])

    with open_transaction("long-report") as pid:
        time.sleep(1.2)
        [warning] = validate_bindings_warnings()
        body = health(key)
        limited_body = health(limited)

    assert f"session {pid} " in warning and "long-report" in warning
    assert "VACUUM_HORIZON_WARNING_SECONDS" in warning and "pg_terminate_backend" in warning
    # The same warning (read a moment later, so its age may have moved on by a second).
    [health_warning] = body["databaseWarnings"]
    assert body["status"] == "degraded" and f"session {pid} " in health_warning
    # Database-wide facts (sessions, users) are not for a key limited to one subscription.
    assert limited_body["databaseWarnings"] == []
    assert validate_bindings_warnings() == []


def test_dead_rows_piling_up_behind_a_held_horizon_show_in_metrics_and_warn(settings):
    settings.WORKQUEUE = {**settings.WORKQUEUE, "DEAD_ROWS_WARNING": 40}
    subscription = SubscriptionFactory()
    driver = get_driver()

    def table_gauges() -> dict[str, float]:
        # The statistics a backend gathers reach the shared views when it next reports them;
        # ask the driver's connection, which did the writes, to report at once.
        driver.execute("SELECT pg_stat_force_next_flush()", [])
        driver.execute("SELECT 1", [])
        values = scraped(metrics.render().decode())
        return {
            name: value
            for (name, labels), value in values.items()
            if name.startswith("workqueue_db_") and labels == (("table", "workqueue_delivery"),)
        }

    before = table_gauges()
    assert before["workqueue_db_table_bytes"] > 0 and before["workqueue_db_index_bytes"] > 0

    with open_transaction("held-horizon"):
        receiver = Receiver(subscription.id)
        for _ in range(60):
            publish(subscription.topic.name, {"n": 1})
        claimed = receiver.receive(60).deliveries
        assert len(claimed) == 60
        receiver.complete_many(claimed)  # each claim and completion leaves a dead version

        gauges = table_gauges()
        assert gauges["workqueue_db_dead_rows"] - before["workqueue_db_dead_rows"] >= 60
        assert gauges["workqueue_db_live_rows"] >= 60
        values = scraped(metrics.render().decode())
        assert values[("workqueue_db_vacuum_horizon_age_transactions", ())] >= 1
        assert values[("workqueue_db_vacuum_horizon_sees_every_session", ())] == 1
        warnings = [w for w in validate_bindings_warnings() if "dead rows" in w]

    assert any("workqueue_delivery holds" in w for w in warnings), warnings
    assert all("DEAD_ROWS_WARNING" in w for w in warnings)


def test_a_login_without_pg_monitor_is_told_it_cannot_see_other_sessions(pg_conn):
    with database_role(pg_conn, "wq_metrics") as role, open_transaction("admin-session") as pid:
        with connect_as(role) as conn:
            # The same query the driver runs, as a login that may not read others' sessions.
            from workqueue.driver.postgresql import VACUUM_HORIZON_QUERY, VISIBILITY_OF_SESSIONS

            sees_all = conn.execute(VISIBILITY_OF_SESSIONS).fetchone()[0]
            holders = conn.execute(VACUUM_HORIZON_QUERY.replace("%%", "%")).fetchall()
        assert sees_all is False
        assert all(f"session {pid} " not in row[0] for row in holders)

        pg_conn.execute(f'GRANT pg_monitor TO "{role}"')
        with connect_as(role) as conn:
            sees_all = conn.execute(VISIBILITY_OF_SESSIONS).fetchone()[0]
            holder = conn.execute(VACUUM_HORIZON_QUERY.replace("%%", "%")).fetchone()[0]
        assert sees_all is True
        assert f"session {pid} " in holder
