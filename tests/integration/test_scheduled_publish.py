"""Scheduled and prioritised publishing through the Python API: what reaches the delivery, what
is refused and why, and that an upgrade which changes wq_publish's parameters keeps its grants.
(The claim behaviour is in the conformance suite, C33-C40.)"""

from __future__ import annotations

import datetime as dt
import json

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, transaction

from tests.factories import ApiKeyFactory, SubscriptionFactory, TopicFactory
from tests.support.roles import database_role
from workqueue import publish, publish_many
from workqueue.driver import get_driver
from workqueue.models import Delivery, Message
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")


def _db_now() -> dt.datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        return cursor.fetchone()[0]


def test_delay_and_not_before_set_the_deliveries_due_time_by_the_database_clock():
    sub = SubscriptionFactory()
    before = _db_now()
    delayed = publish(sub.topic.name, {"n": 1}, delay_seconds=600)
    at = before + dt.timedelta(days=2)
    scheduled = publish(sub.topic.name, {"n": 2}, not_before=at.isoformat(), priority=-7)
    past = publish(sub.topic.name, {"n": 3}, not_before=before - dt.timedelta(days=1))

    due = {str(d.message_id): d for d in Delivery.objects.filter(subscription=sub)}
    delayed_due = due[delayed.message_id].visible_at - before
    assert dt.timedelta(seconds=600) <= delayed_due < dt.timedelta(seconds=660)
    assert (due[scheduled.message_id].visible_at, due[scheduled.message_id].priority) == (at, -7)
    # A time already past means now: it is not claimed ahead of older messages.
    assert due[past.message_id].visible_at >= before
    assert [d.message_id for d in Receiver(sub.id).receive(10).deliveries] == [past.message_id]


def test_publish_many_schedules_and_prioritises_each_item():
    sub = SubscriptionFactory()
    results = publish_many(
        sub.topic.name,
        [
            {"payload": 1, "delay_seconds": 3600},
            {"payload": 2, "priority": 5},
            {"payload": 3, "priority": 101},
        ],
    )

    assert [r.status for r in results] == ["Accepted", "Accepted", "Rejected"]
    assert results[2].error.code == "InvalidPriority"
    rows = {str(d.message_id): d for d in Delivery.objects.filter(subscription=sub)}
    assert rows[results[0].message_id].visible_at > _db_now() + dt.timedelta(seconds=3500)
    assert rows[results[1].message_id].priority == 5
    assert [d.message_id for d in Receiver(sub.id).receive(10).deliveries] == [
        results[1].message_id
    ]


@pytest.mark.parametrize(
    ("schedule", "code", "says"),
    [
        ({"not_before": dt.datetime(2030, 1, 1, 9, 0)}, "InvalidSchedule", "time zone"),
        ({"not_before": "next tuesday"}, "InvalidSchedule", "ISO 8601"),
        ({"not_before": 1700000000}, "InvalidSchedule", "datetime"),
        ({"delay_seconds": -1}, "InvalidSchedule", "from 0"),
        ({"delay_seconds": 1.5}, "InvalidSchedule", "whole number"),
        ({"delay_seconds": 8 * 86400}, "InvalidSchedule", "retention_days"),
        (
            {"delay_seconds": 5, "not_before": dt.datetime.now(dt.UTC)},
            "InvalidSchedule",
            "not both",
        ),
        ({"priority": 101}, "InvalidPriority", "-100 to 100"),
        ({"priority": -101}, "InvalidPriority", "-100 to 100"),
        ({"priority": True}, "InvalidPriority", "-100 to 100"),
        ({"priority": "5"}, "InvalidPriority", "-100 to 100"),
    ],
)
def test_a_bad_schedule_or_priority_is_rejected_naming_the_rule(schedule, code, says):
    topic = TopicFactory(retention_days=7)
    SubscriptionFactory(topic=topic)

    result = publish(topic.name, {"n": 1}, **schedule)

    assert (result.status, result.error.code) == ("Rejected", code)
    assert says in result.error.message
    assert not Message.objects.filter(topic=topic).exists()


