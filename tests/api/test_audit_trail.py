"""Who did what through which door (issue 10, item 13): an operation through the REST API is
recorded with the API key as well as its owner, in the delivery's operator history
(``resolved_by``) and in the admin's history (``LogEntry``); an expired key authenticates
nobody."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.utils import timezone

from tests.factories import ApiKeyFactory, SubscriptionFactory, TopicFactory, UserFactory
from tests.support.api import call
from tests.support.queue import dead_letter
from workqueue.models import Delivery
from workqueue.operators.permissions import OPERATE, OPERATE_PERMISSION, PUBLISH, READ

pytestmark = pytest.mark.usefixtures("queue_db")


OPERATIONS = [
    pytest.param("replay", {"note": "fixed"}, "Replayed", id="replay"),
    pytest.param("discard", {"reason": "obsolete"}, "Discarded or cancelled", id="discard"),
]


@pytest.mark.parametrize(("verb", "body", "logged"), OPERATIONS)
def test_an_operation_with_an_api_key_names_the_key_and_its_owner(client, verb, body, logged):
    sub = SubscriptionFactory()
    delivery_id = dead_letter(sub)
    key = ApiKeyFactory(scopes=[OPERATE])
    label = f"API key wq_{key.prefix}"

    response = call(
        client, "post", f"/subscriptions/{sub.name}/deliveries/{delivery_id}/{verb}", body, key=key
    )

    assert response.status_code == 200, response.content
    assert Delivery.objects.get(pk=delivery_id).resolved_by == f"{key.owner.username} via {label}"
    [entry] = LogEntry.objects.filter(object_id=delivery_id)
    assert (entry.user, entry.action_flag) == (key.owner, CHANGE)
    note = next(iter(body.values()))
    assert (
        entry.get_change_message() == f"{logged} through the REST API with {label} (note: {note})"
    )


def test_a_150_character_owner_name_keeps_the_key_in_the_record(client):
    sub = SubscriptionFactory()
    delivery_id = dead_letter(sub)
    owner = UserFactory(username="o" * 150, perms=[OPERATE_PERMISSION])
    key = ApiKeyFactory(scopes=[OPERATE], owner=owner)

    response = call(
        client, "post", f"/subscriptions/{sub.name}/deliveries/{delivery_id}/replay", {}, key=key
    )

    assert response.status_code == 200, response.content
    resolved_by = Delivery.objects.get(pk=delivery_id).resolved_by
    assert len(resolved_by) == 150  # the column's width
    assert resolved_by.startswith("ooo") and resolved_by.endswith(f" via API key wq_{key.prefix}")


def expire(key: Any) -> None:
    type(key).objects.filter(pk=key.pk).update(expires_at=timezone.now() - dt.timedelta(seconds=1))


def test_an_expired_key_reads_nothing_401(client):
    SubscriptionFactory(name="a.sub")
    key = ApiKeyFactory(scopes=[READ])
    headers = {"X-API-Key": key.raw_key}
    assert client.get("/work-queue/subscriptions/stats", headers=headers).status_code == 200

    expire(key)

    response = client.get("/work-queue/subscriptions/stats", headers=headers)
    assert response.status_code == 401, response.content


def test_an_expired_key_publishes_nothing_401(client):
    topic = TopicFactory(allow_external_publish=True)
    key = ApiKeyFactory(scopes=[PUBLISH])
    expire(key)

    response = call(
        client, "post", f"/topics/{topic.name}/messages", {"messages": [{"payload": {}}]}, key=key
    )

    assert response.status_code == 401, response.content
    assert not Delivery.objects.exists()
