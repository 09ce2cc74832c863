"""A transport, topic or subscription the admin would refuse cannot be written from code either.

Every ORM write path (``save()``, ``objects.create``, ``update_or_create``, queryset
``update``, ``bulk_create``, ``bulk_update`` and ``loaddata``) applies the rules the admin
applies (the fields' validators and the model's ``clean()``) and refuses with a
``ValidationError`` that names the row, the field and the fix; nothing is written.
"""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.core import serializers
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.db import connection, models, transaction

from tests.factories import SubscriptionFactory, TopicFactory, TransportFactory
from tests.support.filter_cases import any_of, leaf, root
from tests.support.queue import dead_letter, pending
from tests.support.transports import LIMITED, limited_transport
from tests.support.waiting import wait_until
from workqueue import publish, publish_many
from workqueue.driver import get_driver
from workqueue.models import Delivery, Subscription, Topic, Transport
from workqueue.operators import operations
from workqueue.transport import Receiver

pytestmark = pytest.mark.django_db

ROOT_OR = {"logic": "or", "filters": [leaf("a", "eq", "x")]}


def _row(model: type[models.Model]) -> models.Model:
    """A saved, valid row of ``model``."""
    if model is Transport:
        return TransportFactory(name="Spare")
    if model is Topic:
        return TopicFactory()
    return SubscriptionFactory()


def _fields(instance: models.Model, *, copy: bool = False, **changes: Any) -> dict[str, Any]:
    """Every concrete field of ``instance`` (foreign keys by id) with ``changes`` applied; for a
    ``copy``, without the primary key and under another name."""
    values = {f.attname: getattr(instance, f.attname) for f in type(instance)._meta.concrete_fields}
    if copy:
        del values["id"]
        values["name"] = f"{values['name']}-copy"
    return {**values, **changes}


def _loaddata(tmp_path: Path, model: type[models.Model], fields: dict[str, Any]) -> None:
    fixture = tmp_path / "topology.json"
    fixture.write_text(serializers.serialize("json", [model(**fields)]))
    call_command("loaddata", str(fixture), stdout=io.StringIO())


# Each write path writes ``changes`` over a valid row: a new row from its fields, or the row.
WRITES: dict[str, Callable[[models.Model, dict[str, Any], Path], Any]] = {
    "instance.save": lambda row, changes, _: (
        [setattr(row, name, value) for name, value in changes.items()],
        row.save(),
    ),
    "manager.create": lambda row, changes, _: type(row).objects.create(
        **_fields(row, copy=True, **changes)
    ),
    "manager.update_or_create": lambda row, changes, _: type(row).objects.update_or_create(
        pk=row.pk, defaults=changes
    ),
    "queryset.update": lambda row, changes, _: type(row)
    .objects.filter(pk=row.pk)
    .update(**changes),
    "manager.bulk_create": lambda row, changes, _: type(row).objects.bulk_create(
        [type(row)(**_fields(row, copy=True, **changes))]
    ),
    "manager.bulk_update": lambda row, changes, _: type(row).objects.bulk_update(
        [type(row)(**_fields(row, **changes))], list(changes)
    ),
    "loaddata": lambda row, changes, tmp_path: _loaddata(
        tmp_path, type(row), _fields(row, **changes)
    ),
}

# (model, changes, field the error names, a fragment of its message)
REFUSED: list[tuple[type[models.Model], dict[str, Any], str, str]] = [
    (Subscription, {"filter": ROOT_OR}, "filter", "the root logic must be 'and'"),
    (
        Subscription,
        {"filter": root(leaf("a", "contains", "x"))},
        "filter",
        "unsupported operator 'contains'",
    ),
    (
        Subscription,
        {"backoff_base_seconds": 60, "backoff_max_seconds": 10},
        "backoff_max_seconds",
        "Must be at least backoff_base_seconds (60)",
    ),
    (Subscription, {"handler_key": "  "}, "handler_key", "needs the handler key"),
    (Subscription, {"name": "Orders Billing"}, "name", "lower-case words"),
    (Subscription, {"lease_seconds": 2}, "lease_seconds", "greater than or equal to 5"),
    (Subscription, {"partition_mode": "Sometimes"}, "partition_mode", "not a valid choice"),
    (
        Subscription,
        {"host_type": "External", "handler_key": ""},
        "host_type",
        "need supports_external_consumers, which the Database transport",
    ),
    (Subscription, {"binding_config": ["queue"]}, "binding_config", "JSON object"),
    (Topic, {"name": "Orders Created"}, "name", "lower-case words"),
    (Topic, {"max_payload_bytes": 0}, "max_payload_bytes", "greater than or equal to 1"),
    # Review helper-164: "for ever" as 4,000,000 days took the purges' cutoff before 4713 BC,
    # and every topic's retention stopped with it.
    (Topic, {"retention_days": 36_501}, "retention_days", "at most 36500 days (100 years)"),
    (Topic, {"binding_config": "arn:aws:sns:x"}, "binding_config", "JSON object"),
    (Transport, {"driver_class": "Kafka"}, "driver_class", "No transport is registered as 'Kafka'"),
    (Transport, {"name": "-spare"}, "name", "starting with a letter or digit"),
    (Transport, {"configuration": [1, 2]}, "configuration", "JSON object"),
]


