"""Topology as code (issue 17 §7): ``manage.py workqueue sync-topology [--dry-run] [--prune]``
applies ``WORKQUEUE["TOPOLOGY"]``: idempotent, prints the difference, validates like the admin,
all or nothing, and never deletes a subscription that still has deliveries."""

from __future__ import annotations

import io
import json
import logging
import threading

import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from tests.factories import SubscriptionFactory, TopicFactory, TransportFactory
from tests.support.database import psycopg_params
from tests.support.waiting import wait_until
from workqueue import publish
from workqueue.models import Subscription, Topic, Transport
from workqueue.tasks.messages import HANDLER_KEY

pytestmark = pytest.mark.usefixtures("queue_db")

EU_ONLY = {"logic": "and", "filters": [{"field": "region", "operator": "eq", "value": "eu"}]}
#: A module-level declaration, for the dotted-path form of the setting.
DECLARED = {
    "topics": {"shop.orders": {"allow_external_publish": True, "retention_days": 3}},
    "subscriptions": {
        "shop.orders-billing": {
            "topic": "shop.orders",
            "handler_key": "billing.invoice",
            "max_attempts": 7,
            "partition_mode": "Ordered",
        },
        "shop.orders-eu": {
            "topic": "shop.orders",
            "handler_key": "eu.notify",
            # Its keys in another order than the stored form: the same filter, no difference.
            "filter": {
                "filters": [{"value": "eu", "operator": "eq", "field": "region"}],
                "logic": "and",
            },
        },
    },
}


@pytest.fixture
def declare(settings):
    TransportFactory()  # what migrate seeds; the transactional tests flush it

    def apply(topology) -> None:
        settings.WORKQUEUE = {**settings.WORKQUEUE, "TOPOLOGY": topology}

    return apply


