"""Attack tests (issue 10, item 4): a publish-scoped key cannot make the server hold or work
through more than one batch's worth of messages. The body limit follows from
``PUBLISH_MAX_BATCH`` and the topic's ``max_payload_bytes``; a larger body is refused with 413
before it is parsed (before it is read at all when Content-Length says so); a batch over the
limit is refused before any message is validated; an oversized message is rejected before the
database. Through Django's test client (WSGI) and Django's ASGI handler, against the real
queue."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.core.asgi import get_asgi_application

from tests.factories import ApiKeyFactory, SubscriptionFactory, TopicFactory
from tests.support.api import assert_refused, post, url
from tests.support.memory import SWOLLEN_PAYLOAD, peak_bytes
from workqueue.api import publish as publish_api
from workqueue.driver.base import canonical_json
from workqueue.models import Message

pytestmark = pytest.mark.usefixtures("queue_db")

SMALL_BATCH = 2
SMALL_MESSAGE = 100
# What the limit works out to for SMALL_BATCH messages of SMALL_MESSAGE bytes (2 KiB a message
# for what is sent besides the counted envelope).
SMALL_LIMIT = SMALL_BATCH * (SMALL_MESSAGE + 2048)


@pytest.fixture
def key():
    return ApiKeyFactory(scopes=["workqueue:publish"])


@pytest.fixture
def small_topic(settings):
    settings.WORKQUEUE = {**settings.WORKQUEUE, "PUBLISH_MAX_BATCH": SMALL_BATCH}
    topic = TopicFactory(allow_external_publish=True, max_payload_bytes=SMALL_MESSAGE)
    SubscriptionFactory(topic=topic)
    return topic


@pytest.fixture
def never_parsed(monkeypatch):
    """Fail the test if the view gets as far as parsing the body."""

    def refuse(raw: bytes) -> Any:
        raise AssertionError(f"the body ({len(raw)} bytes) was parsed")

    monkeypatch.setattr(publish_api, "_parse", refuse)


class UnreadableStream:
    """A request body that must never be read."""

    def read(self, *args: Any) -> bytes:
        raise AssertionError("the request body was read")

    readline = read


# -- the body limit -------------------------------------------------------------------------------


def test_the_default_body_limit_is_a_full_batch_of_full_size_messages(settings):
    assert publish_api.body_limit() == 100 * (262_144 + 2048)
    assert publish_api.body_limit(1000) == 100 * (1000 + 2048)

    settings.WORKQUEUE = {**settings.WORKQUEUE, "PUBLISH_BODY_LIMIT_BYTES": 12_345}

    assert publish_api.body_limit() == publish_api.body_limit(1000) == 12_345


def test_a_body_over_what_the_topics_limits_allow_is_413_without_being_parsed(
    client, small_topic, key, never_parsed
):
    body = {"messages": [{"payload": "x" * 20_000}]}

    refused = assert_refused(post(client, small_topic.name, body, key=key), 413)

    assert f"{SMALL_LIMIT} bytes" in refused["detail"]
    assert "PUBLISH_MAX_BATCH" in refused["detail"]
    assert "PUBLISH_BODY_LIMIT_BYTES" in refused["detail"]


def test_a_declared_content_length_over_the_default_limit_is_413_before_any_byte_is_read(
    client, key, never_parsed
):
    topic = TopicFactory(allow_external_publish=True)

    response = post(
        client,
        topic.name,
        raw="{}",
        key=key,
        CONTENT_LENGTH=str(publish_api.body_limit() + 1),
        **{"wsgi.input": UnreadableStream()},
    )

    assert_refused(response, 413)


def test_a_full_batch_of_full_size_messages_with_the_longest_keys_fits(client, small_topic, key):
    """The allowance per message covers what is sent besides the counted envelope: the message
    id, a 200-character deduplication key (3 bytes a character here, the most a key of 200
    UTF-16 units can take: a character beyond U+FFFF takes 4 bytes but counts two) and its
    TTL."""
    dedup = "\u934d" * 200
    messages = []
    for n in range(SMALL_BATCH):
        envelope = {
            "attributes": None,
            "correlation_id": None,
            "partition_key": f"k{n}",
            "payload": "",
            "payload_ref": None,
        }
        room = SMALL_MESSAGE - len(canonical_json(envelope).encode())
        messages.append(
            {
                "messageId": f"00000000-0000-4000-8000-00000000000{n}",
                "partitionKey": f"k{n}",
                "payload": "x" * room,
                "deduplicationKey": dedup[: 199 + n],
                "deduplicationTtlSeconds": 2_592_000,
            }
        )
    raw = json.dumps({"messages": messages}, ensure_ascii=False, separators=(",", ":"))
    assert len(raw.encode()) <= SMALL_LIMIT

    response = post(client, small_topic.name, raw=raw.encode(), key=key)

    assert response.status_code == 202, response.content
    assert [r["status"] for r in response.json()["results"]] == ["Accepted"] * SMALL_BATCH


def test_under_asgi_a_body_without_content_length_is_cut_off_past_the_limit(small_topic, key):
    """Django's ASGI handler receives the whole body before the view runs (hence the proxy
    limit in the README); the view then reads at most one byte past the limit and refuses."""
    chunk = b'{"messages": [{"payload": "' + b"x" * 4000
    chunks = [chunk] + [b"x" * 4000] * 4 + [b'"}]}']
    received: list[bytes] = []
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if len(received) == len(chunks):
            # The handler keeps listening for a disconnect while the view runs: none comes.
            await asyncio.Event().wait()
        body = chunks[len(received)]
        received.append(body)
        return {"type": "http.request", "body": body, "more_body": len(received) < len(chunks)}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": url(small_topic.name),
        "raw_path": url(small_topic.name).encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"testserver"),
            (b"content-type", b"application/json"),
            (b"transfer-encoding", b"chunked"),
            (b"x-api-key", key.raw_key.encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
    }

    async_to_sync(get_asgi_application())(scope, receive, send)

    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert start["status"] == 413, body
    assert f"{SMALL_LIMIT} bytes".encode() in body
    assert len(received) == len(chunks)  # all of it arrived before the view could refuse
    assert Message.objects.count() == 0


# -- the batch size -------------------------------------------------------------------------------


def test_a_batch_over_publish_max_batch_is_400_naming_the_setting_before_any_item_is_checked(
    client, small_topic, key
):
    # Items that are not even objects: checking them one by one would answer with their field
    # errors; the count is refused first, on the raw list.
    body = {"messages": [1, 2, 3]}

    refused = assert_refused(post(client, small_topic.name, body, key=key), 400)

    assert "PUBLISH_MAX_BATCH" in refused["detail"] and "1 to 2" in refused["detail"]
    assert "got 3" in refused["detail"]
    assert refused.get("errors") is None


# -- the message size -----------------------------------------------------------------------------


def test_a_message_over_the_topics_max_payload_bytes_is_rejected_without_a_database_call(
    client, small_topic, key, statements
):
    body = {"messages": [{"payload": "x" * (SMALL_MESSAGE + 1)}]}

    response = post(client, small_topic.name, body, key=key)

    assert response.status_code == 202, response.content
    [result] = response.json()["results"]
    assert result["status"] == "Rejected"
    assert result["error"]["code"] == "PayloadTooLarge"
    assert f"max_payload_bytes is {SMALL_MESSAGE}" in result["error"]["message"]
    assert statements == []
    assert Message.objects.count() == 0


def test_only_the_messages_that_fit_reach_the_database(client, small_topic, key, statements):
    body = {"messages": [{"payload": "x" * (SMALL_MESSAGE + 1)}, {"payload": 1}]}

    response = post(client, small_topic.name, body, key=key)

    assert [r["status"] for r in response.json()["results"]] == ["Rejected", "Accepted"]
    assert len(statements) == 1 and "wq_publish(" in statements[0]


# -- what the body decodes to ----------------------------------------------------------------


def test_a_body_within_the_limit_that_decodes_to_hundreds_of_megabytes_is_413_unparsed(client, key):
    """The body limit bounds bytes, not what they become: 25 MB of JSON empty objects, a full
    batch of full-size messages, decoded to some 600 MB in the web process for one request of
    a publish key. A body holding more JSON values than PUBLISH_MAX_JSON_VALUES is refused
    before it is parsed, naming the setting; one under it is published."""
    topic = TopicFactory(allow_external_publish=True)
    SubscriptionFactory(topic=topic)
    swollen = {"messages": [{"payload": SWOLLEN_PAYLOAD} for _ in range(100)]}
    raw = json.dumps(swollen, separators=(",", ":"))
    assert len(raw) <= publish_api.body_limit(topic.max_payload_bytes)

    refused, peak = peak_bytes(lambda: post(client, topic.name, raw=raw, key=key))

    body = assert_refused(refused, 413)
    assert "PUBLISH_MAX_JSON_VALUES" in body["detail"]
    assert peak < 128 * 2**20, f"the refusal held {peak / 2**20:.0f} MB"
    fits = {"messages": [{"payload": SWOLLEN_PAYLOAD}]}
    assert post(client, topic.name, fits, key=key).status_code == 202
