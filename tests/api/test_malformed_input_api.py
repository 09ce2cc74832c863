"""Attack tests (issue 10, item 8) through the REST API: text the database cannot store (a NUL
character, a lone surrogate) and JSON nested deeper than 64 levels are answered 400 with where
the problem is, before any database work; nothing is written and the value is not echoed. The
operator endpoints do the same for names in the path (``%00``), notes, reasons and cursors.
Through Django's test client against the real queue."""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

import pytest

from tests.factories import ApiKeyFactory, SubscriptionFactory, TopicFactory
from tests.support.api import assert_refused, post
from tests.support.queue import pending
from workqueue import publish
from workqueue.models import Delivery
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
    # Past every parser's limit: CPython 3.13 parses 5,000 levels (its limit is in C, not the
    # interpreter's recursion limit), and the 64 levels are then refused after the parse.
    response = publish_raw(client, topic, key, '{"payload": ' + nested(50_000) + "}")

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
    assert delivery.decoded_payload() == payload
    assert delivery.partition_key == "\\u0000"


# -- operator endpoints -------------------------------------------------------------------------


def operator_call(client: Any, key: Any, method: str, path: str, body: Any = None) -> Any:
    url, headers = f"/work-queue{path}", {"X-API-Key": key.raw_key}
    if method == "get":
        return client.get(url, headers=headers)
    return client.post(url, data=json.dumps(body), content_type="application/json", headers=headers)


DELIVERY = "00000000-0000-4000-8000-000000000000"


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("get", "/subscriptions/a%00b/stats", None),
        ("get", "/subscriptions/a%00b/dead-letters", None),
        ("get", "/subscriptions/a%00b/partitions", None),
        ("get", "/subscriptions/a%00b/backlog", None),
        ("post", f"/subscriptions/a%00b/deliveries/{DELIVERY}/replay", {}),
        ("post", f"/subscriptions/a%00b/deliveries/{DELIVERY}/discard", {"reason": "r"}),
        ("get", "/bindings/validate?transport=a%00b", None),
    ],
    ids=["stats", "dead-letters", "partitions", "backlog", "replay", "discard", "bindings"],
)
def test_a_nul_in_a_name_in_the_url_is_400(client, key, method, path, body):
    response = operator_call(client, key, method, path, body)

    assert response.status_code == 400, response.content
    assert "NUL" in response.json()["detail"]


@pytest.mark.parametrize(
    ("action", "body", "field"),
    [
        ("replay", {"note": f"checked{NUL}"}, "note"),
        ("discard", {"reason": f"{LONE_SURROGATE}poison"}, "reason"),
    ],
)
def test_a_note_or_reason_the_database_cannot_store_is_400_and_changes_nothing(
    client, key, action, body, field
):
    sub = SubscriptionFactory()
    publish(sub.topic.name, {"n": 1})
    receiver = Receiver(sub.id)
    [claimed] = receiver.receive(1).deliveries
    assert receiver.dead_letter(claimed, "Poison", "boom").settled
    path = f"/subscriptions/{sub.name}/deliveries/{claimed.delivery_id}/{action}"

    response = operator_call(client, key, "post", path, body)

    assert response.status_code == 400, response.content
    assert response.json()["detail"].startswith(f"{field} holds a")
    assert Delivery.objects.get(id=claimed.delivery_id).status == "DeadLettered"


def test_a_partitions_cursor_carrying_a_nul_key_is_400(client, key):
    sub = SubscriptionFactory(partition_mode="Exclusive")
    forged = base64.urlsafe_b64encode(
        json.dumps({"partition_key": f"k{NUL}", "of": sub.name}).encode()
    ).decode()

    response = operator_call(
        client, key, "get", f"/subscriptions/{sub.name}/partitions?cursor={forged.rstrip('=')}"
    )

    assert response.status_code == 400, response.content
    assert "cursor" in response.json()["detail"]


@pytest.mark.parametrize("listing", ["dead-letters", "partitions"])
def test_a_cursor_nested_past_what_the_parser_takes_is_400(client, key, listing):
    # A thousand brackets fit in a cursor's length; the decoder's RecursionError was a 500,
    # reached by any key before its permissions were checked.
    sub = SubscriptionFactory(partition_mode="Exclusive")
    forged = base64.urlsafe_b64encode(b"[" * 1200).decode().rstrip("=")

    response = operator_call(
        client, key, "get", f"/subscriptions/{sub.name}/{listing}?cursor={forged}"
    )

    assert response.status_code == 400, response.content
    assert "cursor" in response.json()["detail"]


def test_an_operator_body_past_djangos_upload_limit_is_413_not_a_server_error(client, key, caplog):
    # Django refuses to read it (DATA_UPLOAD_MAX_MEMORY_SIZE, 2.5 MB by default) before the
    # API's own checks: the error went to the catch-all handler and answered 500.
    sub = SubscriptionFactory()
    path = f"/subscriptions/{sub.name}/deliveries/{uuid.uuid4()}/discard"

    response = operator_call(client, key, "post", path, {"reason": "x" * 3_000_000})

    assert response.status_code == 413, response.content
    assert "DATA_UPLOAD_MAX_MEMORY_SIZE" in response.json()["detail"]
    assert "Work queue API request failed" not in caplog.text


@pytest.mark.parametrize("not_before", ["0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00"])
def test_a_not_before_with_no_utc_equivalent_is_rejected_not_a_server_error(
    client, topic, key, not_before
):
    # Its conversion to UTC overflowed: a 500, and the whole batch refused with it.
    body = {"messages": [{"payload": 1}, {"payload": 2, "notBefore": not_before}]}

    response = post(client, topic.name, body, key=key)

    assert response.status_code == 202, response.content
    results = response.json()["results"]
    assert [r["status"] for r in results] == ["Accepted", "Rejected"]
    assert results[1]["error"]["code"] == "InvalidSchedule"


