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


def test_an_external_publisher_cannot_take_the_key_of_a_scheduled_slot(client):
    """Recurring publishes deduplicate each slot under `wq.schedule:<name>:<slot>`, a name
    anyone can spell: a publish key on the topic sent it first, held it up to 30 days, and the
    scheduler took the Duplicate for another host's publish: the slot never ran. Keys that
    start with `wq.` are the work queue's own, refused to external publishers."""
    topic = TopicFactory(allow_external_publish=True)
    key = ApiKeyFactory(scopes=[PUBLISH])
    slot_key = "wq.schedule:nightly-report:2026-07-02T01:00:00+00:00"
    response = client.post(
        f"/work-queue/topics/{topic.name}/messages",
        data=json.dumps({"messages": [{"payload": {"evil": True}, "deduplicationKey": slot_key}]}),
        content_type="application/json",
        headers={"X-API-Key": key.raw_key},
    )

    [result] = response.json()["results"]
    assert (result["status"], result["error"]["code"]) == ("Rejected", "InvalidDeduplication")
    assert "reserved" in result["error"]["message"]
    assert not Message.objects.filter(topic=topic).exists()
    # The work queue's own publishers (the scheduler among them) keep the prefix.
    assert publish(topic.name, {"slot": 1}, deduplication_key=slot_key).status == "Accepted"