@pytest.mark.parametrize("write", list(WRITES))
@pytest.mark.parametrize(
    ("model", "changes", "field", "fragment"),
    [pytest.param(*case, id=f"{case[0].__name__}-{case[2]}") for case in REFUSED],
)
def test_a_row_the_admin_would_refuse_is_refused_on_every_write_path(
    tmp_path: Path,
    write: str,
    model: type[models.Model],
    changes: dict[str, Any],
    field: str,
    fragment: str,
):
    row = _row(model)
    before = list(model.objects.order_by("pk").values())

    # In a savepoint of its own: bulk_update, like Django's other multi-statement writes, marks
    # the caller's transaction for rollback on any error.
    with pytest.raises(ValidationError) as refused, transaction.atomic():
        WRITES[write](row, changes, tmp_path)

    assert field in refused.value.message_dict, refused.value.message_dict
    assert fragment in " ".join(refused.value.message_dict[field])
    text = str(refused.value)
    assert text.startswith(f"{model.__name__} '") and "was not saved" in text
    assert f"{field}: " in text and fragment in text
    assert list(model.objects.order_by("pk").values()) == before


# -- what is accepted is stored in canonical form --------------------------------------------


WRITTEN = root(leaf("zeta", "eq", "z"), any_of("alpha", "b", "a", "b"))
CANONICAL = {
    "logic": "and",
    "filters": [
        {
            "logic": "or",
            "filters": [
                {"field": "alpha", "operator": "eq", "value": "a"},
                {"field": "alpha", "operator": "eq", "value": "b"},
            ],
        },
        {"field": "zeta", "operator": "eq", "value": "z"},
    ],
}


@pytest.mark.parametrize(
    "write",
    [
        "instance.save",
        "manager.create",
        "queryset.update",
        "manager.bulk_create",
        "manager.bulk_update",
        "loaddata",
    ],
)
@pytest.mark.parametrize("given", [WRITTEN, json.dumps(WRITTEN)], ids=["object", "json-text"])
def test_a_valid_filter_is_stored_in_its_canonical_form(tmp_path: Path, write: str, given: Any):
    """bulk_update (audit helper-129) checked the values its Case computes but wrote the Case
    itself: the filter as given, and given as JSON text, refused by the database's guard with a
    bare IntegrityError."""
    row = SubscriptionFactory()

    WRITES[write](row, {"filter": given}, tmp_path)

    copied = write in ("manager.create", "manager.bulk_create")
    name = f"{row.name}-copy" if copied else row.name
    assert Subscription.objects.get(name=name).filter == CANONICAL


def test_topology_moves_between_databases_with_dumpdata_and_loaddata(tmp_path: Path):
    sub = SubscriptionFactory(filter=WRITTEN, partition_mode="Exclusive")
    fixture = tmp_path / "topology.json"
    with fixture.open("w") as out:
        call_command("dumpdata", "workqueue.transport", "workqueue.topic", "workqueue.subscription",
                     stdout=out)  # fmt: skip
    Subscription.objects.filter(pk=sub.pk).delete()
    Topic.objects.filter(pk=sub.topic_id).delete()

    call_command("loaddata", str(fixture), stdout=io.StringIO())

    loaded = Subscription.objects.get(pk=sub.pk)
    assert (loaded.name, loaded.topic.name, loaded.filter) == (sub.name, sub.topic.name, CANONICAL)


