"""The suite's own reset after a transactional test (tests.support.reset) leaves what Django's
flush leaves: every table the flush empties is empty, the content types and permissions are
the ones migrate made, and a test that changed those gets the flush itself."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group, Permission
from django.contrib.contenttypes.models import ContentType
from django.db import connection

from tests.factories import ApiKeyFactory, SubscriptionFactory, UserFactory
from tests.support import reset
from workqueue import publish, publish_many

pytestmark = pytest.mark.usefixtures("queue_db")


def row_counts() -> dict[str, int]:
    counts = {}
    with connection.cursor() as cursor:
        for table in connection.introspection.django_table_names(
            only_existing=True, include_views=False
        ):
            cursor.execute(f"SELECT count(*) FROM {connection.ops.quote_name(table)}")
            counts[table] = cursor.fetchone()[0]
    return counts


def kept_rows() -> tuple[list[tuple], list[tuple]]:
    return (
        list(ContentType.objects.order_by("pk").values_list("pk", "app_label", "model")),
        list(
            Permission.objects.order_by("pk").values_list("pk", "content_type", "codename", "name")
        ),
    )


def fill_the_queue_and_auth_tables() -> None:
    subscription = SubscriptionFactory()
    user = UserFactory(perms=["workqueue.view_subscription"])
    Group.objects.create(name="operators").permissions.add(Permission.objects.first())
    user.groups.add(Group.objects.get(name="operators"))
    ApiKeyFactory(owner=user)
    for n in range(3):
        publish(subscription.topic.name, {"n": n}, deduplication_key=f"key-{n}", partition_key="k")


def test_the_reset_empties_every_table_the_flush_empties_and_keeps_migrates_rows() -> None:
    # The flush after an earlier test (or the first reset of this worker) records what migrate
    # made; the cheap reset works only against that record.
    reset._remember_flushed("default")
    before_kept = kept_rows()
    fill_the_queue_and_auth_tables()
    # Including the guarded ones: a subscription with deliveries, a topic with messages.
    filled = {table for table, count in row_counts().items() if count}
    assert {
        "workqueue_topic",
        "workqueue_subscription",
        "workqueue_message",
        "workqueue_delivery",
        "workqueue_deduplication",
        "workqueue_apikey",
        "auth_user",
        "auth_group_permissions",
        "auth_user_groups",
        "auth_user_user_permissions",
    } <= filled

    assert reset.reset_tables("default") is True

    left = {table: count for table, count in row_counts().items() if count}
    assert set(left) == set(reset.KEPT_TABLES)
    assert kept_rows() == before_kept


def test_the_reset_does_not_depend_on_the_order_of_its_tables(monkeypatch) -> None:
    # Topics before messages, subscriptions before deliveries: the queue's delete guards would
    # refuse those deletes, and Django gives the tables in a different order in each process.
    tables = reset._tables("default")
    monkeypatch.setattr(reset, "_tables", lambda alias: list(reversed(tables)))
    reset._remember_flushed("default")
    fill_the_queue_and_auth_tables()

    assert reset.reset_tables("default") is True

    assert {table for table, count in row_counts().items() if count} == set(reset.KEPT_TABLES)


def create_a_permission() -> None:
    Permission.objects.create(
        codename="made_by_a_test",
        name="Made by a test",
        content_type=ContentType.objects.get_for_model(Group),
    )


def rename_a_permission() -> None:
    Permission.objects.filter(codename="view_topic").update(name="Renamed by a test")


@pytest.mark.parametrize("change", [create_a_permission, rename_a_permission])
def test_a_test_that_changed_the_permissions_is_reset_by_djangos_flush(change) -> None:
    reset._remember_flushed("default")
    before = kept_rows()
    change()
    UserFactory()

    assert reset.reset_tables("default") is False

    # Untouched: the flush after this test makes migrate's permissions again.
    assert kept_rows() != before


def test_a_table_filled_past_a_page_is_truncated_and_the_rest_deleted_from() -> None:
    reset._remember_flushed("default")
    subscription = SubscriptionFactory()
    publish_many(
        subscription.topic.name, [{"payload": {"n": n, "text": "x" * 200}} for n in range(100)]
    )

    assert reset.reset_tables("default") is True

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_relation_size('workqueue_message'), pg_relation_size('workqueue_topic')"
        )
        message_bytes, topic_bytes = cursor.fetchone()
    assert message_bytes == 0  # a new, empty file: no dead rows for the next test to read
    assert topic_bytes == 8192  # its one page stays, holding the deleted row


def index_sizes(table: str) -> list[int]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_relation_size(indexrelid) FROM pg_index WHERE indrelid = %s::regclass",
            [table],
        )
        return [size for (size,) in cursor.fetchall()]


def test_a_table_whose_indexes_grew_is_truncated_even_once_a_vacuum_emptied_its_heap() -> None:
    reset._remember_flushed("default")
    subscription = SubscriptionFactory()
    publish_many(subscription.topic.name, [{"payload": {"n": n}} for n in range(300)])
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM workqueue_delivery")
        cursor.execute("VACUUM workqueue_delivery")  # gives the empty heap back, not the index
        cursor.execute("SELECT pg_relation_size('workqueue_delivery')")
        assert cursor.fetchone() == (0,)
    assert max(index_sizes("workqueue_delivery")) > 2 * 8192

    assert reset.reset_tables("default") is True

    assert max(index_sizes("workqueue_delivery")) == 8192  # each index as a new one is
