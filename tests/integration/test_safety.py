"""Safety rails: transaction boundaries of publishing and settling, the read-only guard on the
driver-owned tables, partition-mode immutability, subscription status and attribute filters at
fan-out."""

from __future__ import annotations

import datetime as dt
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.apps import apps
from django.core import serializers
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.db import IntegrityError, connections, models, transaction
from django.db.models import ProtectedError
from django.utils import timezone

from tests.factories import SubscriptionFactory, TopicFactory
from tests.support.database import lock_waits, psycopg_params
from tests.support.waiting import wait_until
from workqueue import publish, publish_many
from workqueue.exceptions import DriverOwnedWriteError
from workqueue.models import (
    Deduplication,
    Delivery,
    Message,
    RateLimitBucket,
    Subscription,
    SweepLock,
    Topic,
)
from workqueue.models.readonly import DriverOwnedModel
from workqueue.transport import Receiver

# Most tests need committed data (the driver works on its own connection); the read-only guard
# tests publish enlisted in the test's own transaction instead, which rolls back cheaply.
queue_db = pytest.mark.usefixtures("queue_db")


class Rollback(Exception):
    """Raised to leave a ``transaction.atomic()`` block by rolling it back."""


def _visible_elsewhere(pg_conn, topic) -> tuple[int, int]:
    """(messages, deliveries) of ``topic`` as another connection sees them (committed data)."""
    messages = pg_conn.execute(
        "SELECT count(*) FROM workqueue_message WHERE topic_id = %s", (topic.id,)
    ).fetchone()[0]
    deliveries = pg_conn.execute(
        "SELECT count(*) FROM workqueue_delivery d JOIN workqueue_message m "
        "ON m.id = d.message_id WHERE m.topic_id = %s",
        (topic.id,),
    ).fetchone()[0]
    return messages, deliveries


# -- transaction boundaries ------------------------------------------------------------------


@queue_db
def test_an_enlisted_publish_rolls_back_with_the_callers_transaction(pg_conn):
    topic = TopicFactory()
    SubscriptionFactory(topic=topic)
    message_id = str(uuid.uuid4())

    with pytest.raises(Rollback), transaction.atomic():
        result = publish(
            topic.name, {"n": 1}, message_id=message_id, deduplication_key="dk", enlist=True
        )
        assert result.status == "Accepted"
        # Inside the block the caller's own connection sees the write; nobody else does yet.
        assert Message.objects.filter(pk=message_id).exists()
        assert Delivery.objects.filter(message_id=message_id).count() == 1
        assert _visible_elsewhere(pg_conn, topic) == (0, 0)
        raise Rollback

    assert _visible_elsewhere(pg_conn, topic) == (0, 0)
    assert not Message.objects.filter(topic=topic).exists()
    assert not Deduplication.objects.filter(topic=topic).exists()
    # The rolled-back reservation left nothing behind: the same key and id publish afresh.
    again = publish(topic.name, {"n": 1}, message_id=message_id, deduplication_key="dk")
    assert (again.status, again.message_id) == ("Accepted", message_id)


@queue_db
def test_an_enlisted_publish_commits_with_the_callers_transaction(pg_conn):
    topic = TopicFactory()
    SubscriptionFactory(topic=topic)

    with transaction.atomic():
        result = publish(topic.name, {"n": 1}, enlist=True)
        assert _visible_elsewhere(pg_conn, topic) == (0, 0)

    assert result.status == "Accepted"
    assert _visible_elsewhere(pg_conn, topic) == (1, 1)
    assert Delivery.objects.get(message_id=result.message_id).status == "Pending"


@queue_db
def test_a_publish_that_is_not_enlisted_commits_even_when_the_callers_transaction_rolls_back(
    pg_conn,
):
    topic = TopicFactory()
    sub = SubscriptionFactory(topic=topic)

    with pytest.raises(Rollback), transaction.atomic():
        result = publish(topic.name, {"n": 1}, deduplication_key="dk")
        assert result.status == "Accepted"
        # Already committed on the queue's own connection, before the block ends.
        assert _visible_elsewhere(pg_conn, topic) == (1, 1)
        raise Rollback

    assert _visible_elsewhere(pg_conn, topic) == (1, 1)
    (claimed,) = Receiver(sub.id).receive(5).deliveries
    assert claimed.message_id == result.message_id
    assert publish(topic.name, {"n": 2}, deduplication_key="dk").status == "Duplicate"


