from __future__ import annotations

from typing import Any

import factory
from django.db import connection, transaction

from workqueue.models import Subscription, Topic, Transport


class TransportFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Transport
        django_get_or_create = ("name",)

    name = "Database"
    driver_class = "Database"


class TopicFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Topic

    name = factory.Sequence(lambda n: f"test.topic-{n}")
    transport = factory.SubFactory(TransportFactory)


class SubscriptionFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Subscription

    name = factory.Sequence(lambda n: f"test.sub-{n}")
    topic = factory.SubFactory(TopicFactory)
    handler_key = "tests.noop"


FILTER_GUARD = "wq_sub_filter_valid"


def write_unchecked(subscription: Subscription, **columns: Any) -> None:
    """Write ``columns`` of ``subscription``'s row with raw SQL, past the model's validation and
    the database's filter guard, as a script (or a version of this app from before the guards)
    could. The guard is dropped and added back in the same transaction, so it is never
    missing for anything else; rows already in the table are not re-checked by it (NOT VALID).
    """
    fields = {name: Subscription._meta.get_field(name) for name in columns}
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = %s",
            [FILTER_GUARD],
        )
        guard = cursor.fetchone()
        if guard:
            cursor.execute(f"ALTER TABLE workqueue_subscription DROP CONSTRAINT {FILTER_GUARD}")
        assignments = ", ".join(f"{fields[name].column} = %s" for name in columns)
        cursor.execute(
            f"UPDATE workqueue_subscription SET {assignments} WHERE id = %s",
            [
                *(
                    fields[name].get_db_prep_save(value, connection)
                    for name, value in columns.items()
                ),
                subscription.pk,
            ],
        )
        if guard:
            cursor.execute(
                f"ALTER TABLE workqueue_subscription ADD CONSTRAINT {FILTER_GUARD} {guard[0]}"
            )
