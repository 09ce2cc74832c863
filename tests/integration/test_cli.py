"""`manage.py workqueue VERB`: every verb's happy path, its --json form and its errors."""

from __future__ import annotations

import datetime as dt
import io
import json
import logging
import re
import uuid
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.db import connection
from django.utils import timezone

from tests.factories import SubscriptionFactory, TopicFactory
from tests.support.queue import dead_letter, row_held
from tests.support.roles import acting_as_granted_role
from workqueue import publish
from workqueue.driver import get_driver
from workqueue.driver.install import LATEST_PROCEDURE_MIGRATION
from workqueue.exceptions import TransientDriverError
from workqueue.models import ApiKey, Delivery, Message, Topic, Transport
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")


def run(*args: str) -> str:
    out = io.StringIO()
    call_command("workqueue", *args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def test_stats_lists_every_subscription_and_json_matches():
    sub = SubscriptionFactory()
    publish(sub.topic.name, {"n": 1})

    text = run("stats")
    data = json.loads(run("stats", "-s", sub.name, "--json"))

    assert sub.name in text and "PENDING" in text
    [row] = data["subscriptions"]
    assert row["subscription_name"] == sub.name and row["pending"] == 1


def test_stats_of_several_subscriptions_lists_each_once():
    """argparse kept only the last ``-s``: asked for two, stats showed one."""
    first, second, other = SubscriptionFactory(), SubscriptionFactory(), SubscriptionFactory()

    data = json.loads(run("stats", "-s", second.name, "-s", first.name, "-s", first.name, "--json"))

    names = [row["subscription_name"] for row in data["subscriptions"]]
    assert names == sorted([first.name, second.name])
    assert other.name not in run("stats", "-s", first.name, "-s", second.name)


def test_stats_for_an_unknown_subscription_fails():
    with pytest.raises(CommandError, match="No subscription is named 'nope'"):
        run("stats", "-s", "nope")


@pytest.mark.parametrize(
    "verb",
    [
        ("stats", "-s"),
        ("dead-letters", "-s"),
        ("partitions", "-s"),
        ("backlog", "-s"),
        ("replay", "--delivery", "0190a5d4-ac96-7c4b-bcce-b302099a8057", "-s"),
        ("discard", "--delivery", "0190a5d4-ac96-7c4b-bcce-b302099a8057", "--reason", "x", "-s"),
        ("replay-dead-letters", "-s"),
        ("retire-subscription",),
    ],
)
def test_a_mistyped_subscription_name_names_the_ones_it_resembles(verb):
    """Operator verbs said only "No subscription is named 'orders.emial'." (newcomer review,
    helper-139); the one place that finds a subscription for an operator now names those
    spelt nearly alike."""
    SubscriptionFactory(name="orders.email")
    SubscriptionFactory(name="orders.emails")
    SubscriptionFactory(name="billing.invoice")

    with pytest.raises(CommandError) as refused:
        run(*verb, "orders.emial")

    text = str(refused.value)
    assert "No subscription is named 'orders.emial'" in text
    assert "Did you mean 'orders.email' or 'orders.emails'?" in text
    assert "billing" not in text


def test_dead_letters_then_replay_then_nothing_left():
    sub = SubscriptionFactory()
    delivery_id = dead_letter(sub)

    listed = json.loads(run("dead-letters", "-s", sub.name, "--json"))
    assert [i["delivery_id"] for i in listed["items"]] == [delivery_id]
    assert "Replayed" in run("replay", "-s", sub.name, "--delivery", delivery_id, "--note", "ok")
    assert Delivery.objects.get(id=delivery_id).status == "Pending"
    # Replaying again changes nothing and is not an error, as in the REST API (200,
    # replayed false): the same outcome for the same operation on every surface.
    assert "Nothing replayed" in run("replay", "-s", sub.name, "--delivery", delivery_id)
    again = json.loads(run("replay", "-s", sub.name, "--delivery", delivery_id, "--json"))
    assert again == {"supported": True, "replayed": False}


def test_replay_and_discard_take_a_message_id_such_as_a_tasks_result_id():
    """A Tasks API task's result id is its message's id, which replay refused as "not a dead
    letter of tasks.default" (helper-120)."""
    sub = SubscriptionFactory()
    delivery_id = dead_letter(sub)
    message_id = str(Delivery.objects.get(id=delivery_id).message_id)

    replayed = run("replay", "-s", sub.name, "--message", message_id)
    discarded = run("discard", "-s", sub.name, "--message", message_id, "--reason", "done")

    assert replayed.strip() == f"Replayed {delivery_id}"
    assert discarded.strip() == f"Discarded {delivery_id}"
    assert Delivery.objects.get(id=delivery_id).status == "Discarded"
    with pytest.raises(CommandError, match=f"has no delivery of message {delivery_id}"):
        run("replay", "-s", sub.name, "--message", delivery_id)
    with pytest.raises(CommandError, match="not a message id"):
        run("replay", "-s", sub.name, "--message", "42")
    with pytest.raises(CommandError, match="No subscription is named 'nope'"):
        run("replay", "-s", "nope", "--message", message_id)
    with pytest.raises(CommandError, match="not allowed with argument"):
        run("replay", "-s", sub.name, "--message", message_id, "--delivery", delivery_id)


def test_the_dead_letter_table_shows_the_key_that_key_filters_by():
    """On a subscription without partitions the KEY column was blank (the delivery's key),
    while `--key` on the bulk verbs matched the message's key."""
    sub = SubscriptionFactory(partition_mode="None")
    dead_letter(sub, partition_key="kp")

    table = run("dead-letters", "-s", sub.name)
    dry_run = run(
        "discard-dead-letters",
        "-s",
        sub.name,
        "--key",
        "kp",
        "--dry-run",
        "--discard-reason",
        "x",
    )

    assert " kp " in table.splitlines()[2], table
    assert "1 of 1" in dry_run


def test_an_interrupted_bulk_verb_says_a_rerun_is_safe(monkeypatch):
    """Ctrl-C in a bulk verb ended in a bare KeyboardInterrupt traceback."""
    from workqueue.operators import operations

    sub = SubscriptionFactory()
    dead_letter(sub)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(operations, "resolve_dead_letters", interrupted)
    with pytest.raises(
        CommandError, match="Interrupted before a batch was known to be applied"
    ) as stopped:
        run("discard-dead-letters", "-s", sub.name, "--discard-reason", "x")
    assert stopped.value.returncode == 130


def test_dead_letters_page_through_with_the_cursor():
    sub = SubscriptionFactory()
    ids = sorted(dead_letter(sub) for _ in range(3))

    first = json.loads(run("dead-letters", "-s", sub.name, "--page-size", "2", "--json"))
    second = json.loads(
        run("dead-letters", "-s", sub.name, "--cursor", first["next_cursor"], "--json")
    )

    assert [i["delivery_id"] for i in first["items"]] == ids[:2]
    assert [i["delivery_id"] for i in second["items"]] == ids[2:]
    assert second["next_cursor"] is None


def test_bad_page_size_and_cursor_are_refused():
    sub = SubscriptionFactory()
    with pytest.raises(CommandError, match="page_size"):
        run("dead-letters", "-s", sub.name, "--page-size", "501")
    with pytest.raises(CommandError, match="cursor"):
        run("dead-letters", "-s", sub.name, "--cursor", "!!!")


def test_partitions_show_a_blocked_ordered_key_until_discard():
    sub = SubscriptionFactory(partition_mode="Ordered")
    head = dead_letter(sub, partition_key="venue-1")
    publish(sub.topic.name, {"n": 2}, partition_key="venue-1")

    blocked = json.loads(run("partitions", "-s", sub.name, "--json"))
    assert blocked["items"][0]["partition_key"] == "venue-1"
    assert blocked["items"][0]["condition"] == "Blocked"

    assert "Discarded" in run("discard", "-s", sub.name, "--delivery", head, "--reason", "bad")
    assert json.loads(run("partitions", "-s", sub.name, "--json"))["items"] == []


def test_partitions_name_an_in_flight_keys_holder_and_whether_its_lease_has_passed():
    """A key held by a host that died looked exactly like one held by a live host."""
    sub = SubscriptionFactory(partition_mode="Exclusive")
    for key in ("live", "dead"):
        publish(sub.topic.name, {"n": 1}, partition_key=key)
    Receiver(sub.id, "host-a").receive(2)
    with connection.cursor() as cursor:  # host-a's lease on "dead" ran out two minutes ago
        cursor.execute(
            "UPDATE workqueue_delivery SET lease_expires_at = now() - interval '2 minutes' "
            "WHERE subscription_id = %s AND partition_key = 'dead'",
            [sub.id],
        )

    text = run("partitions", "-s", sub.name)
    items = {
        i["partition_key"]: i
        for i in json.loads(run("partitions", "-s", sub.name, "--json"))["items"]
    }

    assert "HOLDER" in text and "LEASE" in text
    [live] = [line for line in text.splitlines() if line.startswith("live")]
    [dead] = [line for line in text.splitlines() if line.startswith("dead")]
    assert "host-a" in live and "ends in" in live
    assert "host-a" in dead and "passed 2 min ago" in dead
    assert items["dead"]["lease_owner"] == "host-a" and items["dead"]["lease_expires_at"]


def test_discard_of_a_running_delivery_requests_a_cancel():
    sub = SubscriptionFactory()
    publish(sub.topic.name, {"n": 1})
    [claimed] = Receiver(sub.id).receive(1).deliveries

    out = json.loads(
        run(
            "discard",
            "-s",
            sub.name,
            "--delivery",
            claimed.delivery_id,
            "--reason",
            "stop",
            "--json",
        )
    )

    assert out == {
        "supported": True,
        "discarded": True,
        "cancel_requested": True,
        "holds_key": False,
    }


def test_discard_of_a_delivery_an_open_transaction_holds_fails_at_once_saying_try_again():
    sub = SubscriptionFactory()
    publish(sub.topic.name, {"n": 1})
    [claimed] = Receiver(sub.id).receive(1).deliveries

    with row_held(claimed.delivery_id), pytest.raises(CommandError, match="Try again"):
        run("discard", "-s", sub.name, "--delivery", claimed.delivery_id, "--reason", "stop")

    assert Delivery.objects.get(pk=claimed.delivery_id).cancel_requested_at is None


def test_discard_needs_a_reason_and_a_known_delivery():
    sub = SubscriptionFactory()
    with pytest.raises(CommandError, match="reason is required"):
        run("discard", "-s", sub.name, "--delivery", "x", "--reason", " ")
    # An id cut short (as lists show them) is refused, not answered "nothing to discard".
    with pytest.raises(CommandError, match="'0190a5d4' is not a delivery id: give the whole id"):
        run("discard", "-s", sub.name, "--delivery", "0190a5d4", "--reason", "r")
    assert "Nothing discarded" in run(
        "discard",
        "-s",
        sub.name,
        "--delivery",
        "0190a5d4-ac96-7c4b-bcce-b302099a8057",
        "--reason",
        "r",
    )


def test_backlog_counts_claimable_and_in_flight():
    sub = SubscriptionFactory()
    for n in range(3):
        publish(sub.topic.name, {"n": n})
    Receiver(sub.id).receive(1)

    data = json.loads(run("backlog", "-s", sub.name, "--json"))

    assert data == {"supported": True, "claimable": 2, "in_flight": 1, "total": 3, "capped": False}


@pytest.mark.parametrize("disabled", ["topic", "transport"])
def test_the_backlog_of_a_disabled_topic_or_transport_counts_nothing_claimable(disabled):
    """Claims treat such a subscription as Paused (since 0044); the backlog counted its Pending
    rows, so an autoscaler started hosts for work none of them could claim."""
    sub = SubscriptionFactory()
    for n in range(3):
        publish(sub.topic.name, {"n": n})
    Receiver(sub.id).receive(1)
    rows = Topic.objects.filter(pk=sub.topic_id)
    if disabled == "transport":
        rows = Transport.objects.filter(pk=sub.topic.transport_id)
    rows.update(status="Disabled")

    data = json.loads(run("backlog", "-s", sub.name, "--json"))

    assert (data["claimable"], data["in_flight"]) == (0, 1)  # the running one runs to its end
    assert Receiver(sub.id).receive(5).deliveries == []


def test_validate_bindings_warns_about_handlers_no_live_host_serves():
    sub = SubscriptionFactory(handler_key="nobody.serves.this")
    out = run("validate-bindings")
    assert sub.name in out and "not registered in any live host" in out


def test_validate_bindings_names_handler_runs_a_live_host_reports_stuck():
    """Round 41 (helper-147's leftover): a host names its handler runs past their threshold in
    health and the gauges, but validate-bindings, the operators' "why is work not flowing"
    on every door, said "No problems found." while one held its key for hours."""
    from django.utils import timezone

    from workqueue.models import HostRecord

    stuck_one = SubscriptionFactory(handler_key="tests.noop")
    fine = SubscriptionFactory(handler_key="tests.noop")
    now = timezone.now()
    entries = [
        {
            "name": stuck_one.name,
            "state": "Running",
            "reason": "",
            "in_flight": 2,
            "concurrency": 4,
            "oldest_run_seconds": 7300.0,
            "stuck_count": 2,
            "stuck_runs": [
                {
                    "delivery_id": "d-oldest",
                    "handler_key": "tests.noop",
                    "seconds": 7300.0,
                    "threshold_seconds": 1800,
                },
                {
                    "delivery_id": "d-next",
                    "handler_key": "tests.noop",
                    "seconds": 1900.0,
                    "threshold_seconds": 1800,
                },
            ],
        },
        {
            "name": fine.name,
            "state": "Running",
            "reason": "",
            "in_flight": 1,
            "concurrency": 4,
            "oldest_run_seconds": 3.0,
            "stuck_count": 0,
            "stuck_runs": [],
        },
    ]
    HostRecord.objects.create(
        instance_id="host-a",
        hostname="worker-1",
        pid=1,
        started_at=now,
        last_seen_at=now,
        subscriptions=entries,
        handler_keys=["tests.noop"],
    )

    issues = json.loads(run("validate-bindings", "--json"))

    about = [i for i in issues if i["subject"] == f"subscription {stuck_one.name}"]
    assert [i["severity"] for i in about] == ["Warning"]
    assert "2 handler runs" in about[0]["message"] and "d-oldest" in about[0]["message"]
    assert f"discard -s {stuck_one.name} --delivery d-oldest" in about[0]["message"]
    assert not [i for i in issues if i["subject"] == f"subscription {fine.name}"]


def test_publish_count_reports_a_rate_and_bad_json_is_refused():
    topic = TopicFactory()
    SubscriptionFactory(topic=topic)

    out = run("publish", "--topic", topic.name, "--payload", '{"a": 1}', "--count", "5")

    assert "Published 5: 5 accepted" in out and "/s" in out
    assert Delivery.objects.filter(subscription__topic=topic).count() == 5
    with pytest.raises(CommandError, match="not valid JSON"):
        run("publish", "--topic", topic.name, "--payload", "{bad")


def test_a_publish_the_database_refuses_is_a_one_line_error_not_a_traceback(pg_conn):
    # Here: the role the command connects as may not run the publish procedure.
    topic = TopicFactory()
    SubscriptionFactory(topic=topic)
    with (
        acting_as_granted_role(
            pg_conn, "wq_pub", "grant-runtime", revoked=["wq_publish", "wq_publish_many"]
        ),
        pytest.raises(CommandError, match=r"^Publishing failed: .*permission denied"),
    ):
        run("publish", "--topic", topic.name, "--payload", '{"a": 1}')

    assert Delivery.objects.filter(subscription__topic=topic).count() == 0


def test_apikey_create_prints_the_key_once_and_it_can_be_revoked():
    owner = get_user_model().objects.create_user("keyowner")

    created = json.loads(
        run("apikey", "create", "--user", "keyowner", "--scopes", "workqueue:read", "--json")
    )
    key = ApiKey.objects.get(prefix=created["prefix"])
    assert key.owner == owner and created["key"].startswith("wq_")
    assert ApiKey.objects.authenticate(created["key"]) == key
    assert created["key"] not in run("apikey", "list")

    run("apikey", "revoke", created["prefix"])
    assert ApiKey.objects.authenticate(created["key"]) is None


def test_apikey_list_names_why_a_key_is_refused():
    """A key that never expires but whose owner was deactivated (each call 401) was listed as
    "expired", sending an operator chasing 401s to expiry dates (review helper-156)."""
    from tests.factories import ApiKeyFactory

    owner = get_user_model().objects.create_user("leaver")
    keys = {
        "owner inactive": ApiKeyFactory(owner=owner),
        "revoked": ApiKeyFactory(),
        "expired": ApiKeyFactory(),
        "active": ApiKeyFactory(),
    }
    keys["revoked"].revoke()
    ApiKey.objects.filter(pk=keys["expired"].pk).update(
        expires_at=timezone.now() - dt.timedelta(seconds=1)
    )
    owner.is_active = False
    owner.save()

    listed = run("apikey", "list")
    as_json = {k["prefix"]: k for k in json.loads(run("apikey", "list", "--json"))}

    for state, key in keys.items():
        (row,) = [line for line in listed.splitlines() if line.startswith(key.prefix)]
        assert re.split(r"\s{2,}", row.strip())[5] == state, row  # the STATE column
        assert as_json[key.prefix]["state"] == state
        assert as_json[key.prefix]["active"] is (state == "active")


def test_apikey_revoke_takes_the_key_as_it_is_shown_or_leaked_and_never_echoes_a_secret():
    """The audit trail and the admin name a key ``wq_<prefix>``, and a leaked key is found
    whole: revoke refused both ("No API key has the prefix ..."), echoing a leaked key's secret
    back to the terminal (review helper-156)."""
    from tests.factories import ApiKeyFactory

    keys = [ApiKeyFactory() for _ in range(4)]
    shown, shown_with_tail, leaked, logged = keys

    run("apikey", "revoke", f"wq_{shown.prefix}")
    run("apikey", "revoke", f"wq_{shown_with_tail.prefix}_…")
    run("apikey", "revoke", leaked.raw_key)
    run("apikey", "revoke", f"Authorization: Bearer {logged.raw_key}")  # a log line

    assert all(ApiKey.objects.get(pk=k.pk).revoked_at for k in keys)
    secret = leaked.raw_key[len("wq_00000000_") :]
    for given in ("wq_00000000_" + secret, secret):  # no such key; the secret part alone
        with pytest.raises(CommandError) as refused:
            run("apikey", "revoke", given)
        assert secret not in str(refused.value), str(refused.value)
    assert "'00000000'" in str(
        pytest.raises(CommandError, run, "apikey", "revoke", "wq_00000000").value
    )


def test_apikey_create_refuses_unknown_users_and_scopes():
    get_user_model().objects.create_user("keyowner")
    with pytest.raises(CommandError, match="No user"):
        run("apikey", "create", "--user", "ghost", "--scopes", "workqueue:read")
    with pytest.raises(CommandError, match="unknown: workqueue:everything"):
        run("apikey", "create", "--user", "keyowner", "--scopes", "workqueue:everything")


def test_scaler_query_counts_claimable_and_in_flight_on_the_database(pg_conn):
    sub = SubscriptionFactory(partition_mode="Exclusive")
    for n in range(3):
        publish(sub.topic.name, {"n": n}, partition_key="same")
    publish(sub.topic.name, {"n": 9}, partition_key="other")
    sql = json.loads(run("scaler-query", "-s", sub.name, "--json"))["sql"]

    [(desired,)] = pg_conn.execute(sql).fetchall()

    assert desired == 2  # one per claimable key; the rest of "same" must wait


def test_publishing_to_a_topic_no_one_created_names_the_topic_and_prints_no_result():
    """It printed "Rejected None" and then "TopicNotFound: No topic has this name." without
    the name, so a typo in --topic was hard to see."""
    out = io.StringIO()
    with pytest.raises(CommandError) as refused:
        call_command(
            "workqueue", "publish", "--topic", "orders.craeted", "--payload", "{}", stdout=out
        )

    assert "TopicNotFound" in str(refused.value) and "'orders.craeted'" in str(refused.value)
    assert "sync-topology" in str(refused.value)
    assert "None" not in out.getvalue()
    # One message, one sentence: no bulk summary ("Published 1: 0 accepted, ... 1 rejected").
    assert out.getvalue() == "" and str(refused.value).startswith("Rejected: TopicNotFound:")


def test_a_rejection_is_told_once_by_the_command_not_again_by_the_librarys_log(caplog):
    """The library logs a call's rejections for callers that do not read their results; the
    command reads them and says so itself, and printed the same sentence twice."""
    with caplog.at_level(logging.INFO, logger="workqueue"), pytest.raises(CommandError):
        call_command("workqueue", "publish", "--topic", "orders.craeted", "--payload", "{}")

    assert [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()] == []
    # Only while the command runs: the library's own callers are still told.
    publish("orders.craeted", {})
    assert any("were rejected" in r.getMessage() for r in caplog.records)


def test_while_the_command_publishes_other_threads_rejections_are_still_logged(caplog):
    """A logger's filter applies in every thread: a process running the command (call_command)
    lost its other threads' rejection lines meanwhile (review helper-119)."""
    import threading

    from workqueue.publishing import rejections_reported_by_caller

    with caplog.at_level(logging.INFO, logger="workqueue"), rejections_reported_by_caller():

        def publish_elsewhere() -> None:
            try:
                publish("orders.craeted", {})
            finally:
                get_driver().close()  # the thread's own connections: the queue's and Django's
                connection.close()

        elsewhere = threading.Thread(target=publish_elsewhere)
        elsewhere.start()
        elsewhere.join()
        publish("orders.craeted", {})  # this thread's: left out

    assert len([r for r in caplog.records if "were rejected" in r.getMessage()]) == 1


def test_a_mistyped_topic_is_answered_with_the_names_it_resembles():
    TopicFactory(name="orders.created")
    TopicFactory(name="orders.cancelled")

    with pytest.raises(CommandError) as refused:
        call_command("workqueue", "publish", "--topic", "orders.creatd", "--payload", "{}")

    assert "Did you mean 'orders.created'?" in str(refused.value)


def test_publishing_needs_a_payload_or_a_reference_and_publishes_nothing_without():
    """Without --payload a message of payload null was published (and printed Accepted),
    though the usage line asks for --payload or --payload-ref (helper-113)."""
    sub = SubscriptionFactory()

    with pytest.raises(CommandError, match="one of the arguments --payload --payload-ref"):
        call_command("workqueue", "publish", "--topic", sub.topic.name)

    assert not Message.objects.filter(topic=sub.topic).exists()
    call_command("workqueue", "publish", "--topic", sub.topic.name, "--payload", "null")
    assert Message.objects.get(topic=sub.topic).payload is None


def test_scaler_query_for_a_name_no_subscription_has_warns_and_still_prints_it():
    """A misspelt name printed a query that answers 0 for ever (an autoscaler that never
    starts a job) without a word; it may name a subscription still to be created, so the
    query is still printed."""
    out, err = io.StringIO(), io.StringIO()
    call_command("workqueue", "scaler-query", "-s", "ordres", stdout=out, stderr=err)

    assert "ordres" in out.getvalue()
    assert "No subscription is named 'ordres'" in err.getvalue()
    assert "answers 0" in err.getvalue()


def test_conformance_verb_prints_the_table():
    out = run("conformance", "--case", "C01", "--case", "C04")
    assert "C01" in out and "PASS" in out and "2 passed" in out


def test_grant_scaler_prints_select_on_subscriptions_and_execute_on_wq_backlog():
    out = run("grant-scaler", "keda_reader", "--print")
    lines = out.strip().splitlines()
    # What it gives, after taking back what an earlier grant gave (review helper-173).
    assert lines[-2:] == [
        'GRANT SELECT ON workqueue_subscription TO "keda_reader";',
        'GRANT EXECUTE ON FUNCTION wq_backlog(uuid, integer) TO "keda_reader";',
    ]
    assert not [line for line in lines if line.startswith("GRANT")][:-2]


def test_grant_runtime_names_a_missing_role_in_its_error():
    with pytest.raises(CommandError, match="Create the role first"):
        run("grant-runtime", "no_such_role_here")


def test_granting_to_the_owner_of_the_tables_is_refused_and_changes_nothing():
    """The grants take back what they do not give: run on the user that owns the tables, they
    stripped it of its own INSERT, and every procedure it owns failed after."""
    from django.db import connection

    owner = connection.settings_dict["USER"]
    for verb in ("grant-runtime", "grant-operator"):
        with pytest.raises(CommandError, match="owns the work-queue tables"):
            run(verb, owner)

    assert publish(SubscriptionFactory().topic.name, {"n": 1}).accepted  # the owner still writes


def test_localdb_url_prints_the_embedded_database_url():
    from workqueue import localdb

    expected = localdb.url(connection.settings_dict["NAME"])
    if expected is None:
        pytest.skip("the suite is running against DATABASE_URL, not the embedded database")
    assert run("localdb", "url").strip() == expected


def test_localdb_verbs_act_on_the_database_the_projects_settings_name(monkeypatch):
    """In a project of a user's own (DATABASES naming ``shop`` on the embedded server, made
    with ``python -m workqueue.localdb start --database shop``), ``localdb url`` printed the
    URL of the ``workqueue`` database, the repository's demo's, and ``localdb start`` made
    that database: the project's own was never named (newcomer review)."""
    from workqueue import localdb

    if localdb.url() is None:
        pytest.skip("the suite is running against DATABASE_URL, not the embedded database")
    project_database = f"h139_shop_{uuid.uuid4().hex[:8]}"
    monkeypatch.setitem(connection.settings_dict, "NAME", project_database)
    try:
        started = run("localdb", "start").strip()
        assert started == localdb.url(project_database)
        assert f"/{project_database}?" in started
        assert run("localdb", "url").strip() == started
    finally:
        monkeypatch.undo()
        with connection.cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS {project_database}")


@pytest.mark.parametrize("action", ["start", "stop", "url"])
def test_localdb_verbs_refuse_a_project_whose_database_is_not_the_embedded_one(monkeypatch, action):
    """A project on a PostgreSQL of its own (a container, a server) got the embedded one's
    URL from ``localdb url``, and ``localdb start`` made and started a cluster it never uses;
    each now says which setting names which database, and how to use the embedded one."""
    # Put back before the test's flush, which connects with these settings.
    with monkeypatch.context() as patch, pytest.raises(CommandError) as refused:
        patch.setitem(connection.settings_dict, "HOST", "db.example.com")
        patch.setitem(connection.settings_dict, "OPTIONS", {})
        run("localdb", action)

    text = str(refused.value)
    assert "DATABASES['default']" in text and "'db.example.com'" in text
    # Stopping says how to stop a server started from elsewhere (review helper-144).
    way_on = "stop" if action == "stop" else "start --database"
    assert f"python -m workqueue.localdb {way_on}" in text
    assert "WORKQUEUE_LOCALDB_DIR" in text


def _bloat_the_delivery_indexes(pg_conn, subscription, rows: int = 20_000) -> None:
    """A drained backlog: many deliveries inserted, then gone (test-only SQL)."""
    pg_conn.execute(
        """
        WITH m AS (
            INSERT INTO workqueue_message (id, publish_ordinal, topic_id, partition_key,
                                           payload, published_at)
            SELECT gen_random_uuid(), nextval('wq_publish_ordinal_seq'), %(topic)s, 'k' || g,
                   '{}'::jsonb, now()
              FROM generate_series(1, %(rows)s) g
            RETURNING id, publish_ordinal, partition_key
        )
        INSERT INTO workqueue_delivery (id, message_id, subscription_id, status, partition_key,
                                        order_key, attempt_count, is_replay, visible_at)
        SELECT gen_random_uuid(), m.id, %(sub)s, 'Pending', m.partition_key, m.publish_ordinal,
               0, false, now()
          FROM m
        """,
        {"topic": subscription.topic_id, "sub": subscription.id, "rows": rows},
    )
    pg_conn.execute("DELETE FROM workqueue_delivery WHERE subscription_id = %s", [subscription.id])
    pg_conn.execute("DELETE FROM workqueue_message WHERE topic_id = %s", [subscription.topic_id])


def test_reindex_shrinks_the_indexes_a_drained_backlog_left_behind(pg_conn):
    subscription = SubscriptionFactory(partition_mode="Exclusive")
    _bloat_the_delivery_indexes(pg_conn, subscription)
    pg_conn.execute("VACUUM workqueue_delivery")

    def sparse_warnings() -> list[str]:
        issues = json.loads(run("validate-bindings", "--json"))
        return [i["message"] for i in issues if "workqueue reindex" in i["message"]]

    [warning] = sparse_warnings()
    assert "wq_dlv_partition_head_ix (" in warning and "0 entries" in warning
    assert "REINDEX TABLE CONCURRENTLY workqueue_delivery" in run("reindex", "--print")
    sizes = json.loads(run("reindex", "--json"))

    assert sizes["bytes_after"] * 4 < sizes["bytes_before"], sizes
    assert sparse_warnings() == []
    # Every index is valid afterwards (a failed concurrent rebuild would leave one invalid).
    invalid = pg_conn.execute(
        "SELECT count(*) FROM pg_index WHERE indrelid = 'workqueue_delivery'::regclass "
        "AND NOT indisvalid"
    ).fetchone()[0]
    assert invalid == 0


def test_reindex_as_a_role_that_does_not_own_the_tables_says_who_must_run_it(pg_conn):
    from django.db import connection

    role = f"wq_not_owner_{uuid.uuid4().hex[:8]}"
    pg_conn.execute(f"DROP ROLE IF EXISTS {role}")
    pg_conn.execute(f"CREATE ROLE {role}")
    try:
        with connection.cursor() as cursor:
            cursor.execute(f"SET ROLE {role}")
        with pytest.raises(CommandError, match="as the database user that owns"):
            run("reindex")
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET ROLE")
        pg_conn.execute(f"DROP ROLE {role}")


def test_grant_operator_prints_the_operator_procedures_and_no_claim():
    out = run("grant-operator", "ops", "--print")
    assert 'GRANT EXECUTE ON FUNCTION wq_replay TO "ops";' in out
    assert 'GRANT EXECUTE ON FUNCTION wq_cancel TO "ops";' in out
    granted = "\n".join(line for line in out.splitlines() if line.startswith("GRANT"))
    assert "wq_claim" not in granted and "wq_publish" not in granted
    assert "lease_token" not in out and "GRANT SELECT (id, message_id," in out


# -- bad input and an unreachable database (audit helper-71) ----------------------------------


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--expires-days", "3000000", "1 to 3,650 days"),
        ("--expires-days", "99999999999", "1 to 3,650 days"),
        ("--expires-days", "0", "1 to 3,650 days"),
        ("--name", "n" * 500, "at most 100"),
    ],
    ids=["days-past-datetime", "days-past-an-int", "no-days", "name-500-characters"],
)
def test_apikey_create_refuses_out_of_range_input_in_one_line(option, value, says):
    # OverflowError ("date value out of range"), "Python int too large" and a DataError
    # ("value too long for type character varying(100)") came out as tracebacks.
    get_user_model().objects.create_user("keyowner")

    with pytest.raises(CommandError, match=says):
        run("apikey", "create", "--user", "keyowner", "--scopes", "workqueue:read", option, value)

    assert not ApiKey.objects.exists()