# -- the partition mode is fixed once deliveries exist, on every path -----------------------------


@pytest.mark.parametrize("write", ["instance.save", "queryset.update", "loaddata"])
def test_the_partition_mode_cannot_change_on_any_path_once_deliveries_exist(
    tmp_path: Path, write: str
):
    sub = SubscriptionFactory(partition_mode="None")
    publish(sub.topic.name, {"n": 1}, enlist=True)

    with pytest.raises(ValidationError) as refused:
        WRITES[write](sub, {"partition_mode": "Ordered"}, tmp_path)

    assert "cannot change from None to Ordered" in refused.value.message_dict["partition_mode"][0]
    assert Subscription.objects.get(pk=sub.pk).partition_mode == "None"


def test_a_partition_mode_that_is_no_mode_is_refused_as_that_not_as_a_change():
    """'exclusive' for 'Exclusive' on a subscription with deliveries was refused with a second
    sentence saying the mode cannot change from None to exclusive once there are deliveries:
    the wrong cause, pointing at a new subscription (helper-113)."""
    sub = SubscriptionFactory(partition_mode="None")
    publish(sub.topic.name, {"n": 1}, enlist=True)
    sub.partition_mode = "exclusive"

    with pytest.raises(ValidationError) as refused:
        sub.full_clean()

    assert refused.value.message_dict["partition_mode"] == [
        "Value 'exclusive' is not a valid choice."
    ]


# -- work waiting in the queue tables is not moved out of every host's reach ---------------------

AWS_CONFIGURATION = {"region": "eu-west-1", "endpoint_url": "http://127.0.0.1:9"}


def _move(sub: Subscription, to: Transport, what: str, write: str, tmp_path: Path) -> None:
    if what == "topic":
        WRITES[write](sub.topic, {"transport_id": to.pk}, tmp_path)
    else:
        WRITES[write](sub, {"topic_id": TopicFactory(transport=to).pk}, tmp_path)


@pytest.mark.usefixtures("queue_db")
@pytest.mark.parametrize("write", ["instance.save", "queryset.update", "loaddata"])
@pytest.mark.parametrize("what", ["topic", "subscription"])
@pytest.mark.parametrize("waiting", ["Pending", "DeadLettered"])
def test_work_waiting_in_the_database_keeps_its_topic_off_a_transport_that_does_not_read_it(
    tmp_path: Path, write: str, what: str, waiting: str
):
    """Audit helper-129: a Database topic with waiting work was accepted onto an AWS transport
    (or its subscription onto an AWS topic). Hosts then ran the subscription from SQS and the
    operators' procedures refused it, so its deliveries in the queue tables were read by
    nobody, and the move back was refused (AWS names its resources after the topology)."""
    aws = TransportFactory(name="aws-move", driver_class="AWS", configuration=AWS_CONFIGURATION)
    sub = SubscriptionFactory()
    if waiting == "DeadLettered":
        dead_letter(sub)
    else:
        pending(sub)

    with pytest.raises(ValidationError) as refused, transaction.atomic():
        _move(sub, aws, what, write, tmp_path)

    field = "transport" if what == "topic" else "topic"
    assert "Deliveries still wait in the database" in refused.value.message_dict[field][0]
    stored = Subscription.objects.select_related("topic__transport").get(pk=sub.pk)
    assert stored.topic.transport.driver_class == "Database"


@pytest.mark.usefixtures("queue_db")
@pytest.mark.parametrize("what", ["topic", "subscription"])
def test_a_drained_topic_moves_to_a_transport_that_does_not_read_the_database(
    tmp_path: Path, what: str
):
    aws = TransportFactory(name="aws-move", driver_class="AWS", configuration=AWS_CONFIGURATION)
    sub = SubscriptionFactory()
    pending(sub)
    receiver = Receiver(sub.id)
    [delivery] = receiver.receive(1).deliveries
    assert receiver.complete(delivery).settled

    _move(sub, aws, what, "instance.save", tmp_path)

    assert Subscription.objects.get(pk=sub.pk).topic.transport_id == aws.pk