# -- bodies made to be answered at length (audit helper-137) -------------------------------------

#: ~390 KB of JSON, far under every body limit.
MANY = 30_000


def _many_keys(value: str = "0", count: int = MANY) -> str:
    return "{" + ",".join(f'"k{i:07d}":{value}' for i in range(count)) + "}"


@pytest.mark.parametrize(
    "body",
    [
        '{"messages":[' + _many_keys() + "]}",
        '{"messages":[{"payload":1}],' + _many_keys()[1:],
        '{"messages":[{"payload":1,"attributes":' + _many_keys() + "}]}",
    ],
    ids=["unknown fields of a message", "unknown fields of the body", "attributes not text"],
)
def test_a_publish_body_of_many_bad_fields_gets_a_short_400_at_little_cost(client, body):
    """A 400 listed one error per unknown field (and pydantic made each first), so any key
    limited to one topic got an answer larger than its request, for seconds of CPU and
    gigabytes of memory at the default body limit (26 MB: 20 s, 3.1 GB, a 160 MB answer)."""
    topic = TopicFactory(allow_external_publish=True)
    key = ApiKeyFactory(scopes=[PUBLISH], topics=[topic.name])

    response = post(client, topic.name, key=key, raw=body)

    assert response.status_code == 400
    assert len(response.content) < 4_000, len(response.content)
    # Refused by counting the keys, before pydantic makes an error of each one (the cost).
    assert "keys, more than a publish request has" in response.json()["detail"]


def test_an_operator_body_of_many_unknown_fields_gets_a_short_400(client):
    subscription = SubscriptionFactory()
    key = ApiKeyFactory(scopes=[OPERATE])

    response = client.post(
        f"/work-queue/subscriptions/{subscription.name}/pending/discard",
        data=_many_keys(count=400),  # under the count that refuses a body unparsed (below)
        content_type="application/json",
        headers={"X-API-Key": key.raw_key},
    )

    assert response.status_code == 400
    assert len(response.content) < 4_000, len(response.content)
    assert response.json()["errors"][-1]["msg"].startswith("... and ")


def test_an_operator_body_of_many_values_is_refused_before_it_is_parsed(client):
    """Review helper-190: an operator's body (filters, a reason) holds a few dozen values, but
    one of 300,000 unknown fields (3.5 MB, under Django's body limit) cost 0.7 s and 390 MB to
    parse and validate before its 400, for any key that may operate, even one limited to
    another subscription. It is refused by counting, unparsed."""
    subscription = SubscriptionFactory()
    key = ApiKeyFactory(scopes=[OPERATE], subscriptions=["another.subscription"])

    response = client.post(
        f"/work-queue/subscriptions/{subscription.name}/pending/discard",
        data=_many_keys(),
        content_type="application/json",
        headers={"X-API-Key": key.raw_key},
    )

    assert response.status_code == 413, response.content[:300]
    assert "JSON values and keys" in response.json()["detail"]


def test_a_signed_in_operators_body_of_many_values_is_refused_too(client):
    """The count holds for a Django session as for an API key (both authenticate the operator
    endpoints); the CSRF check comes first, as ever."""
    from django.test import Client

    from tests.factories import ALL_PERMISSIONS, UserFactory

    browser = Client(enforce_csrf_checks=True)
    browser.force_login(UserFactory(is_staff=True, perms=ALL_PERMISSIONS))
    browser.get("/work-queue/docs")  # the docs page sets the CSRF cookie, as in a browser
    token = browser.cookies["csrftoken"].value
    subscription = SubscriptionFactory()
    url = f"/work-queue/subscriptions/{subscription.name}/pending/discard"

    without_token = browser.post(url, data=_many_keys(), content_type="application/json")
    refused = browser.post(
        url, data=_many_keys(), content_type="application/json", headers={"X-CSRFToken": token}
    )

    assert without_token.status_code == 403
    assert refused.status_code == 413, refused.content[:300]


def test_an_operator_note_full_of_commas_is_not_counted_as_values(client):
    """Text is left out of the count: a note of 1,000 commas and colons is one value."""
    subscription = SubscriptionFactory()
    pending(subscription)
    key = ApiKeyFactory(scopes=[OPERATE, READ])
    note = ",:" * 500

    response = client.post(
        f"/work-queue/subscriptions/{subscription.name}/pending/discard",
        data=json.dumps({"reason": note, "dryRun": True}),
        content_type="application/json",
        headers={"X-API-Key": key.raw_key},
    )

    assert response.status_code == 200, response.content[:300]
    assert response.json()["matched"] == 1


@pytest.mark.parametrize("scopes", [[PUBLISH], [READ]])
def test_a_key_that_may_not_operate_is_refused_before_its_body_is_read(client, scopes):
    """Audit helper-137: the body was validated before the view checked the key's scope, so a
    publish-only key got 400 for a body of unknown fields (and its validation's cost), where
    403 is the answer."""
    subscription = SubscriptionFactory()
    key = ApiKeyFactory(scopes=scopes)

    response = client.post(
        f"/work-queue/subscriptions/{subscription.name}/pending/discard",
        data='{"unknown": 1}',
        content_type="application/json",
        headers={"X-API-Key": key.raw_key},
    )

    assert response.status_code == 403, (response.status_code, response.content)
    assert "lacks the workqueue:operate scope" in response.json()["detail"]