def test_the_procedure_refuses_a_due_time_past_retention_whoever_calls_it():
    # The bound is the database's: a caller that skips the Python checks meets it too.
    topic = TopicFactory(retention_days=1)
    SubscriptionFactory(topic=topic)
    far = (_db_now() + dt.timedelta(days=1, minutes=1)).isoformat()
    rows = get_driver().call(
        "wq_publish_many",
        {
            "topic_name": topic.name,
            "messages": [
                {"message_id": "6f1c3c1e-0000-4000-8000-000000000001", "not_before": far},
                {"message_id": "6f1c3c1e-0000-4000-8000-000000000002", "priority": 300},
                {"message_id": "6f1c3c1e-0000-4000-8000-000000000003", "delay_seconds": -5},
            ],
            "external": False,
            "published_by": "test",
        },
    )
    assert [r["error_code"] for r in rows] == [
        "InvalidSchedule",
        "InvalidPriority",
        "InvalidSchedule",
    ]


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"not_before": "far"}, "InvalidSchedule"),
        ({"delay_seconds": 86_460}, "InvalidSchedule"),
        ({"delay_seconds": -5}, "InvalidSchedule"),
        ({"delay_seconds": 5, "not_before": "now"}, "InvalidSchedule"),
        ({"priority": 300}, "InvalidPriority"),
        ({"priority": -101}, "InvalidPriority"),
    ],
)
def test_a_single_publish_the_python_checks_did_not_see_is_refused_by_the_procedure(fields, code):
    # wq_publish's own checks, as wq_publish_many's above, for a caller that skips the Python
    # ones (which refuse all of these first): stored, the priority would fail on the delivery's
    # rule as an error instead of a rejection, and the due time would outlive the retention.
    # Seen failing with the procedure's priority check removed, which every other test let by.
    topic = TopicFactory(retention_days=1)
    SubscriptionFactory(topic=topic)
    times = {"far": (_db_now() + dt.timedelta(days=1, minutes=1)).isoformat()}
    times["now"] = _db_now().isoformat()
    params = {k: times.get(v, v) if k == "not_before" else v for k, v in fields.items()}
    [row] = get_driver().call(
        "wq_publish",
        {
            "topic_name": topic.name,
            "message_id": "6f1c3c1e-0000-4000-8000-000000000010",
            "payload": {"n": 1},
            "envelope_bytes": 100,
            "external": False,
            "published_by": "test",
            **params,
        },
    )
    assert (row["status"], row["error_code"]) == ("Rejected", code)
    assert not Message.objects.filter(topic=topic).exists()


CURRENT_PUBLISH = (
    "wq_publish(text,uuid,text,jsonb,jsonb,jsonb,text,text,integer,integer,boolean,text,"
    "timestamp with time zone,integer,integer,boolean)"
)


def test_an_upgrade_that_changes_a_procedures_parameters_keeps_its_grants(pg_conn):
    with database_role(pg_conn, "wq_runtime") as role:
        call_command("workqueue", "grant-runtime", role)
        # Stand in for the previous release: wq_publish with fewer parameters, granted to the
        # runtime role as grant-runtime left it.
        pg_conn.execute(f"DROP FUNCTION {CURRENT_PUBLISH}")
        pg_conn.execute(
            "CREATE FUNCTION wq_publish(p_topic_name text) "
            "RETURNS TABLE (message_id uuid, status text, error_code text) "
            "LANGUAGE sql AS $$ SELECT NULL::uuid, 'Rejected', 'Old' $$"
        )
        pg_conn.execute("REVOKE ALL ON FUNCTION wq_publish(text) FROM PUBLIC")
        pg_conn.execute(f'GRANT EXECUTE ON FUNCTION wq_publish(text) TO "{role}"')

        with transaction.atomic():
            get_driver().install_procedures(connection)

        granted = pg_conn.execute(
            "SELECT p.oid::regprocedure::text, has_function_privilege(%s, p.oid, 'EXECUTE'), "
            "has_function_privilege('public', p.oid, 'EXECUTE') "
            "FROM pg_proc p WHERE p.proname = 'wq_publish' "
            "AND p.pronamespace = current_schema()::regnamespace",
            [role],
        ).fetchall()
        assert granted == [(CURRENT_PUBLISH, True, False)]