@queue_db
def test_claims_and_settlements_do_not_ride_the_callers_transaction():
    sub = SubscriptionFactory()
    first = publish(sub.topic.name, {"n": 1})
    second = publish(sub.topic.name, {"n": 2})
    receiver = Receiver(sub.id, "holder")

    with pytest.raises(Rollback), transaction.atomic():
        claimed = receiver.receive(2).deliveries
        assert receiver.complete(claimed[0]).settled
        raise Rollback

    statuses = dict(Delivery.objects.filter(subscription=sub).values_list("message_id", "status"))
    done, held = claimed[0].message_id, claimed[1].message_id
    assert {done, held} == {first.message_id, second.message_id}
    assert statuses == {uuid.UUID(done): "Completed", uuid.UUID(held): "InFlight"}
    assert receiver.complete(claimed[1]).settled


# -- the read-only guard ----------------------------------------------------------------------


def _rows(topic) -> dict[str, Any]:
    message = Message.objects.get(topic=topic)
    return {
        "Message": message,
        "Delivery": Delivery.objects.get(message=message),
        "Deduplication": Deduplication.objects.get(topic=topic),
    }


def _new_row(model: type[models.Model], row: Any) -> models.Model:
    if model is Message:
        return Message(id=uuid.uuid4(), publish_ordinal=10**12, topic_id=row.topic_id)
    if model is Delivery:
        return Delivery(message_id=row.message_id, subscription_id=row.subscription_id, order_key=1)
    return Deduplication(
        topic_id=row.topic_id,
        deduplication_key="other",
        message_id=uuid.uuid4(),
        status="Confirmed",
        expires_at=timezone.now() + dt.timedelta(hours=1),
    )


_CHANGES = {
    Message: {"correlation_id": "changed"},
    Delivery: {"status": "Completed"},
    Deduplication: {"status": "Reserved"},
}

_WRITES: dict[str, Callable[[type[models.Model], Any], Any]] = {
    "instance.save": lambda model, row: row.save(),
    "instance.delete": lambda model, row: row.delete(),
    "queryset.update": lambda model, row: model.objects.filter(pk=row.pk).update(**_CHANGES[model]),
    "queryset.delete": lambda model, row: model.objects.filter(pk=row.pk).delete(),
    "manager.create": lambda model, row: model.objects.create(
        **{f.attname: getattr(_new_row(model, row), f.attname) for f in model._meta.concrete_fields}
    ),
    "manager.bulk_create": lambda model, row: model.objects.bulk_create([_new_row(model, row)]),
    "manager.bulk_update": lambda model, row: model.objects.bulk_update(
        [row], list(_CHANGES[model])
    ),
    "manager.update_or_create": lambda model, row: model.objects.update_or_create(
        pk=row.pk, defaults=_CHANGES[model]
    ),
    # What Django itself uses behind the public API: related lookups and Model.save() go
    # through the base manager, loaddata calls Model.save_base(raw=True) past any save(), the
    # deletion collector deletes through _raw_delete and Model.delete.
    "base_manager.update": lambda model, row: model._base_manager.filter(pk=row.pk).update(
        **_CHANGES[model]
    ),
    "base_manager.delete": lambda model, row: model._base_manager.filter(pk=row.pk).delete(),
    "base_manager.bulk_create": lambda model, row: model._base_manager.bulk_create(
        [_new_row(model, row)]
    ),
    "queryset._raw_delete": lambda model, row: model.objects.filter(pk=row.pk)._raw_delete(
        "default"
    ),
    "base_manager._raw_delete": lambda model, row: model._base_manager.filter(
        pk=row.pk
    )._raw_delete("default"),
    "Model.save_base(raw=True)": lambda model, row: models.Model.save_base(row, raw=True),
    "Model.save_base": lambda model, row: models.Model.save_base(row),
    "Model.save_base(new row)": lambda model, row: models.Model.save_base(_new_row(model, row)),
    "Model.delete": lambda model, row: models.Model.delete(row),
    "loaddata": lambda model, row: _loaddata(row),
}