def test_an_operator_verb_with_the_database_away_is_one_line_not_a_traceback():
    settings = connection.settings_dict
    saved = dict(settings)
    try:
        connection.close()
        settings.update(HOST="127.0.0.1", PORT="1")  # nothing listens there
        with pytest.raises(
            CommandError,
            match=r"^The database could not be used \(.*Connection refused.*DATABASE_URL",
        ):
            run("stats")
    finally:
        connection.close()
        settings.clear()
        settings.update(saved)


def test_a_publish_the_database_keeps_refusing_says_what_it_answered(monkeypatch):
    # "The database stayed busy (deadlock, lock timeout or lost connection)" whatever the
    # cause, connection refused included.
    topic = TopicFactory()
    SubscriptionFactory(topic=topic)
    driver = get_driver()

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise TransientDriverError("connection refused: is the server running on port 1?")

    monkeypatch.setattr(driver, "publish", refused)
    monkeypatch.setattr("time.sleep", lambda seconds: None)

    result = publish(topic.name, {"n": 1})

    assert (result.status, result.error.code) == ("Rejected", "TransportUnavailable")
    assert "connection refused: is the server running on port 1?" in result.error.message


def test_install_procedures_puts_back_this_releases_procedures_and_grants(pg_conn):
    """A migrate that failed after the workqueue migrations committed, then a roll-back of the
    code, leaves a database that records the latest procedure migration but holds another
    release's procedures, which no later migrate would reinstall (it has nothing to apply)."""
    from tests.support.roles import database_role
    from workqueue.driver.install import reinstall_procedures

    sub = SubscriptionFactory()
    publish(sub.topic.name, {"n": 1})
    with database_role(pg_conn, "wq_runtime") as role:
        run("grant-runtime", role)
        try:
            # Another release's wq_backlog (a stand-in that answers wrongly), without the grant.
            pg_conn.execute(
                "CREATE OR REPLACE FUNCTION wq_backlog(p_subscription_id uuid, p_cap integer) "
                "RETURNS TABLE (claimable bigint, in_flight bigint) LANGUAGE sql "
                "AS $$ SELECT 7::bigint, 7::bigint $$"
            )
            pg_conn.execute(f'REVOKE EXECUTE ON FUNCTION wq_backlog(uuid, integer) FROM "{role}"')

            out = run("install-procedures")

            backlog = json.loads(run("backlog", "-s", sub.name, "--json"))
            granted = pg_conn.execute(
                "SELECT has_function_privilege(%s, 'wq_backlog(uuid, integer)', 'EXECUTE')",
                [role],
            ).fetchone()[0]
        finally:
            reinstall_procedures(connection)  # whatever happened above

    installed = f"Installed the procedures of workqueue.{LATEST_PROCEDURE_MIGRATION}"
    assert installed in out and f"{role} (runtime)" in out
    assert (backlog["claimable"], backlog["in_flight"]) == (1, 0)
    assert granted is True