@pytest.mark.usefixtures("queue_db")
@pytest.mark.parametrize("batch", [False, True], ids=["publish", "publish_many"])
def test_a_publish_that_waited_for_a_move_goes_to_the_topics_new_transport(pg_conn, batch):
    """Audit helper-131: a publish read the topic's transport, then waited for the topology lock
    the move held while it checked for waiting work, then wrote Database deliveries for a
    topic the move had just put on AWS: stranded, the work the check is there to keep in
    reach. A publish that waited reads the transport again."""
    aws = TransportFactory(name="aws-move", driver_class="AWS", configuration=AWS_CONFIGURATION)
    sub = SubscriptionFactory()
    topic = sub.topic
    answers: list[Any] = []

    def publisher() -> None:
        try:
            if batch:
                answers.extend(publish_many(topic.name, [{"payload": {"n": 1}}]))
            else:
                answers.append(publish(topic.name, {"n": 1}))
        except Exception as exc:  # the AWS endpoint does not answer
            answers.append(exc)
        finally:
            get_driver().close()
            connection.close()

    def publisher_waits() -> bool:
        return (
            pg_conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory'"
            ).fetchone()[0]
            > 0
        )

    with transaction.atomic():
        topic.transport = aws
        topic.save()  # holds the topology lock until this block commits
        thread = threading.Thread(target=publisher)
        thread.start()
        wait_until(publisher_waits, timeout=10)
    thread.join(30)

    assert not Delivery.objects.filter(subscription=sub).exists(), answers
    [answer] = answers
    assert not getattr(answer, "accepted", False), answer


def _saving(model: type[models.Model], pk: Any, **changes: Any) -> Callable[[], None]:
    """A save of ``model``'s row ``pk`` with ``changes``, read when it runs."""

    def save() -> None:
        row = model.objects.get(pk=pk)
        for name, value in changes.items():
            setattr(row, name, value)
        row.save()

    return save


def _race(saves: dict[str, Callable[[], None]], first: str, pg_conn: Any) -> list[Any]:
    """Run the ``first`` of two ``saves`` in a transaction left open while the other runs in
    another thread, until that one either waits for a lock the first holds or has finished;
    then commit the first. What the second raised, if anything."""
    [second] = [save for name, save in saves.items() if name != first]
    raised: list[Any] = []

    def run_second() -> None:
        try:
            with transaction.atomic():
                second()
        except ValidationError as exc:
            raised.append(exc)
        finally:
            connection.close()

    def second_waits_or_ended() -> bool:
        waiting = pg_conn.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE wait_event_type = 'Lock' AND datname = current_database()"
        ).fetchone()[0]
        return waiting > 0 or not thread.is_alive()

    thread = threading.Thread(target=run_second)
    with transaction.atomic():
        saves[first]()
        thread.start()
        wait_until(second_waits_or_ended, timeout=10)
    thread.join(30)
    assert not thread.is_alive()
    return raised


def _stranded(sub: Subscription) -> bool:
    """Whether ``sub`` has open deliveries in the queue tables while its topic is on a transport
    that does not read them."""
    stored = Subscription.objects.select_related("topic__transport").get(pk=sub.pk)
    return (
        stored.topic.transport.driver_class == "AWS"
        and Delivery.objects.filter(
            subscription=sub, status__in=["Pending", "InFlight", "DeadLettered"]
        ).exists()
    )


@pytest.mark.usefixtures("queue_db")
@pytest.mark.parametrize("first", ["topic moves", "subscription moves"])
def test_a_subscription_joining_a_topic_that_leaves_the_database_at_once_strands_nothing(
    pg_conn: Any, first: str
):
    """Two admins at once (helper-131's residual): a subscription with waiting work moves to a
    Database topic while that topic moves to AWS. Each check passed on what it saw (the topic
    had no waiting work yet; the subscription joined a Database topic), and once both
    committed the subscription's deliveries waited in tables no host reads for it. The second
    save now waits for the first and is refused."""
    aws = TransportFactory(name="aws-move", driver_class="AWS", configuration=AWS_CONFIGURATION)
    sub = SubscriptionFactory()
    pending(sub)
    # On a Database transport of its own, so the subscription's move locks transports too.
    joined = TopicFactory(transport=TransportFactory(name="other-database"))
    saves = {
        "topic moves": _saving(Topic, joined.pk, transport=aws),
        "subscription moves": _saving(Subscription, sub.pk, topic=joined),
    }

    refused = _race(saves, first, pg_conn)

    assert not _stranded(sub)
    assert len(refused) == 1, refused
    assert "Deliveries still wait in the database" in str(refused[0])