#: Writes refused by something that comes first: the deletion collector stops at a message's
#: protected deliveries before it asks the guard (a message without any meets the guard).
_REFUSED_BY = {("Model.delete", Message): ProtectedError}


def _loaddata(row: models.Model) -> None:
    """``manage.py loaddata`` of a fixture holding ``row`` as it is now (changed)."""
    with tempfile.TemporaryDirectory() as folder:
        fixture = Path(folder) / "rows.json"
        fixture.write_text(serializers.serialize("json", [row]))
        call_command("loaddata", str(fixture), verbosity=0)


@pytest.mark.django_db
@pytest.mark.parametrize("model", [Message, Delivery, Deduplication], ids=lambda m: m.__name__)
@pytest.mark.parametrize("write", list(_WRITES))
def test_orm_writes_to_driver_owned_tables_are_refused_and_point_to_the_operator_api(model, write):
    topic = TopicFactory()
    SubscriptionFactory(topic=topic)
    publish(topic.name, {"n": 1}, correlation_id="original", deduplication_key="dk", enlist=True)
    row = _rows(topic)[model.__name__]
    before = list(model.objects.order_by("pk").values())
    for field, value in _CHANGES[model].items():
        setattr(row, field, value)

    refusal = _REFUSED_BY.get((write, model), DriverOwnedWriteError)
    # In a block of its own, as a caller's write would be: a refusal aborts only that block.
    with pytest.raises(refusal) as refused, transaction.atomic():
        _WRITES[write](model, row)

    text = str(refused.value)
    assert model.__name__ in text
    if refusal is DriverOwnedWriteError:
        assert "operator API" in text and "replay" in text and "discard" in text
        assert "workqueue.publish()" in text
    # Rows being loaded: a fixture, or serialized_rollback restoring the test database, which
    # was told only to publish and replay (helper-118).
    assert ("TEST_NON_SERIALIZED_APPS" in text) == (
        write in {"loaddata", "Model.save_base(raw=True)"}
    )
    assert list(model.objects.order_by("pk").values()) == before


@pytest.mark.django_db
def test_related_managers_of_driver_owned_tables_refuse_writes_too():
    topic = TopicFactory()
    sub = SubscriptionFactory(topic=topic)
    result = publish(topic.name, {"n": 1}, enlist=True)
    message = Message.objects.get(pk=result.message_id)

    with pytest.raises(DriverOwnedWriteError):
        message.deliveries.update(status="Completed")
    with pytest.raises(DriverOwnedWriteError):
        sub.deliveries.all().delete()
    with pytest.raises(DriverOwnedWriteError):
        topic.messages.create(id=uuid.uuid4(), publish_ordinal=10**12)
    assert Delivery.objects.get(message=message).status == "Pending"
    assert Message.objects.filter(topic=topic).count() == 1


@pytest.mark.django_db
def test_a_message_without_deliveries_is_still_refused_by_an_unbound_model_delete():
    topic = TopicFactory()  # no subscriptions: the message fans out to nobody
    message = Message.objects.get(pk=publish(topic.name, {"n": 1}, enlist=True).message_id)

    with pytest.raises(DriverOwnedWriteError), transaction.atomic():
        models.Model.delete(message)

    assert Message.objects.filter(pk=message.pk).exists()


def test_every_driver_owned_model_is_one_whose_writes_these_tests_try():
    owned = {
        m for m in apps.get_app_config("workqueue").get_models() if issubclass(m, DriverOwnedModel)
    }
    assert owned == {Message, Delivery, Deduplication, RateLimitBucket, SweepLock}


_COUNTER_WRITES = [
    "instance.save",
    "instance.delete",
    "queryset.delete",
    "Model.delete",
    "Model.save_base",
    "Model.save_base(raw=True)",
    "loaddata",
]


