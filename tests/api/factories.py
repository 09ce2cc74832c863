"""Users with permissions and API keys for the REST API tests."""

from __future__ import annotations

from typing import Any

import factory
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission

from workqueue.models import ApiKey
from workqueue.operators.permissions import (
    OPERATE_PERMISSION,
    PAYLOAD_PERMISSION,
    PUBLISH_PERMISSION,
    READ_PERMISSION,
)

ALL_PERMISSIONS = (READ_PERMISSION, OPERATE_PERMISSION, PAYLOAD_PERMISSION, PUBLISH_PERMISSION)


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