def sync(*args: str) -> str:
    out = io.StringIO()
    call_command("workqueue", "sync-topology", *args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def test_a_dry_run_prints_the_plan_and_writes_nothing_then_sync_applies_it_once(declare):
    declare(DECLARED)

    planned = sync("--dry-run")
    assert not Topic.objects.filter(name="shop.orders").exists()
    applied = sync()
    again = sync()

    assert "+ topic shop.orders (new: allow_external_publish=True" in planned
    assert "+ subscription shop.orders-billing" in planned
    assert "Dry run: 3 change(s) validated, nothing written." in planned
    assert applied.replace("Applied", "Dry run:").split("\n")[:3] == planned.split("\n")[:3]
    assert "Applied 3 change(s)." in applied
    assert "No changes: the database matches the declared topology." in again
    billing = Subscription.objects.get(name="shop.orders-billing")
    assert (billing.topic.name, billing.max_attempts, billing.partition_mode) == (
        "shop.orders",
        7,
        "Ordered",
    )
    assert Subscription.objects.get(name="shop.orders-eu").filter == EU_ONLY
    assert Topic.objects.get(name="shop.orders").transport.name == "Database"


def test_the_database_transport_a_transactional_tests_flush_removed_is_made_again(settings):
    """Every transactional test (TransactionTestCase, pytest-django's transactional_db) empties
    the tables, the transport `migrate` seeds included, and the sync then refused every topic:
    "no transport is named 'Database'", which no declaration can add (helper-118)."""
    from workqueue.models.topology import SEEDED_TRANSPORT_ID
    from workqueue.operators.topology import topology_drift

    Transport.objects.all().delete()
    settings.WORKQUEUE = {**settings.WORKQUEUE, "TOPOLOGY": DECLARED}

    drift = [(c.action, c.kind, c.name) for c in topology_drift()]
    planned = sync("--dry-run")
    assert not Transport.objects.exists()
    applied = sync()

    assert drift[:2] == [("create", "transport", "Database"), ("create", "topic", "shop.orders")]
    assert "+ transport Database" in planned and "+ topic shop.orders" in planned
    assert "Dry run: 4 change(s) validated, nothing written." in planned
    assert "Applied 4 change(s)." in applied
    transport = Transport.objects.get()
    assert (transport.id, transport.name, transport.driver_class) == (
        SEEDED_TRANSPORT_ID,
        "Database",
        "Database",
    )
    assert Topic.objects.get(name="shop.orders").transport == transport
    assert publish("shop.orders", {"n": 1}).accepted
    assert "No changes" in sync()


def test_a_renamed_seeded_transport_is_not_made_twice(settings):
    """The seeded transport renamed in the admin is still there under its fixed id: making it
    again failed on the primary key (review helper-119); the declaration's topics name a
    transport that does not exist, and the sync says so."""
    Transport.objects.all().delete()
    Transport.seeded().save()
    Transport.objects.update(name="Primary")
    settings.WORKQUEUE = {**settings.WORKQUEUE, "TOPOLOGY": DECLARED}

    with pytest.raises(CommandError, match="no transport is named 'Database'"):
        sync()
    assert list(Transport.objects.values_list("name", flat=True)) == ["Primary"]


def test_verbosity_0_prints_nothing_but_errors(declare):
    declare(DECLARED)
    out = io.StringIO()

    call_command("workqueue", "sync-topology", verbosity=0, stdout=out)

    assert out.getvalue() == ""
    assert Subscription.objects.filter(topic__name="shop.orders").count() == 2


def test_code_wins_on_declared_fields_and_the_admin_keeps_the_others(declare):
    declare("tests.integration.test_topology_sync.DECLARED")
    sync()
    # Admin edits: one declared field, one the declaration leaves alone.
    Subscription.objects.filter(name="shop.orders-billing").update(max_attempts=2, status="Paused")

    out = sync()

    assert "~ subscription shop.orders-billing: max_attempts 2 -> 7" in out
    billing = Subscription.objects.get(name="shop.orders-billing")
    assert (billing.max_attempts, billing.status) == (7, "Paused")


def test_an_invalid_row_is_reported_like_the_admin_and_nothing_is_written(declare):
    declare(
        {
            "topics": {"shop.refunds": {}},
            "subscriptions": {
                "shop.refunds-audit": {"topic": "shop.refunds", "handler_key": "audit"},
                "shop.refunds-bad": {
                    "topic": "shop.refunds",
                    "handler_key": "x",
                    "backoff_base_seconds": 60,
                    "backoff_max_seconds": 10,
                },
                "shop.refunds-nowhere": {"topic": "shop.missing", "handler_key": "x"},
            },
        }
    )

    with pytest.raises(CommandError) as exc:
        sync()

    text = str(exc.value)
    assert "subscription shop.refunds-bad: backoff_max_seconds: Must be at least" in text
    assert "subscription shop.refunds-nowhere: topic: no topic is named 'shop.missing'" in text
    assert not Topic.objects.filter(name="shop.refunds").exists()
    assert not Subscription.objects.filter(name="shop.refunds-audit").exists()


def test_invalid_changes_to_stored_rows_are_all_reported_and_nothing_is_written(declare):
    """Rows already stored are validated like new ones: each invalid change named, none
    written (audit helper-106: with updates unvalidated, the model's own guard stopped the
    sync at the first bad row, with another error, naming only that one)."""
    declare(DECLARED)
    sync()
    invalid = {"backoff_base_seconds": 60, "backoff_max_seconds": 10}
    subscriptions = DECLARED["subscriptions"]
    declare(
        {
            "topics": {"shop.orders": {"allow_external_publish": True, "retention_days": 5}},
            "subscriptions": {name: {**row, **invalid} for name, row in subscriptions.items()},
        }
    )

    with pytest.raises(CommandError) as exc:
        sync()

    text = str(exc.value)
    for name in subscriptions:
        assert f"subscription {name}: backoff_max_seconds: Must be at least" in text
    assert Topic.objects.get(name="shop.orders").retention_days == 3
    assert not Subscription.objects.filter(backoff_max_seconds=10).exists()


def test_unknown_fields_are_refused_naming_the_row_and_the_fields():
    from django.test import override_settings

    from workqueue.operators.topology import declared_topology

    bad = {"topics": {"t.x": {"retention": 3}}}
    with override_settings(WORKQUEUE={"TOPOLOGY": bad}), pytest.raises(Exception) as exc:
        declared_topology()
    assert 'WORKQUEUE["TOPOLOGY"]["topics"]["t.x"] has unknown field(s) retention' in str(exc.value)


def test_prune_keeps_the_queues_the_tasks_api_made(declare):
    """A Tasks API queue's topic and subscription are made by the first enqueue, not
    declared: --prune on every deploy deleted the idle ones, and a deployment whose runtime
    role may not create topology could enqueue on them no more."""
    declare(DECLARED)
    topic = TopicFactory(name="tasks.default")
    SubscriptionFactory(topic=topic, name="tasks.default", handler_key=HANDLER_KEY)

    out = sync("--prune")

    assert "  subscription tasks.default: not declared; kept (a Tasks API queue)" in out
    assert "  topic tasks.default: not declared; kept (a Tasks API queue)" in out
    assert Subscription.objects.filter(name="tasks.default").exists()
    assert Topic.objects.filter(name="tasks.default").exists()


def test_undeclared_rows_are_kept_and_prune_never_deletes_one_with_deliveries(declare):
    declare(DECLARED)
    busy = SubscriptionFactory(topic=TopicFactory(name="legacy.busy"), name="legacy.busy-sub")
    idle = SubscriptionFactory(topic=TopicFactory(name="legacy.idle"), name="legacy.idle-sub")
    publish(busy.topic.name, {"n": 1})

    kept = sync()
    with pytest.raises(CommandError, match="2 undeclared row"):
        sync("--prune", "--dry-run")
    assert Subscription.objects.filter(name=idle.name).exists()  # the dry run wrote nothing
    out = io.StringIO()
    with pytest.raises(CommandError):
        call_command("workqueue", "sync-topology", "--prune", stdout=out)
    pruned = out.getvalue()

    assert "  subscription legacy.idle-sub: not declared; kept (--prune deletes it)" in kept
    assert "- subscription legacy.idle-sub: not declared; deleted (--prune)" in pruned
    assert "- topic legacy.idle: not declared; deleted (--prune)" in pruned
    assert (
        "! subscription legacy.busy-sub: not declared, but not deleted: it has 1 deliveries; "
        "retire it with `manage.py workqueue retire-subscription legacy.busy-sub`"
    ) in pruned
    assert "! topic legacy.busy: not declared, but not deleted: subscriptions still use it" in (
        pruned
    )
    assert set(Subscription.objects.values_list("name", flat=True)) == {
        "legacy.busy-sub",
        "shop.orders-billing",
        "shop.orders-eu",
    }


def test_json_lists_each_change(declare):
    declare(DECLARED)

    data = json.loads(sync("--json", "--dry-run"))

    assert data["dry_run"] is True
    assert [(c["action"], c["kind"], c["name"]) for c in data["changes"]] == [
        ("create", "topic", "shop.orders"),
        ("create", "subscription", "shop.orders-billing"),
        ("create", "subscription", "shop.orders-eu"),
    ]


def drift_warnings(*, in_the_test_environment: bool = False) -> list[str]:
    """W006 as `manage.py check --database default` reports it: in Django's test environment
    (marked by mail.outbox) the check is skipped, since a new test database was never synced."""
    from django.core import checks, mail

    outbox = mail.outbox
    if not in_the_test_environment:
        del mail.outbox
    try:
        found = checks.run_checks(databases=["default"], tags=[checks.Tags.database])
    finally:
        mail.outbox = outbox
    return [m.msg for m in found if m.id == "workqueue.W006"]


def test_the_drift_check_is_skipped_on_a_test_database(declare):
    declare(DECLARED)
    assert drift_warnings(in_the_test_environment=True) == []
    assert len(drift_warnings()) == 1


def test_check_warns_while_the_declaration_is_not_applied_and_writes_nothing(declare):
    """A deploy that skipped sync-topology runs the topology the database had; `check
    --database` (and migrate) said nothing of it."""
    assert drift_warnings() == []  # nothing declared
    declare(DECLARED)

    (before,) = drift_warnings()
    assert not Topic.objects.filter(name="shop.orders").exists()  # the check wrote nothing
    sync()
    applied = drift_warnings()
    # An admin edit to a declared field, and a filter stored in another form of the same.
    Subscription.objects.filter(name="shop.orders-billing").update(max_attempts=2)
    (edited,) = drift_warnings()

    assert before.startswith(
        "The database's topology is not the one WORKQUEUE['TOPOLOGY'] declares (topic "
        "shop.orders does not exist; subscription shop.orders-billing does not exist; "
        "subscription shop.orders-eu does not exist): run `manage.py workqueue sync-topology`"
    )
    assert applied == []
    assert "(subscription shop.orders-billing differs in max_attempts)" in edited
    assert Subscription.objects.get(name="shop.orders-billing").max_attempts == 2


def test_check_names_a_declared_row_the_sync_would_refuse(declare):
    declare(
        {
            "topics": {"shop.refunds": {}},
            "subscriptions": {
                "shop.refunds-late": {"topic": "shop.missing", "handler_key": "x"},
            },
        }
    )

    (warning,) = drift_warnings()

    assert "would refuse, so the database keeps the topology it has" in warning
    assert "subscription shop.refunds-late: topic: no topic is named 'shop.missing'" in warning
    assert not Topic.objects.filter(name="shop.refunds").exists()


@pytest.mark.parametrize(
    "fields", [{"handler_key": None}, {"transport": ["Database"]}], ids=["none", "list"]
)
def test_a_declared_value_no_field_takes_is_a_warning_not_a_crash(declare, fields):
    """check --database and migrate raised (AttributeError, TypeError) on such a value."""
    topic_fields = {"transport": fields["transport"]} if "transport" in fields else {}
    sub_fields = {k: v for k, v in fields.items() if k != "transport"}
    declare(
        {
            "topics": {"shop.odd": topic_fields},
            "subscriptions": {"shop.odd-sub": {"topic": "shop.odd", **sub_fields}},
        }
    )
    Topic.objects.create(name="shop.odd", transport=Transport.objects.get(name="Database"))

    (warning,) = drift_warnings()

    assert "could not be compared with the database" in warning and "sync-topology" in warning


def test_a_subscription_moved_to_a_topic_still_to_create_is_reported_as_the_dry_run_does(
    declare,
):
    declare(DECLARED)
    sync()
    moved = {**DECLARED["subscriptions"]["shop.orders-billing"], "topic": "shop.returns"}
    declare(
        {
            "topics": {**DECLARED["topics"], "shop.returns": {}},
            "subscriptions": {**DECLARED["subscriptions"], "shop.orders-billing": moved},
        }
    )

    (warning,) = drift_warnings()

    assert "topic shop.returns does not exist" in warning
    assert "subscription shop.orders-billing differs in topic" in warning


def test_an_applied_declaration_is_compared_without_validating_every_row(
    declare, django_assert_max_num_queries
):
    """Every row was validated as the admin does, a dozen queries each, at every host start
    and job (100 subscriptions: 1,210 queries): rows declared as stored need none."""
    from workqueue.operators.topology import topology_drift

    subscriptions = {
        f"shop.orders-s{n}": {"topic": "shop.orders", "handler_key": "billing.invoice"}
        for n in range(30)
    }
    declare({"topics": DECLARED["topics"], "subscriptions": subscriptions})
    sync()

    with django_assert_max_num_queries(4):
        assert topology_drift() == []


def test_a_host_starting_on_a_topology_not_yet_applied_says_so(declare, make_host, caplog):
    declare(DECLARED)
    caplog.set_level(logging.WARNING, logger="workqueue.runtime.host")

    make_host([{"name": "*", "concurrency": 1}]).start()

    assert "subscription shop.orders-billing does not exist" in caplog.text
    assert "sync-topology" in caplog.text


def test_a_sync_crossing_another_writer_is_tried_again_not_lost(declare, pg_conn):
    """Review helper-135's residual: a transaction writing several topology rows locks them in
    its own order, so two such writers crossing deadlock and PostgreSQL aborts one. The sync
    is the one aborted here (it waited first): it tries again once the other has committed,
    instead of failing a deploy's step with "deadlock detected"."""
    declare({"topics": {"t.first": {"retention_days": 3}, "t.second": {"retention_days": 3}}})
    sync()
    declare({"topics": {"t.first": {"retention_days": 5}, "t.second": {"retention_days": 5}}})
    lock = "SELECT 1 FROM workqueue_topic WHERE name = %s FOR UPDATE"
    other = psycopg.connect(autocommit=True, **psycopg_params())
    raised: list[BaseException] = []
    printed: list[str] = []

    def run_sync() -> None:
        try:
            printed.append(sync())
        except BaseException as exc:  # reported by the assertion below
            raised.append(exc)
        finally:
            connection.close()

    def sync_waits() -> bool:
        return bool(
            pg_conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database() AND pid <> %s",
                (other.info.backend_pid,),
            ).fetchone()[0]
        )

    thread = threading.Thread(target=run_sync)
    with other, other.transaction():
        other.execute(lock, ("t.second",))
        thread.start()
        # The sync has written t.first and waits for t.second; taking t.first now closes the
        # circle, and the sync, waiting longer, is the one PostgreSQL aborts.
        wait_until(sync_waits, timeout=10)
        other.execute(lock, ("t.first",))
    thread.join(30)

    assert not thread.is_alive()
    assert not raised, raised
    assert "Applied 2 change(s)." in printed[0]
    assert set(Topic.objects.values_list("retention_days", flat=True)) == {5}


def test_a_handler_key_no_handler_registers_but_one_nearly_does_is_said_where_it_is_applied(
    declare,
):
    """A typo'd handler key was applied without a word ("Applied 1 change(s)", exit 0); only a
    separate ``check --database`` named it (helper-158). A key unlike every registered one
    may be another codebase's: not warned, as check W004 does not."""
    import tests.support.handlers  # noqa: F401  (registers tests.record)

    declare(
        {
            "topics": {"shop.orders": {}},
            "subscriptions": {
                "shop.orders-typo": {"topic": "shop.orders", "handler_key": "tests.recrod"},
                "shop.orders-elsewhere": {"topic": "shop.orders", "handler_key": "crm.sync"},
            },
        }
    )
    out, err = io.StringIO(), io.StringIO()

    call_command("workqueue", "sync-topology", stdout=out, stderr=err)

    warned = [
        "Warning: subscription 'shop.orders-typo' runs handler key 'tests.recrod', which no "
        "handler of this project registers; did you mean 'tests.record'?"
    ]
    assert "Applied 3 change(s)." in out.getvalue()
    assert err.getvalue().splitlines() == warned
    assert json.loads(sync("--dry-run", "--json"))["warnings"] == warned