@pytest.mark.django_db
@pytest.mark.parametrize("model", [RateLimitBucket, SweepLock], ids=lambda m: m.__name__)
@pytest.mark.parametrize("write", _COUNTER_WRITES)
def test_the_procedures_own_counters_refuse_orm_writes_too(model, write):
    """Only the message, delivery and deduplication models were refused through the signals:
    an unbound Model.delete (Django's fast path, with no receiver to stop it) deleted a rate
    limit's bucket or the sweep lock's row (audit helper-106)."""
    if model is RateLimitBucket:
        with connections["default"].cursor() as cursor:
            cursor.execute(
                "INSERT INTO workqueue_rate_limit_bucket (subscription_id, tokens, refilled_at) "
                "VALUES (%s, 1, now())",
                [uuid.uuid4()],
            )
    row = model.objects.get()
    before = list(model.objects.values())
    with pytest.raises(DriverOwnedWriteError), transaction.atomic():
        _WRITES[write](model, row)

    assert list(model.objects.values()) == before


@pytest.mark.django_db
def test_topics_and_subscriptions_with_queue_rows_cannot_be_deleted():
    topic = TopicFactory()
    sub = SubscriptionFactory(topic=topic)
    publish(topic.name, {"n": 1}, enlist=True)
    bare_topic = TopicFactory()  # a message but no subscription, so no deliveries
    publish(bare_topic.name, {"n": 2}, enlist=True)
    deletes = {
        "subscription": lambda: sub.delete(),
        "subscription queryset": lambda: Subscription.objects.filter(pk=sub.pk).delete(),
        "topic": lambda: topic.delete(),
        "topic of messages alone": lambda: bare_topic.delete(),
        "topic queryset": lambda: Topic.objects.filter(pk=bare_topic.pk).delete(),
    }

    refused = {}
    for name, delete in deletes.items():
        with pytest.raises(ProtectedError) as caught, transaction.atomic():
            delete()
        refused[name] = sorted({type(row).__name__ for row in caught.value.protected_objects})

    assert refused == {
        "subscription": ["Delivery"],
        "subscription queryset": ["Delivery"],
        "topic": ["Message", "Subscription"],
        "topic of messages alone": ["Message"],
        "topic queryset": ["Message"],
    }
    # The database refuses it too, whatever bypasses the ORM.
    for table, pk in (("workqueue_subscription", sub.pk), ("workqueue_topic", bare_topic.pk)):
        with (
            pytest.raises(IntegrityError),
            transaction.atomic(),
            connections["default"].cursor() as cursor,
        ):
            cursor.execute(f"DELETE FROM {table} WHERE id = %s", [pk])
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
    assert Delivery.objects.filter(subscription=sub).count() == 1
    assert Message.objects.filter(topic__in=[topic, bare_topic]).count() == 2


@queue_db
@pytest.mark.parametrize("table", ["workqueue_subscription", "workqueue_topic"])
def test_a_delete_racing_a_publish_waits_for_it_and_is_refused(table):
    # The queue tables hold no foreign keys to topics and subscriptions (migration 0025); the
    # delete guards take the topic's topology lock first. A subscription (or a bare topic)
    # without rows yet is deleted while a publish to it is fanning out and not yet committed:
    # the delete must wait for the publish and then refuse, and the publish must survive.
    # (With the foreign keys the delete went through and the publish failed at its commit.)
    sub = SubscriptionFactory()
    topic = TopicFactory()
    target = sub if table == "workqueue_subscription" else topic
    topic_name = sub.topic.name if target is sub else topic.name
    fanned_out, delete_sent = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def publish_and_hold() -> None:
        try:
            with transaction.atomic():
                outcome["publish"] = publish(topic_name, {"n": 1}, enlist=True)
                fanned_out.set()
                delete_sent.wait(10)
                time.sleep(0.3)  # the delete is now waiting on the topology lock, if anywhere
        finally:
            connections.close_all()

    publisher = threading.Thread(target=publish_and_hold)
    publisher.start()
    assert fanned_out.wait(10)
    with psycopg.connect(**psycopg_params(), autocommit=True) as deleter:
        delete_sent.set()
        with pytest.raises(psycopg.errors.ForeignKeyViolation, match="cannot be deleted"):
            deleter.execute(f"DELETE FROM {table} WHERE id = %s", [target.pk])
    publisher.join(10)

    assert outcome["publish"].accepted
    assert type(target).objects.filter(pk=target.pk).exists()
    assert Message.objects.filter(pk=outcome["publish"].message_id).exists()
    if target is sub:
        assert Delivery.objects.filter(subscription=sub).count() == 1