@pytest.mark.usefixtures("queue_db")
@pytest.mark.parametrize("first", ["transport changes driver", "topic moves"])
def test_a_topic_joining_a_transport_whose_driver_changes_at_once_strands_nothing(
    pg_conn: Any, first: str
):
    """The same race a level up: a topic with waiting work moves to a Database transport
    while that transport's driver changes to AWS. The transport had no topics when it checked,
    the topic joined a Database transport when it did, and both committed."""
    sub = SubscriptionFactory()
    pending(sub)
    target = TransportFactory(name="changing")
    saves = {
        "transport changes driver": _saving(
            Transport, target.pk, driver_class="AWS", configuration=AWS_CONFIGURATION
        ),
        "topic moves": _saving(Topic, sub.topic_id, transport=target),
    }

    refused = _race(saves, first, pg_conn)

    assert not _stranded(sub)
    assert len(refused) == 1, refused


@pytest.mark.usefixtures("queue_db")
def test_a_move_that_strands_nothing_does_not_wait_for_the_topics_publishes():
    """Review helper-135: the fix for the races above first took both topics' topology locks on
    every move; publishes hold them shared, a running task's enqueue until the task commits,
    so a plain move waited for those (and publishes queued behind it) and failed after 5 s
    with LockTimeoutError. A move locks rows now, which publishes do not."""
    sub = SubscriptionFactory()
    elsewhere = TopicFactory()
    holding, release = threading.Event(), threading.Event()

    def publisher_in_a_long_transaction() -> None:
        try:
            with transaction.atomic():
                publish(sub.topic.name, {"n": 1}, enlist=True)
                holding.set()
                release.wait(30)
        finally:
            connection.close()

    thread = threading.Thread(target=publisher_in_a_long_transaction)
    thread.start()
    try:
        assert holding.wait(10)
        moving = Subscription.objects.get(pk=sub.pk)
        moving.topic = elsewhere
        moving.save()  # raised LockTimeoutError after 5 s
        assert not release.is_set()
    finally:
        release.set()
        thread.join(30)
    assert Subscription.objects.get(pk=sub.pk).topic_id == elsewhere.pk


def test_a_transports_driver_cannot_change_under_its_topics():
    """The same stranding from the transport's row: its topics' waiting work stays where the
    old driver keeps it, which the new one never reads."""
    used = TransportFactory(name="used")
    TopicFactory(transport=used)
    unused = TransportFactory(name="unused")

    with pytest.raises(ValidationError) as refused, transaction.atomic():
        Transport.objects.filter(pk=used.pk).update(
            driver_class="AWS", configuration=AWS_CONFIGURATION
        )
    unused.driver_class, unused.configuration = "AWS", AWS_CONFIGURATION
    unused.save()

    assert "the driver cannot change under them" in refused.value.message_dict["driver_class"][0]
    assert Transport.objects.get(pk=used.pk).driver_class == "Database"
    assert Transport.objects.get(pk=unused.pk).driver_class == "AWS"
    # Between the Database driver and a variant of it the work stays where both read it.
    with limited_transport():
        Transport.objects.filter(pk=used.pk).update(driver_class=LIMITED)
        assert Transport.objects.get(pk=used.pk).driver_class == LIMITED


# -- Tasks API topics stay closed to external publishers ---------------------------------------


def test_a_topic_read_by_the_tasks_handler_cannot_be_opened_to_external_publishers():
    """A Tasks API message names the task to import and run, with its arguments. A task topic
    opened to external publishing (or a task subscription put on an open topic) let any holder
    of a publish key for it run any task of the project with any arguments."""
    tasks_topic = TopicFactory(name="tasks.default")
    SubscriptionFactory(topic=tasks_topic, handler_key="workqueue.tasks")
    tasks_topic.allow_external_publish = True

    with pytest.raises(ValidationError, match="any task with any arguments") as opened:
        tasks_topic.save()
    assert "allow_external_publish" in opened.value.message_dict
    open_topic = TopicFactory(name="webhooks", allow_external_publish=True)
    with pytest.raises(ValidationError, match="any task with any arguments") as subscribed:
        SubscriptionFactory(topic=open_topic, handler_key="workqueue.tasks")
    assert "handler_key" in subscribed.value.message_dict
    assert not Topic.objects.get(pk=tasks_topic.pk).allow_external_publish