def test_stats_a_procedure_cannot_give_are_unavailable_and_the_log_says_why(pg_conn, caplog):
    """A process of a new release whose migrate has not run yet called a stats procedure that
    did not exist: every surface said "unavailable", and nothing said why."""
    sub = SubscriptionFactory()
    pg_conn.execute("ALTER FUNCTION wq_subscription_stats(uuid, integer) RENAME TO wq_gone")
    try:
        with (
            caplog.at_level(logging.WARNING, logger="workqueue.operators.operations"),
            pytest.raises(CommandError, match="Stats of 1 subscription"),
        ):
            run("stats", "-s", sub.name)
    finally:
        pg_conn.execute("ALTER FUNCTION wq_gone(uuid, integer) RENAME TO wq_subscription_stats")

    assert "wq_subscription_stats" in caplog.text and "does not exist" in caplog.text
    assert "`manage.py migrate` has not run" in caplog.text
    assert len(caplog.records) == 1  # one line a call, however many subscriptions failed


@pytest.mark.parametrize(
    ("comment", "said"),
    [
        ("'django-workqueue procedures 0001_initial 0123456789abcdef'", "(0001_initial)"),
        ("NULL", "(from before stamps)"),
    ],
    ids=["earlier", "none"],
)
def test_an_earlier_releases_procedures_are_named_by_validate_bindings_and_host_start(
    pg_conn, make_host, caplog, comment, said
):
    """A process started before `migrate` (or on procedures a failed migrate and a code
    roll-back left) failed call by call with nothing saying why."""
    from workqueue.driver import get_driver
    from workqueue.driver.install import reinstall_procedures

    assert get_driver().procedures_problem() is None  # as migrate installed them
    pg_conn.execute(f"COMMENT ON FUNCTION {claim_signature(pg_conn)} IS {comment}")
    try:
        out = io.StringIO()
        with pytest.raises(CommandError, match="validate-bindings found errors"):
            call_command("workqueue", "validate-bindings", "--json", stdout=out)
        report = json.loads(out.getvalue())
        with caplog.at_level(logging.WARNING, logger="workqueue.runtime.host"):
            make_host([{"name": "*", "concurrency": 1}]).start()
        run("install-procedures")
        fixed = get_driver().procedures_problem()
    finally:
        reinstall_procedures(connection)

    (issue,) = [i for i in report if "not this release's" in i["message"]]
    assert issue["severity"] == "Error"
    assert f"an earlier release's {said}" in issue["message"]
    assert "manage.py migrate" in issue["message"]
    assert "not this release's" in caplog.text and "install-procedures" in caplog.text
    assert fixed is None