# -- partition mode ---------------------------------------------------------------------------


@queue_db
def test_the_partition_mode_cannot_change_once_the_subscription_has_deliveries():
    sub = SubscriptionFactory(partition_mode="None")
    publish(sub.topic.name, {"n": 1}, partition_key="p")
    # Even settled deliveries fix the mode: they were written under it.
    receiver = Receiver(sub.id)
    (claimed,) = receiver.receive(1).deliveries
    assert receiver.complete(claimed).settled

    sub = Subscription.objects.get(pk=sub.pk)
    sub.partition_mode = "Ordered"
    with pytest.raises(ValidationError) as on_save:
        sub.save()
    assert "partition_mode" in on_save.value.message_dict
    assert "None" in on_save.value.message_dict["partition_mode"][0]
    with pytest.raises(ValidationError) as on_clean:
        sub.full_clean()
    assert list(on_clean.value.message_dict) == ["partition_mode"]
    assert Subscription.objects.get(pk=sub.pk).partition_mode == "None"

    # Other fields of the same subscription still save.
    sub = Subscription.objects.get(pk=sub.pk)
    sub.max_attempts = 9
    sub.full_clean()
    sub.save()
    assert Subscription.objects.get(pk=sub.pk).max_attempts == 9


@queue_db
def test_the_partition_mode_can_change_while_the_subscription_has_no_deliveries():
    sub = SubscriptionFactory(partition_mode="None")
    sub.partition_mode = "Exclusive"
    sub.full_clean()
    sub.save()

    assert Subscription.objects.get(pk=sub.pk).partition_mode == "Exclusive"
    publish(sub.topic.name, {"n": 1}, partition_key="p")
    # The new mode is the one fan-out uses: the delivery carries the key.
    assert Delivery.objects.get(subscription=sub).partition_key == "p"


@queue_db
def test_the_partition_mode_cannot_change_under_a_publish_that_is_still_fanning_out():
    topic = TopicFactory()
    sub = SubscriptionFactory(topic=topic, partition_mode="Ordered")
    published = threading.Event()
    may_commit = threading.Event()
    outcome: list[Any] = []

    def publisher() -> None:
        try:
            with transaction.atomic():
                outcome.append(publish(topic.name, {"n": 1}, partition_key="p", enlist=True))
                published.set()
                may_commit.wait(5)  # committed after the mode change, or after 5 s
        finally:
            connections.close_all()

    thread = threading.Thread(target=publisher, daemon=True)
    thread.start()
    assert published.wait(10)
    sub.partition_mode = "None"
    # The publish commits half a second later, while the save waits for its topology lock.
    threading.Timer(0.5, may_commit.set).start()
    try:
        with pytest.raises(ValidationError, match="cannot change"):
            sub.save()
    finally:
        may_commit.set()
        thread.join(10)

    assert outcome[0].status == "Accepted"
    stored = Subscription.objects.get(pk=sub.pk).partition_mode
    keyed = Delivery.objects.filter(subscription=sub, partition_key__isnull=False).count()
    assert (stored, keyed) == ("Ordered", 1), "the mode changed under a committed delivery"
    assert [d.message_id for d in Receiver(sub.id).receive(5).deliveries] == [outcome[0].message_id]


class _OpenTransaction(threading.Thread):
    """Runs ``work`` in a transaction of its own thread, then keeps the transaction open until
    ``release`` is set, and commits it (or rolls it back)."""

    def __init__(self, work: Callable[[], Any], *, roll_back: bool = False) -> None:
        super().__init__(daemon=True)
        self.work = work
        self.roll_back = roll_back
        self.worked = threading.Event()
        self.release = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with transaction.atomic():
                self.work()
                self.worked.set()
                self.release.wait(10)
                if self.roll_back:
                    transaction.set_rollback(True)
        except BaseException as exc:  # surfaced by the test
            self.error = exc
        finally:
            self.worked.set()
            connections.close_all()