TASK_SHAPED = {"task": "tests.task_functions.user_exists", "args": ["x"], "kwargs": {}}


@pytest.mark.usefixtures("queue_db")
@pytest.mark.parametrize("waiting", ["Pending", "DeadLettered"])
def test_work_an_api_key_published_never_becomes_tasks(waiting):
    """Audit helper-137: a key published a task-shaped payload while the topic was open; the
    operator closed the topic (as EXTERNAL_TASKS_PROBLEM advises) and gave the subscription
    the Tasks API's handler, and the key holder's message ran as a task of the project, with
    its arguments, as the system user. Work a key published, still waiting, refuses it."""
    topic = TopicFactory(name="jobs", allow_external_publish=True)
    subscription = SubscriptionFactory(topic=topic, name="jobs.worker", handler_key="tests.noop")
    [published] = publish_many(topic.name, [{"payload": TASK_SHAPED}], external=True)
    waits = str(Delivery.objects.get(message_id=published.message_id).pk)
    if waiting == "DeadLettered":
        receiver = Receiver(subscription.id)
        [claimed] = receiver.receive(1).deliveries
        assert receiver.dead_letter(claimed, "Poison", "ValueError: boom").settled
    topic.allow_external_publish = False
    topic.save()
    subscription.handler_key = "workqueue.tasks"

    with pytest.raises(ValidationError, match="would import and run") as refused:
        subscription.save()

    assert "handler_key" in refused.value.message_dict
    assert Subscription.objects.get(pk=subscription.pk).handler_key == "tests.noop"
    # Once that work is gone, the switch is allowed.
    operations.discard(subscription.name, waits, reason="not a task")
    subscription.save()


@pytest.mark.usefixtures("queue_db")
def test_a_task_queue_whose_key_was_mistyped_is_corrected_with_its_tasks_waiting():
    """Review helper-138: refused for any waiting work, a mistyped handler key on a busy task
    queue could be corrected only by discarding its tasks. The application's own work may
    switch."""
    topic = TopicFactory(name="tasks.reports")
    subscription = SubscriptionFactory(topic=topic, handler_key="workqueue.task")  # mistyped
    pending(subscription, TASK_SHAPED)
    subscription.handler_key = "workqueue.tasks"

    subscription.save()

    assert Subscription.objects.get(pk=subscription.pk).handler_key == "workqueue.tasks"


def test_validate_bindings_reports_a_task_subscription_on_an_open_topic_as_an_error():
    open_topic = TopicFactory(name="webhooks")
    runs_tasks = SubscriptionFactory(topic=open_topic, handler_key="workqueue.tasks")
    with transaction.atomic(), connection.cursor() as cursor:
        # As a release before the rule could have left it.
        cursor.execute(
            "UPDATE workqueue_topic SET allow_external_publish = true WHERE id = %s",
            [open_topic.pk],
        )

    issues = operations.validate_bindings()

    assert any(
        issue.severity == "Error"
        and issue.subject == f"subscription {runs_tasks.name}"
        and "any task with any arguments" in issue.message
        for issue in issues
    ), issues


def test_a_handler_key_is_stored_as_hosts_read_it():
    """The handler registry strips keys, so a host runs ``" workqueue.tasks"`` as the Tasks
    API's handler; the Tasks API's results, signals and purges looked it up by the exact key
    and missed that subscription."""
    topic = TopicFactory()
    saved = SubscriptionFactory(topic=topic, handler_key=" workqueue.tasks\n")
    other = SubscriptionFactory(topic=topic)
    Subscription.objects.filter(pk=other.pk).update(handler_key="  orders.handler ")
    bulk = SubscriptionFactory(topic=topic)
    bulk.handler_key = "  tests.noop  "
    Subscription.objects.bulk_update([bulk], ["handler_key"])

    assert Subscription.objects.get(pk=saved.pk).handler_key == "workqueue.tasks"
    assert Subscription.objects.get(pk=other.pk).handler_key == "orders.handler"
    assert Subscription.objects.get(pk=bulk.pk).handler_key == "tests.noop"