def test_a_later_releases_procedures_are_not_reported_nor_replaced_by_an_earlier_process(
    pg_conn, make_host, caplog
):
    """During a rolling deploy the previous release's processes run on the new procedures,
    which keep serving their calls: telling them to reinstall theirs (as the first stamp did,
    helper-105) would take back what the new release's processes call."""
    from workqueue.driver import get_driver
    from workqueue.driver.install import reinstall_procedures

    later = "'django-workqueue procedures 9999_a_later_release 0123456789abcdef'"
    pg_conn.execute(f"COMMENT ON FUNCTION {claim_signature(pg_conn)} IS {later}")
    try:
        problem = get_driver().procedures_problem()
        with caplog.at_level(logging.WARNING, logger="workqueue.runtime.host"):
            make_host([{"name": "*", "concurrency": 1}]).start()
        with pytest.raises(CommandError, match="a later release's \\(9999_a_later_release\\)"):
            run("install-procedures")
        kept = get_driver().installed_procedures()
    finally:
        reinstall_procedures(connection)

    assert problem is None and "not this release's" not in caplog.text
    assert kept == "9999_a_later_release"


def claim_signature(pg_conn: Any) -> str:
    return pg_conn.execute("SELECT 'wq_claim'::regproc::regprocedure::text").fetchone()[0]