def _a_later_publish_of_the_key_is_claimed_after(
    open_publish: _OpenTransaction, topic: Any, subscription_id: Any
) -> list[int]:
    """Publish key "k" again while ``open_publish`` is still open, claim the Ordered
    subscription while it is, commit it, then claim the rest one at a time: the publish
    ordinals of the key's deliveries in the order they were claimed."""
    later = threading.Thread(
        target=lambda: (publish(topic.name, {"n": 3}, partition_key="k"), connections.close_all()),
        daemon=True,
    )
    later.start()
    later.join(0.5)  # it should wait for the open publish's lock on the key
    receiver = Receiver(subscription_id)
    claimed = receiver.receive(1).deliveries  # while the first publish is still open
    open_publish.release.set()
    open_publish.join(10)
    later.join(10)
    assert open_publish.error is None, open_publish.error
    order = []
    claimed = claimed or receiver.receive(1).deliveries
    while claimed:
        (delivery,) = claimed
        order.append(delivery.message_id)
        assert receiver.complete(delivery).settled
        claimed = receiver.receive(1).deliveries
    return [Message.objects.get(pk=m).publish_ordinal for m in order]


@queue_db
def test_a_batch_that_waited_for_a_change_to_ordered_locks_its_keys_before_it_fans_out():
    """``wq_publish_many`` looked for Ordered subscriptions before it took the topology lock.
    A change to Ordered that committed while the batch waited for that lock got the batch's
    delivery with its key never locked; a later publish of the key then committed its ordinal
    first, was claimed first, and the key ran out of publish order."""
    topic = TopicFactory()
    sub = SubscriptionFactory(topic=topic, partition_mode="None")

    def make_it_ordered() -> None:
        sub.partition_mode = "Ordered"
        sub.save()  # holds the topic's topology lock exclusive until this transaction ends

    change = _OpenTransaction(make_it_ordered)
    change.start()
    assert change.worked.wait(10) and change.error is None
    batch = _OpenTransaction(
        # Two messages: a batch of one is published by wq_publish.
        lambda: publish_many(
            topic,
            [{"payload": {"n": n}, "partition_key": "k"} for n in (1, 2)],
            enlist=True,
        )
    )
    batch.start()
    wait_until(lambda: lock_waits() == 1, timeout=10)  # the batch waits for the change
    change.release.set()
    change.join(10)
    assert batch.worked.wait(10)

    ordinals = _a_later_publish_of_the_key_is_claimed_after(batch, topic, sub.id)

    assert len(ordinals) == 3
    assert ordinals == sorted(ordinals), "the later publish of the key was claimed first"


@queue_db
def test_an_ordered_subscription_made_during_a_keyed_publish_waits_for_it():
    """A new Ordered subscription (or one enabled, refiltered or moved) committed between a
    publish's check for Ordered subscriptions and its fan-out got that publish's delivery with
    its key never locked; a later publish of the key committed its ordinal first and was
    claimed first. Now such a write takes the topology lock, waiting for publishes in
    progress. The publish is held between its check and its fan-out by another, uncommitted
    publish of the same message id."""
    topic = TopicFactory()
    message_id = uuid.uuid4()
    holder = _OpenTransaction(
        lambda: publish(topic.name, {"n": 0}, message_id=message_id, enlist=True), roll_back=True
    )
    holder.start()
    assert holder.worked.wait(10) and holder.error is None
    first = _OpenTransaction(
        lambda: publish(topic.name, {"n": 1}, message_id=message_id, partition_key="k", enlist=True)
    )
    first.start()
    wait_until(lambda: lock_waits() == 1, timeout=10)  # past its check, at its message insert
    ordered = SubscriptionFactory.build(topic=topic, partition_mode="Ordered")
    creating = threading.Thread(
        target=lambda: (ordered.save(), connections.close_all()), daemon=True
    )
    creating.start()
    # Saved at once (as it was), or waiting for the topology lock the publish holds (as now).
    wait_until(lambda: not creating.is_alive() or lock_waits() == 2, timeout=10)
    holder.release.set()  # rolled back: the first publish goes on, to its fan-out
    holder.join(10)
    assert first.worked.wait(10)

    ordinals = _a_later_publish_of_the_key_is_claimed_after(first, topic, ordered.id)
    creating.join(10)

    assert Subscription.objects.filter(pk=ordered.pk).exists()
    assert ordinals and ordinals == sorted(ordinals), (
        "the later publish of the key was claimed first"
    )