def test_an_upgrade_that_changes_a_procedures_result_keeps_its_grants_within_the_migration(
    pg_conn,
):
    with database_role(pg_conn, "wq_runtime") as role:
        call_command("workqueue", "grant-runtime", role)
        # Stand in for the previous release: wq_publish with the same parameters and a narrower
        # result, granted to the runtime role. The install drops and creates it (a result
        # shape cannot be replaced in place), which takes its grants along.
        arguments = CURRENT_PUBLISH.partition("(")[2].rstrip(")")
        pg_conn.execute(f"DROP FUNCTION {CURRENT_PUBLISH}")
        pg_conn.execute(
            f"CREATE FUNCTION wq_publish({arguments}) "
            "RETURNS TABLE (message_id uuid, status text, error_code text) "
            "LANGUAGE sql AS $$ SELECT NULL::uuid, 'Rejected', 'Old' $$"
        )
        pg_conn.execute(f"REVOKE ALL ON FUNCTION {CURRENT_PUBLISH} FROM PUBLIC")
        pg_conn.execute(f'GRANT EXECUTE ON FUNCTION {CURRENT_PUBLISH} TO "{role}"')

        with transaction.atomic():
            get_driver().install_procedures(connection)

        # Granted again by the install itself, not only by the renewal after migrate: in
        # between, the runtime role's processes could not publish.
        [(executable, reshaped)] = pg_conn.execute(
            "SELECT has_function_privilege(%s, %s::regprocedure, 'EXECUTE'), "
            "pg_get_function_result(%s::regprocedure) LIKE '%%announce_topic_id%%'",
            [role, CURRENT_PUBLISH, CURRENT_PUBLISH],
        ).fetchall()
        assert (executable, reshaped) == (True, True)


def test_the_cli_publishes_with_a_delay_a_due_time_and_a_priority(capsys):
    sub = SubscriptionFactory()
    at = (_db_now() + dt.timedelta(hours=3)).replace(microsecond=0)

    call_command(
        "workqueue", "publish", "--topic", sub.topic.name, "--payload", "{}", "--delay", "900"
    )
    call_command(
        "workqueue", "publish", "--topic", sub.topic.name, "--payload", "{}",
        "--not-before", at.isoformat(), "--priority", "40",
    )  # fmt: skip

    rows = sorted(Delivery.objects.filter(subscription=sub), key=lambda d: d.order_key)
    assert rows[0].visible_at > _db_now() + dt.timedelta(seconds=800)
    assert (rows[1].visible_at, rows[1].priority) == (at, 40)
    with pytest.raises(CommandError, match=r"InvalidSchedule: .*not both"):
        call_command(
            "workqueue", "publish", "--topic", sub.topic.name, "--payload", "{}",
            "--delay", "5", "--not-before", at.isoformat(),
        )  # fmt: skip


def test_the_rest_api_publishes_with_not_before_delay_and_priority(client):
    topic = TopicFactory(allow_external_publish=True)
    sub = SubscriptionFactory(topic=topic)
    key = ApiKeyFactory(scopes=["workqueue:publish"])
    at = (_db_now() + dt.timedelta(days=1)).replace(microsecond=0)
    body = {
        "messages": [
            {"payload": 1, "notBefore": at.isoformat().replace("+00:00", "Z"), "priority": -3},
            {"payload": 2, "delaySeconds": 60},
            {"payload": 3, "notBefore": "soon"},
            {"payload": 4, "priority": 1000},
        ]
    }

    response = client.post(
        f"/work-queue/topics/{topic.name}/messages",
        data=json.dumps(body),
        content_type="application/json",
        headers={"X-API-Key": key.raw_key},
    )

    assert response.status_code == 202, response.content
    results = response.json()["results"]
    assert [r["status"] for r in results] == ["Accepted", "Accepted", "Rejected", "Rejected"]
    assert [r["error"]["code"] for r in results[2:]] == ["InvalidSchedule", "InvalidPriority"]
    rows = {str(d.message_id): d for d in Delivery.objects.filter(subscription=sub)}
    assert (rows[results[0]["messageId"]].visible_at, rows[results[0]["messageId"]].priority) == (
        at,
        -3,
    )
    assert rows[results[1]["messageId"]].visible_at > _db_now() + dt.timedelta(seconds=50)
