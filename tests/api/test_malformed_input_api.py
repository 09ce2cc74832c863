"""Attack tests (issue 10, item 8) through the REST API: text the database cannot store (a NUL
character, a lone surrogate) and JSON nested deeper than 64 levels are answered 400 with where
the problem is, before any database work; nothing is written and the value is not echoed.
Through Django's test client against the real queue."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.api.factories import ApiKeyFactory
from tests.api.test_publish_api import assert_refused, post
from tests.factories import SubscriptionFactory, TopicFactory
from workqueue.operators.permissions import OPERATE, PUBLISH, READ
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")

NUL = "\u0000"
LONE_SURROGATE = "\ud800"


def nested(depth: int) -> str:
    """A JSON array ``depth`` levels deep, as text (json.dumps would recurse that deep)."""
    return "[" * depth + "]" * depth


@pytest.fixture
def topic():
    topic = TopicFactory(allow_external_publish=True)
    SubscriptionFactory(topic=topic)
    return topic


@pytest.fixture
def key():
    return ApiKeyFactory(scopes=[PUBLISH, READ, OPERATE])


def publish_raw(client: Any, topic: Any, key: Any, second_message: str) -> Any:
    """Publish a batch of a valid message and then ``second_message`` (JSON text)."""
    raw = '{"messages": [{"payload": 1}, ' + second_message + "]}"
    return post(client, topic.name, raw=raw, key=key)


# -- publish ----------------------------------------------------------------------------------


MALFORMED = [
    ("payload", {"payload": f"a{NUL}b"}, "NUL"),
    ("payload", {"payload": {f"key{NUL}": 1}}, "NUL"),
    ("payload", {"payload": ["ok", LONE_SURROGATE]}, "lone surrogate"),
    ("payload", {"payload": {LONE_SURROGATE: 1}}, "lone surrogate"),
    ("partitionKey", {"payload": 1, "partitionKey": f"customer{NUL}"}, "NUL"),
    ("partitionKey", {"payload": 1, "partitionKey": "\udfff"}, "lone surrogate"),
    ("deduplicationKey", {"payload": 1, "deduplicationKey": f"order{NUL}"}, "NUL"),
    ("correlationId", {"payload": 1, "correlationId": f"{LONE_SURROGATE}x"}, "lone surrogate"),
    ("attributes", {"payload": 1, "attributes": {"region": f"eu{NUL}"}}, "NUL"),
    ("payloadRef", {"payloadRef": {"uri": f"s3://bucket/{NUL}"}}, "NUL"),
]


@pytest.mark.parametrize(
    ("field", "message", "problem"),
    MALFORMED,
    ids=[f"{field}-{problem.split()[-1]}-{n}" for n, (field, _, problem) in enumerate(MALFORMED)],
)
def test_text_the_database_cannot_store_is_400_naming_the_message_and_field(
    client, topic, key, statements, field, message, problem
):
    # json.dumps writes NUL and surrogates as \u escapes, as any client would have to.
    response = publish_raw(client, topic, key, json.dumps(message))

    body = assert_refused(response, 400)
    assert body["detail"].startswith(f"messages[1].{field} holds a {problem}")
    assert body["errors"] == [{"loc": ["messages", 1, field], "msg": body["errors"][0]["msg"]}]
    assert problem in body["errors"][0]["msg"]
    assert statements == []


@pytest.mark.parametrize("depth", [65, 900], ids=["just-over", "near-the-recursion-limit"])
def test_a_payload_nested_deeper_than_64_levels_is_400(client, topic, key, statements, depth):
    response = publish_raw(client, topic, key, '{"payload": ' + nested(depth) + "}")

    body = assert_refused(response, 400)
    assert body["detail"] == "messages[1].payload is nested more than 64 levels deep."
    assert body["errors"][0]["loc"] == ["messages", 1, "payload"]
    assert statements == []


def test_a_body_nested_past_what_the_parser_takes_is_400_saying_so(client, topic, key):
    response = publish_raw(client, topic, key, '{"payload": ' + nested(5000) + "}")

    body = assert_refused(response, 400)
    assert "nested too deeply" in body["detail"] and "64" in body["detail"]


def test_what_looks_like_malformed_text_but_is_not_is_stored_exactly(client, topic, key):
    payload = {
        "deep": json.loads(nested(63)),  # 64 levels with the object around it
        "emoji": "\U0001f600",  # sent as the escaped surrogate pair \ud83d\ude00
        "backslash-u": "\\u0000 and \\ud800",  # a backslash, then plain letters and digits
    }
    raw = json.dumps({"messages": [{"payload": payload, "partitionKey": "\\u0000"}]})
    assert "\\ud83d\\ude00" in raw

    response = post(client, topic.name, raw=raw, key=key)

    assert response.status_code == 202, response.content
    [delivery] = Receiver(topic.subscriptions.get().id).receive(1).deliveries
    assert delivery.payload == payload
    assert delivery.partition_key == "\\u0000"