def _keyed_publish_left_open(topic: Any) -> _OpenTransaction:
    """A publish of key "k" to ``topic``, fanned out and not yet committed (release it)."""
    open_publish = _OpenTransaction(
        lambda: publish(topic.name, {"n": 1}, partition_key="k", enlist=True)
    )
    open_publish.start()
    assert open_publish.worked.wait(10) and open_publish.error is None
    return open_publish


@queue_db
def test_a_move_that_changes_the_mode_waits_for_a_publish_to_the_old_topic():
    """Moving a subscription locked only the topic it moved to: a publish still fanning out
    on the old topic went unseen, so an Exclusive subscription moved and made None while a
    keyed delivery was being written to it, and a None subscription never claims a keyed
    delivery: it stayed Pending for ever."""
    old_topic, new_topic = TopicFactory(), TopicFactory()
    sub = SubscriptionFactory(topic=old_topic, partition_mode="Exclusive")
    first = _keyed_publish_left_open(old_topic)
    refused: list[BaseException] = []

    def move_and_change_mode() -> None:
        try:
            moved = Subscription.objects.get(pk=sub.pk)
            moved.topic, moved.partition_mode = new_topic, "None"
            moved.save()
        except ValidationError as exc:
            refused.append(exc)
        finally:
            connections.close_all()

    mover = threading.Thread(target=move_and_change_mode, daemon=True)
    mover.start()
    # Saved at once (as it was), or waiting for the old topic's topology lock (as now).
    wait_until(lambda: not mover.is_alive() or lock_waits() == 1, timeout=10)
    first.release.set()
    first.join(10)
    mover.join(10)

    assert first.error is None, first.error
    assert refused and "cannot change" in str(refused[0])
    stored = Subscription.objects.get(pk=sub.pk)
    assert (stored.topic_id, stored.partition_mode) == (old_topic.id, "Exclusive")
    assert len(Receiver(sub.id).receive(10).deliveries) == 1


@queue_db
def test_an_ordered_subscription_moved_mid_publish_runs_its_key_in_publish_order():
    """A publish to the old topic, fanned out to the Ordered subscription and still open, went
    unseen by the move; a publish of the same key to the new topic then took its ordinal under
    the new topic's lock, committed first and was claimed first: the key ran [2, 1]."""
    old_topic, new_topic = TopicFactory(), TopicFactory()
    sub = SubscriptionFactory(topic=old_topic, partition_mode="Ordered")
    first = _keyed_publish_left_open(old_topic)
    mover = threading.Thread(
        target=lambda: (
            Subscription.objects.filter(pk=sub.pk).update(topic=new_topic),
            connections.close_all(),
        ),
        daemon=True,
    )
    mover.start()
    wait_until(lambda: not mover.is_alive() or lock_waits() == 1, timeout=10)
    if not mover.is_alive():  # moved at once: the new topic's publish goes ahead of the old
        publish(new_topic.name, {"n": 2}, partition_key="k")
    receiver = Receiver(sub.id)
    claimed = receiver.receive(1).deliveries  # while the first publish is still open
    first.release.set()
    first.join(10)
    mover.join(10)
    assert first.error is None, first.error
    if not claimed:
        publish(new_topic.name, {"n": 2}, partition_key="k")
    order = []
    claimed = claimed or receiver.receive(1).deliveries
    while claimed:
        (delivery,) = claimed
        order.append(Message.objects.get(pk=delivery.message_id).publish_ordinal)
        assert receiver.complete(delivery).settled
        claimed = receiver.receive(1).deliveries

    assert len(order) == 2
    assert order == sorted(order), f"key 'k' ran out of publish order: {order}"


# -- subscription status and fan-out ----------------------------------------------------------


