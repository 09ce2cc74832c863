"""One shape for ``payload_ref``, the claim-check reference a message may carry instead of a
payload.

Whichever way it is published (``publish``, ``publish_many``, ``POST /work-queue/topics/{topic}/
messages``, ``manage.py workqueue publish --payload-ref``) and however its keys are spelt
(``content_type``, ``contentType``, ``ContentType``), the message stores, and the handler's
``WorkMessage.payload_ref`` holds, ``{"uri", "content_type"?, "size_bytes"?, "checksum"?}``. A
bad reference is Rejected with ``InvalidPayload`` and a message naming the key and the fix.
"""

from __future__ import annotations

import io
import json
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.test import Client

from tests.factories import ApiKeyFactory, SubscriptionFactory, TopicFactory
from tests.support.handlers import probe, registry
from workqueue import publish, publish_many
from workqueue.driver import get_driver
from workqueue.models import Message, Topic
from workqueue.runtime.host import Host, HostConfig
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")

CANONICAL = {
    "uri": "s3://bucket/orders/42.json",
    "content_type": "application/json",
    "size_bytes": 1234,
    "checksum": "sha256:9f86d0",
}
SPELLINGS = {
    "snake_case": dict(CANONICAL),
    "camelCase": {
        "uri": CANONICAL["uri"],
        "contentType": CANONICAL["content_type"],
        "sizeBytes": CANONICAL["size_bytes"],
        "checksum": CANONICAL["checksum"],
    },
    # The reference system's own spelling.
    "PascalCase": {
        "Uri": CANONICAL["uri"],
        "ContentType": CANONICAL["content_type"],
        "SizeBytes": CANONICAL["size_bytes"],
        "Checksum": CANONICAL["checksum"],
    },
    "uri-only": {"uri": CANONICAL["uri"]},
}
EXPECTED = {name: dict(CANONICAL) for name in SPELLINGS} | {"uri-only": {"uri": CANONICAL["uri"]}}


# -- the entry paths: each publishes one reference and returns (status, error code, message id)


def _python(topic: Topic, ref: Any) -> tuple[str, str | None, str | None]:
    result = publish(topic.name, payload_ref=ref)
    return result.status, result.error and result.error.code, result.message_id


def _python_batch(topic: Topic, ref: Any) -> tuple[str, str | None, str | None]:
    [result] = publish_many(topic.name, [{"payload_ref": ref}])
    return result.status, result.error and result.error.code, result.message_id


def _rest(topic: Topic, ref: Any) -> tuple[str, str | None, str | None]:
    key = ApiKeyFactory(scopes=["workqueue:publish"])
    response = Client().post(
        f"/work-queue/topics/{topic.name}/messages",
        data=json.dumps({"messages": [{"payloadRef": ref}]}),
        content_type="application/json",
        headers={"X-API-Key": key.raw_key},
    )
    assert response.status_code == 202, response.content
    [result] = response.json()["results"]
    return result["status"], result["error"] and result["error"]["code"], result["messageId"]


def _cli(topic: Topic, ref: Any) -> tuple[str, str | None, str | None]:
    out = io.StringIO()
    try:
        call_command(
            "workqueue",
            "publish",
            "--topic",
            topic.name,
            "--payload-ref",
            json.dumps(ref),
            "--json",
            stdout=out,
            stderr=io.StringIO(),
        )
    except CommandError as refused:
        assert "rejected" in str(refused).lower(), refused
    [result] = json.loads(out.getvalue())
    return result["status"], result["error"], result["message_id"]


PATHS: dict[str, Callable[[Topic, Any], tuple[str, str | None, str | None]]] = {
    "publish": _python,
    "publish_many": _python_batch,
    "rest": _rest,
    "cli": _cli,
}


@pytest.fixture
def topic() -> Topic:
    return TopicFactory(allow_external_publish=True)


