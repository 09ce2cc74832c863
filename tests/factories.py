"""factory-boy factories: topology rows (transport, topic, subscription), users with Django
permissions and API keys issued the way ``apikey create`` does; and a raw writer that goes past
the subscription's validation, as an old script could."""

from __future__ import annotations

from typing import Any

import factory
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.db import connection, transaction

from workqueue.models import ApiKey, Subscription, Topic, Transport
from workqueue.operators.permissions import (
    OPERATE_PERMISSION,
    PAYLOAD_PERMISSION,
    PUBLISH_PERMISSION,
    READ_PERMISSION,
)

ALL_PERMISSIONS = (READ_PERMISSION, OPERATE_PERMISSION, PAYLOAD_PERMISSION, PUBLISH_PERMISSION)


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


def _permission(dotted: str) -> Permission:
    app_label, codename = dotted.split(".")
    return Permission.objects.get(content_type__app_label=app_label, codename=codename)


class UserFactory(factory.django.DjangoModelFactory):
    """A user; ``perms=[...]`` grants Django permissions by dotted name."""

    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)
        skip_postgeneration_save = True

    username = factory.Sequence(lambda n: f"api-user-{n}")
    # No usable password: tests sign in with force_login, and hashing one costs ~0.5 s a user.
    password = factory.django.Password(None)

    @factory.post_generation
    def perms(self, create: bool, extracted: Any, **kwargs: Any) -> None:
        if create and extracted:
            self.user_permissions.add(*(_permission(p) for p in extracted))


class ApiKeyFactory(factory.django.DjangoModelFactory):
    """A key issued the way ``apikey create`` does; the raw key is on ``.raw_key``."""

    class Meta:
        model = ApiKey

    owner = factory.SubFactory(UserFactory, perms=ALL_PERMISSIONS)
    scopes = factory.List(["workqueue:publish"])
    topics = factory.List([])
    subscriptions = factory.List([])

    @classmethod
    def _create(cls, model_class: type[ApiKey], *args: Any, **kwargs: Any) -> ApiKey:
        key, raw_key = model_class.objects.issue(
            kwargs.pop("owner"),
            list(kwargs.pop("scopes")),
            topics=list(kwargs.pop("topics")),
            subscriptions=list(kwargs.pop("subscriptions")),
            **kwargs,
        )
        key.raw_key = raw_key
        return key


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