@queue_db
def test_a_paused_subscription_accumulates_deliveries_that_cannot_be_claimed_until_resumed():
    topic = TopicFactory()
    paused = SubscriptionFactory(topic=topic, status="Paused")
    result = publish(topic.name, {"n": 1})

    assert list(Delivery.objects.filter(subscription=paused).values_list("status", flat=True)) == [
        "Pending"
    ]
    assert Receiver(paused.id).receive(10).deliveries == []
    assert Delivery.objects.get(subscription=paused).attempt_count == 0

    paused.status = "Active"
    paused.save()
    (claimed,) = Receiver(paused.id).receive(10).deliveries
    assert claimed.message_id == result.message_id


@queue_db
@pytest.mark.parametrize("disabled", ["topic", "transport"])
def test_a_disabled_topic_or_transport_stops_claims_at_once_and_leaves_its_work_waiting(disabled):
    """Audit helper-89: the claim read the subscription's status alone, so a topic or transport
    Disabled as an emergency brake went on feeding its handlers until each host's next
    re-plan (up to 30 s), health saying Running meanwhile."""
    subscription = SubscriptionFactory()
    topic = subscription.topic
    receiver = Receiver(subscription.id)
    publish(topic.name, {"n": 1})
    owner = topic if disabled == "topic" else topic.transport
    owner.status = "Disabled"
    owner.save()

    assert receiver.receive(10).deliveries == []
    assert Delivery.objects.get(subscription=subscription).status == "Pending"

    owner.status = "Active"
    owner.save()
    assert len(receiver.receive(10).deliveries) == 1


@queue_db
def test_a_disabled_subscription_gets_no_deliveries_even_after_it_is_enabled():
    topic = TopicFactory()
    active = SubscriptionFactory(topic=topic)
    disabled = SubscriptionFactory(topic=topic, status="Disabled")
    publish(topic.name, {"n": 1})

    assert Delivery.objects.filter(subscription=active).count() == 1
    assert not Delivery.objects.filter(subscription=disabled).exists()
    disabled.status = "Active"
    disabled.save()
    assert Receiver(disabled.id).receive(10).deliveries == []


@queue_db
def test_a_subscription_created_after_a_publish_gets_no_backfill():
    topic = TopicFactory()
    SubscriptionFactory(topic=topic)
    earlier = publish(topic.name, {"n": 1})
    late = SubscriptionFactory(topic=topic)

    assert not Delivery.objects.filter(subscription=late).exists()
    assert Receiver(late.id).receive(10).deliveries == []
    later = publish(topic.name, {"n": 2})
    assert [d.message_id for d in Receiver(late.id).receive(10).deliveries] == [later.message_id]
    assert earlier.message_id != later.message_id


def _subscription_with_filter(topic, value: str | None) -> Subscription:
    spec = (
        {"logic": "and", "filters": [{"field": "kind", "operator": "eq", "value": value}]}
        if value
        else None
    )
    sub = SubscriptionFactory.build(topic=topic, filter=spec)
    sub.full_clean()
    sub.save()
    return sub


@queue_db
def test_fan_out_creates_deliveries_only_for_subscriptions_whose_filter_matches():
    topic = TopicFactory()
    clicks = _subscription_with_filter(topic, "click")
    views = _subscription_with_filter(topic, "view")
    everything = _subscription_with_filter(topic, None)

    published = {
        name: publish(topic.name, {"n": name}, attributes=attributes).message_id
        for name, attributes in [
            ("click", {"kind": "click"}),
            ("click-with-extra", {"kind": "click", "region": "eu"}),
            ("Click", {"kind": "Click"}),  # values compare case-sensitively
            ("view", {"kind": "view"}),
            ("no-kind", {"region": "eu"}),
            ("no-attributes", None),
        ]
    }

    def received(sub: Subscription) -> set[str]:
        message_ids = {d.message_id for d in Receiver(sub.id).receive(20).deliveries}
        fanned_out = {
            str(m)
            for m in Delivery.objects.filter(subscription=sub).values_list("message_id", flat=True)
        }
        assert message_ids == fanned_out
        return {name for name, message_id in published.items() if message_id in message_ids}

    assert received(clicks) == {"click", "click-with-extra"}
    assert received(views) == {"view"}
    assert received(everything) == set(published)