@pytest.mark.parametrize("path", list(PATHS))
def test_every_entry_path_stores_and_delivers_one_shape_whatever_the_spelling(
    topic: Topic, path: str
):
    SubscriptionFactory(topic=topic, handler_key="t.script")
    published = {}
    for spelling, ref in SPELLINGS.items():
        status, error, message_id = PATHS[path](topic, ref)
        assert (status, error) == ("Accepted", None), spelling
        assert Message.objects.get(pk=message_id).payload_ref == EXPECTED[spelling], spelling
        published[message_id] = spelling

    probe.reset()
    get_user_model().objects.create_user("workqueue-system")
    host = Host(
        HostConfig(subscriptions=[{"name": "*"}], sweeper_interval_ms=0, idle_poll_min_ms=50),
        registry=registry,
    )
    host.run_once(max_deliveries=len(published), idle_exit_ms=2000)

    seen = {run.message_id: run.payload_ref for run in probe.runs}
    assert set(seen) == set(published)
    for message_id, spelling in published.items():
        assert seen[message_id] == EXPECTED[spelling], spelling


BAD = [
    pytest.param({"contentType": "text/plain"}, "payload_ref needs a 'uri'", id="no-uri"),
    pytest.param({"uri": "  "}, "payload_ref.uri must be a non-empty string", id="blank-uri"),
    pytest.param({"uri": 42}, "payload_ref.uri must be a non-empty string", id="uri-number"),
    pytest.param(
        {"uri": "s3://b/k", "sizeBytes": "12"},
        "payload_ref.size_bytes must be a whole number of bytes",
        id="size-as-text",
    ),
    pytest.param(
        {"uri": "s3://b/k", "size_bytes": -1},
        "payload_ref.size_bytes must be a whole number of bytes",
        id="negative-size",
    ),
    pytest.param(
        {"uri": "s3://b/k", "size_bytes": True},
        "payload_ref.size_bytes must be a whole number of bytes",
        id="size-boolean",
    ),
    pytest.param(
        {"uri": "s3://b/k", "content_type": 5},
        "payload_ref.content_type must be a non-empty string",
        id="content-type-number",
    ),
    pytest.param(
        {"uri": "s3://b/k", "checksum": ""},
        "payload_ref.checksum must be a non-empty string",
        id="empty-checksum",
    ),
    pytest.param(
        {"uri": "s3://b/k", "etag": "x"},
        "payload_ref has an unknown key 'etag' (allowed: uri, content_type, size_bytes, checksum",
        id="unknown-key",
    ),
    pytest.param(
        {"uri": "s3://b/k", "contentType": "a", "content_type": "b"},
        "payload_ref gives content_type twice ('contentType' and 'content_type')",
        id="two-spellings",
    ),
    pytest.param("s3://b/k", "payload_ref must be an object", id="not-an-object"),
]


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("ref", "problem"), BAD)
def test_a_bad_reference_is_rejected_with_invalid_payload_on_every_path(
    topic: Topic, path: str, ref: Any, problem: str
):
    SubscriptionFactory(topic=topic)

    status, error, _ = PATHS[path](topic, ref)

    assert (status, error) == ("Rejected", "InvalidPayload")
    assert not Message.objects.filter(topic=topic).exists()
    result = publish(topic.name, payload_ref=ref)
    assert result.error is not None and problem in result.error.message, result.error


def test_a_reference_stored_before_in_another_spelling_reaches_the_handler_in_one_shape():
    # Before references were stored in one shape, the REST API kept its camelCase wire form;
    # such rows go straight to the procedure here, as they were written then.
    topic = TopicFactory()
    sub = SubscriptionFactory(topic=topic)
    message_id = str(uuid.uuid4())
    [row] = get_driver().call(
        "wq_publish",
        {
            "topic_name": topic.name,
            "message_id": message_id,
            "payload_ref": SPELLINGS["camelCase"],
            "envelope_bytes": 200,
            "external": False,
            "published_by": "then",
        },
    )
    assert row["status"] == "Accepted"

    [claimed] = Receiver(sub.id).receive(1).deliveries

    assert claimed.payload_ref == CANONICAL


def test_dead_letters_show_the_reference_in_the_apis_camel_case(client: Client):
    topic = TopicFactory()
    sub = SubscriptionFactory(topic=topic)
    publish(topic.name, payload_ref=SPELLINGS["snake_case"])
    receiver = Receiver(sub.id)
    [claimed] = receiver.receive(1).deliveries
    assert receiver.dead_letter(claimed, "Poison", "boom").settled
    key = ApiKeyFactory(scopes=["workqueue:read"])

    response = client.get(
        f"/work-queue/subscriptions/{sub.name}/dead-letters", headers={"X-API-Key": key.raw_key}
    )

    assert response.status_code == 200, response.content
    [item] = response.json()["items"]
    assert item["message"]["payloadRef"] == SPELLINGS["camelCase"]
