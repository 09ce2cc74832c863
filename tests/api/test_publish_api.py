"""``POST /work-queue/topics/{topic}/messages`` through Django's test client and the real queue:
the order of checks, the status codes, the positional results, and that a refused request
writes nothing."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from django.db import connection
from django.test import Client

from tests.factories import (
    ALL_PERMISSIONS,
    ApiKeyFactory,
    SubscriptionFactory,
    TopicFactory,
    UserFactory,
)
from tests.support.api import assert_refused, post, url
from workqueue import publish
from workqueue.api import publish as publish_api
from workqueue.exceptions import UnstorableValueError
from workqueue.models import Delivery, Message
from workqueue.operators.permissions import PUBLISH_PERMISSION, READ, READ_PERMISSION

pytestmark = pytest.mark.usefixtures("queue_db")


@pytest.fixture
def topic():
    topic = TopicFactory(allow_external_publish=True)
    SubscriptionFactory(topic=topic)
    return topic


@pytest.fixture
def key():
    return ApiKeyFactory(scopes=["workqueue:publish"])


ONE = {"messages": [{"payload": {"n": 1}}]}


# -- the happy path ---------------------------------------------------------------------------


def test_a_batch_is_accepted_as_the_keys_owner_with_results_in_request_order(client, topic, key):
    first_id = str(uuid.uuid4())
    response = post(
        client,
        topic.name,
        {
            "messages": [
                {
                    "messageId": first_id,
                    "partitionKey": "customer-1",
                    "attributes": {"region": "eu"},
                    "payload": {"order": 1},
                    "correlationId": "corr-1",
                    "deduplicationKey": "order-1",
                    "deduplicationTtlSeconds": 3600,
                },
                {
                    "payloadRef": {
                        "uri": "s3://bucket/object",
                        "contentType": "application/json",
                        "sizeBytes": 12,
                        "checksum": "sha256:abc",
                    }
                },
            ]
        },
        key=key,
    )

    assert response.status_code == 202, response.content
    results = response.json()["results"]
    assert [r["status"] for r in results] == ["Accepted", "Accepted"]
    assert results[0] == {"messageId": first_id, "status": "Accepted", "error": None}
    first = Message.objects.get(pk=first_id)
    assert first.published_by == key.owner.username
    assert first.partition_key == "customer-1"
    assert first.attributes == {"region": "eu"}
    assert first.correlation_id == "corr-1"
    second = Message.objects.get(pk=results[1]["messageId"])
    # Stored with the keys every entry path uses (tests/integration/test_payload_ref.py).
    assert second.payload_ref == {
        "uri": "s3://bucket/object",
        "content_type": "application/json",
        "size_bytes": 12,
        "checksum": "sha256:abc",
    }
    assert Delivery.objects.filter(message__topic=topic).count() == 2


def test_a_rejected_item_gets_its_error_in_place_and_the_batch_is_still_202(client, topic, key):
    response = post(
        client,
        topic.name,
        {
            "messages": [
                {"payload": 1},
                {"payload": 2, "attributes": {"bad name": "x"}},
                {"payload": 3, "messageId": "not-a-uuid"},
                {"payload": 4},
                {"payloadRef": {"contentType": "text/plain"}},
            ]
        },
        key=key,
    )

    assert response.status_code == 202
    results = response.json()["results"]
    assert [r["status"] for r in results] == [
        "Accepted",
        "Rejected",
        "Rejected",
        "Accepted",
        "Rejected",
    ]
    assert results[1]["error"]["code"] == "InvalidAttributes"
    assert results[1]["error"]["retryable"] is False
    assert results[2]["error"]["code"] == "InvalidMessageID"
    assert results[4]["error"]["code"] == "InvalidPayload"
    assert "needs a 'uri'" in results[4]["error"]["message"]
    assert results[0]["error"] is None and results[3]["error"] is None
    assert Message.objects.filter(topic=topic).count() == 2


def test_republishing_the_same_message_id_is_a_duplicate_not_a_second_message(client, topic, key):
    body = {"messages": [{"messageId": str(uuid.uuid4()), "payload": {"n": 1}}]}
    assert post(client, topic.name, body, key=key).json()["results"][0]["status"] == "Accepted"

    again = post(client, topic.name, body, key=key)

    assert again.status_code == 202
    assert again.json()["results"][0]["status"] == "Duplicate"
    assert Message.objects.count() == 1


def test_the_topic_name_in_the_url_is_matched_case_insensitively(client, topic, key):
    response = post(client, topic.name.upper(), ONE, key=key)

    assert response.status_code == 202
    assert Message.objects.filter(topic=topic).count() == 1


def test_a_key_limited_to_the_topic_may_publish_to_it(client, topic):
    key = ApiKeyFactory(scopes=["workqueue:publish"], topics=[topic.name])

    assert post(client, topic.name, ONE, key=key).status_code == 202


def test_using_a_key_records_when_it_was_last_used(client, topic, key):
    post(client, topic.name, ONE, key=key)

    key.refresh_from_db()
    assert key.last_used_at is not None


# -- 401 / 403: who is calling ----------------------------------------------------------------


def test_no_credentials_is_401(client, topic):
    assert_refused(post(client, topic.name, ONE), 401)


def test_no_credentials_is_401_even_when_csrf_checks_are_enforced(topic):
    assert_refused(post(Client(enforce_csrf_checks=True), topic.name, ONE), 401)


def test_an_unknown_key_is_401(client, topic):
    response = client.post(
        url(topic.name),
        data=json.dumps(ONE),
        content_type="application/json",
        headers={"X-API-Key": "wq_00000000_not-a-real-key"},
    )

    assert_refused(response, 401)


def test_a_revoked_key_is_401(client, topic, key):
    key.revoke()

    assert_refused(post(client, topic.name, ONE, key=key), 401)


def test_a_key_of_a_deactivated_owner_is_401(client, topic, key):
    key.owner.is_active = False
    key.owner.save()

    assert_refused(post(client, topic.name, ONE, key=key), 401)


def test_a_signed_in_session_without_an_api_key_is_403(client, topic):
    client.force_login(UserFactory(is_superuser=True, is_staff=True, perms=ALL_PERMISSIONS))

    body = assert_refused(post(client, topic.name, ONE), 403)

    assert "X-API-Key" in body["detail"]


def test_a_key_without_the_publish_scope_is_403(client, topic):
    key = ApiKeyFactory(scopes=[READ])

    body = assert_refused(post(client, topic.name, ONE, key=key), 403)

    assert "workqueue:publish" in body["detail"]


def test_a_key_limited_to_other_topics_is_403(client, topic):
    other = TopicFactory(allow_external_publish=True)
    key = ApiKeyFactory(scopes=["workqueue:publish"], topics=[other.name])

    assert_refused(post(client, topic.name, ONE, key=key), 403)


def test_a_key_whose_owner_lacks_the_publish_permission_is_403(client, topic):
    owner = UserFactory(perms=[READ_PERMISSION])
    key = ApiKeyFactory(owner=owner, scopes=["workqueue:publish"])

    body = assert_refused(post(client, topic.name, ONE, key=key), 403)

    assert PUBLISH_PERMISSION in body["detail"]


def test_a_topic_that_does_not_allow_external_publish_is_403(client, key):
    internal = TopicFactory(allow_external_publish=False)

    assert_refused(post(client, internal.name, ONE, key=key), 403)


# -- 400 / 413 / 404: what was sent -----------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["-leading-dash", "a..b", "x" * 201, "with%20space", "%C3%BCnicode", "semi%3Bcolon"],
)
def test_a_malformed_topic_name_is_400_and_not_echoed(client, key, name):
    body = assert_refused(post(client, name, ONE, key=key), 400)

    assert name not in json.dumps(body)
    assert "topic name" in body["detail"]


def set_body_limit(settings: Any, limit: int) -> None:
    settings.WORKQUEUE = {**settings.WORKQUEUE, "PUBLISH_BODY_LIMIT_BYTES": limit}


def test_a_body_over_the_limit_is_413(client, topic, key, settings):
    set_body_limit(settings, 64)
    big = {"messages": [{"payload": "x" * 100}]}

    assert_refused(post(client, topic.name, big, key=key), 413)


def test_a_body_exactly_at_the_limit_is_read(client, topic, key, settings):
    raw = json.dumps(ONE)
    set_body_limit(settings, len(raw))

    assert post(client, topic.name, raw=raw, key=key).status_code == 202


def test_a_content_length_over_the_limit_is_413_before_reading(client, topic, key):
    limit = publish_api.body_limit(topic.max_payload_bytes)

    response = post(client, topic.name, ONE, key=key, CONTENT_LENGTH=str(limit + 1))

    assert_refused(response, 413)


@pytest.mark.parametrize(
    "raw",
    [
        "",
        "{",
        '{"messages": [}',
        "NaN",
        '{"messages": [{"payload": NaN}]}',
        b"\xff\xfe\x00",
        "[" * 100_000,
    ],
)
def test_a_body_that_is_not_json_is_400(client, topic, key, raw):
    body = assert_refused(post(client, topic.name, raw=raw, key=key), 400)

    assert "JSON" in body["detail"]


def test_a_number_past_what_a_float_holds_is_400_saying_so_not_nan(client, topic, key):
    raw = '{"messages": [{"payload": {"x": 1e400}}]}'

    body = assert_refused(post(client, topic.name, raw=raw, key=key), 400)

    assert "1e400" in body["detail"] and "send it as a string" in body["detail"]
    assert "NaN" not in body["detail"]
    assert Message.objects.count() == 0


@pytest.mark.parametrize(
    "payload",
    [
        [],
        {},
        {"messages": []},
        {"messages": {"payload": 1}},
        {"messages": [1]},
        {"messages": [{"partitionKey": 5}]},
        {"messages": [{"attributes": {"region": 1}}]},
        {"messages": [{"deduplicationTtlSeconds": "3600"}]},
        {"messages": [{"deduplicationTtlSeconds": True}]},
        {"messages": [{"partition_key": "snake case is not the API's spelling"}]},
        {"messages": [{"payload": 1}], "extra": True},
    ],
)
def test_a_body_of_the_wrong_shape_is_400_with_field_errors(client, topic, key, payload):
    body = assert_refused(post(client, topic.name, payload, key=key), 400)

    assert body["errors"] and all("loc" in e and "msg" in e for e in body["errors"])


def test_more_messages_than_the_batch_limit_is_400(client, topic, key, settings):
    settings.WORKQUEUE = {**settings.WORKQUEUE, "PUBLISH_MAX_BATCH": 2}
    batch = {"messages": [{"payload": n} for n in range(3)]}

    body = assert_refused(post(client, topic.name, batch, key=key), 400)

    assert "1 to 2" in body["detail"]


def test_an_unknown_topic_is_404_and_not_echoed(client, key):
    TopicFactory(name="no.such-topik")  # one it resembles, whose name is not told either

    body = assert_refused(post(client, "no.such-topic", ONE, key=key), 404)

    assert "no.such-topi" not in json.dumps(body)


# -- the order of the checks ------------------------------------------------------------------


def test_the_topic_name_is_checked_before_the_scope(client):
    key = ApiKeyFactory(scopes=[READ])

    assert_refused(post(client, "a..b", ONE, key=key), 400)


def test_the_scope_is_checked_before_the_body_is_read(client, topic, settings):
    set_body_limit(settings, 1)
    key = ApiKeyFactory(scopes=[READ])

    assert_refused(post(client, topic.name, raw="{not json", key=key), 403)


def test_the_size_is_checked_before_the_json(client, topic, key, settings):
    set_body_limit(settings, 4)

    assert_refused(post(client, topic.name, raw="{not json", key=key), 413)


def test_the_shape_is_checked_before_the_topic_exists(client, key):
    assert_refused(post(client, "no.such-topic", {"messages": []}, key=key), 400)


def test_the_topic_limit_is_checked_before_the_topic_exists(client):
    key = ApiKeyFactory(scopes=["workqueue:publish"], topics=["some.other-topic"])

    assert_refused(post(client, "no.such-topic", ONE, key=key), 403)


def test_an_unknown_topic_is_404_before_external_publish_is_considered(client, key):
    TopicFactory(name="internal.only", allow_external_publish=False)

    assert_refused(post(client, "internal.only", ONE, key=key), 403)
    assert_refused(post(client, "internal.only-missing", ONE, key=key), 404)


# -- failures stay private --------------------------------------------------------------------


def test_a_value_the_database_refuses_is_400_not_503_and_not_echoed(
    client, topic, key, monkeypatch
):
    # Should a value the up-front checks miss reach the database, the caller is told that the
    # request cannot be stored, not to try the same request again later.
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise UnstorableValueError('invalid input syntax: "secret-value-7"')

    monkeypatch.setattr(publish_api, "publish_many", refuse)

    response = post(client, topic.name, ONE, key=key)

    assert response.status_code == 400
    assert "cannot store" in response.json()["detail"]
    assert "secret-value-7" not in response.content.decode()


def test_an_unexpected_failure_is_500_without_internals(client, topic, key, monkeypatch):
    def explode(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("password=hunter2 at db.internal:5432")

    monkeypatch.setattr(publish_api, "publish_many", explode)

    response = post(client, topic.name, ONE, key=key)

    assert response.status_code == 500
    assert "hunter2" not in response.content.decode()
    assert set(response.json()) == {"detail"}


def test_a_task_topic_left_open_by_an_earlier_release_refuses_external_publishes(client):
    """Opening a task topic to external publishers is refused now, but a deployment upgraded
    with one open kept accepting task messages (any task, any arguments) from publish keys."""
    tasks_topic = TopicFactory(name="tasks.default")
    SubscriptionFactory(topic=tasks_topic, handler_key=" workqueue.tasks")  # spaces and all
    with connection.cursor() as cursor:  # as the earlier release left it, past today's rules
        cursor.execute(
            "UPDATE workqueue_topic SET allow_external_publish = true WHERE id = %s",
            [tasks_topic.pk],
        )
    key = ApiKeyFactory(scopes=["workqueue:publish"], topics=["tasks.default"])
    task = {
        "task": "app.tasks.refund",
        "args": [1],
        "kwargs": {},
        "backend": "default",
        "queue": "default",
    }

    response = client.post(
        "/work-queue/topics/tasks.default/messages",
        data=json.dumps({"messages": [{"payload": task}]}),
        content_type="application/json",
        headers={"X-API-Key": key.raw_key},
    )

    assert response.status_code == 403
    assert "any task with any arguments" in response.json()["detail"]
    assert not Message.objects.filter(topic=tasks_topic).exists()


def test_re_publishing_another_publishers_message_id_answers_alike_whatever_the_content(client):
    """Duplicate (same content) or MessageIDConflict (different) told a publish key's holder,
    one guess per item, what an internal message holds, without the permission to view
    payloads: a deduplication key hands out the owning message's id to any caller."""
    topic = TopicFactory(allow_external_publish=True)
    SubscriptionFactory(topic=topic)
    secret = {"order": 42, "card_last4": "4242"}
    internal = publish(topic.name, secret, deduplication_key="order-42")
    owner = UserFactory(perms=["workqueue.add_message"])
    key = ApiKeyFactory(owner=owner, scopes=["workqueue:publish"], topics=[topic.name])
    found = post(
        client, topic.name, {"messages": [{"payload": {}, "deduplicationKey": "order-42"}]}, key=key
    )
    assert found.json()["results"][0]["messageId"] == internal.message_id  # as documented

    def answer(payload: Any) -> tuple[str, str]:
        item = {"messageId": internal.message_id, "payload": payload}
        (result,) = post(client, topic.name, {"messages": [item]}, key=key).json()["results"]
        return result["status"], result["error"]["code"]

    assert answer(secret) == answer({**secret, "card_last4": "0000"})
    assert answer(secret) == ("Rejected", "MessageIDConflict")


def test_re_publishing_its_own_message_id_answers_duplicate_to_an_external_publisher(client):
    topic = TopicFactory(allow_external_publish=True)
    SubscriptionFactory(topic=topic)
    key = ApiKeyFactory(scopes=["workqueue:publish"], topics=[topic.name])
    item = {"messageId": str(uuid.uuid4()), "payload": {"n": 1}}

    statuses = [
        post(client, topic.name, {"messages": [item]}, key=key).json()["results"][0]["status"]
        for _ in range(2)
    ]

    assert statuses == ["Accepted", "Duplicate"]
