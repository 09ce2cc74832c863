"""Deduplication keys belong to the topic, whichever door a publish comes through: the README
documents that an external publisher (REST) can take a key an internal publisher will use, and
how to keep them apart. This pins the documented behaviour (issue 10, item 13)."""

from __future__ import annotations

import json

import pytest

from tests.factories import ApiKeyFactory, TopicFactory
from workqueue import publish
from workqueue.models import Message
from workqueue.operators.permissions import PUBLISH

pytestmark = pytest.mark.usefixtures("queue_db")


def test_an_external_publish_takes_the_key_for_internal_publishers_of_the_topic(client):
    topic = TopicFactory(allow_external_publish=True)
    key = ApiKeyFactory(scopes=[PUBLISH])
    response = client.post(
        f"/work-queue/topics/{topic.name}/messages",
        data=json.dumps({"messages": [{"payload": {"from": "outside"}, "deduplicationKey": "k"}]}),
        content_type="application/json",
        headers={"X-API-Key": key.raw_key},
    )
    assert response.status_code == 202, response.content
    [external] = response.json()["results"]

    internal = publish(topic.name, {"from": "inside"}, deduplication_key="k")

    assert internal.status == "Duplicate"
    assert str(internal.message_id) == external["messageId"]
    # What an internal publisher can check: who published the message that owns the key.
    assert Message.objects.get(pk=internal.message_id).published_by == key.owner.username
