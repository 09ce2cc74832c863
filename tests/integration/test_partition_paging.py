"""Paging through a partitioned subscription's keys with the cursor, through the CLI and the REST
API: keys of the longest length in any script, and cursors that were tampered with (issue 10,
item 9)."""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.test import Client

from tests.factories import ApiKeyFactory, SubscriptionFactory
from workqueue import publish
from workqueue.input_limits import within_units
from workqueue.operators.permissions import READ
from workqueue.publishing import MAX_KEY_LENGTH
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")

# The longest keys there are (200 UTF-16 units: an emoji counts two), each character 2 to 4
# bytes in UTF-8 (or 6 to 12 as \u escapes).
LONG_KEYS = sorted(
    within_units(first + "é" * 99 + "😀" * 50 + "ключ" * 12 + "鍵" * 2, MAX_KEY_LENGTH)
    for first in "abcde"
)


def in_flight_keys(keys: list[str]) -> Any:
    """An Exclusive subscription with one delivery in flight for each key."""
    sub = SubscriptionFactory(partition_mode="Exclusive")
    for key in keys:
        publish(sub.topic.name, {"k": key[0]}, partition_key=key)
    claimed = Receiver(sub.id).receive(len(keys)).deliveries
    assert sorted(d.partition_key for d in claimed) == keys
    return sub


def crafted(position: Any) -> str:
    """A cursor encoding ``position`` the way the server's own cursors are encoded."""
    raw = json.dumps(position).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


TAMPERED = [
    pytest.param(crafted({"partition_key": 5}), id="number"),
    pytest.param(crafted({"partition_key": ["a"]}), id="list"),
    pytest.param(crafted({"partition_key": {"$gt": ""}}), id="object"),
    pytest.param(crafted({"partition_key": None}), id="null"),
    pytest.param(crafted({"partition_key": ""}), id="empty"),
    pytest.param(crafted({"partition_key": "k" * (MAX_KEY_LENGTH + 1)}), id="too-long"),
    pytest.param(crafted({"partition_key": "a\u0000b"}), id="nul"),
    pytest.param(crafted({"partition_key": "\ud800"}), id="lone-surrogate"),
    pytest.param(crafted(["a"]), id="not-an-object"),
    pytest.param(crafted({"delivery_id": "x"}), id="another-listings-cursor"),
    pytest.param(crafted({"partition_key": "a"}) + "!*", id="junk-characters"),
    pytest.param("é" + crafted({"partition_key": "a"}), id="not-ascii"),
]


# -- REST -------------------------------------------------------------------------------------


def get_page(client: Client, sub: Any, key: Any, **params: Any) -> Any:
    return client.get(
        f"/work-queue/subscriptions/{sub.name}/partitions",
        params,
        headers={"X-API-Key": key.raw_key},
    )


def test_rest_pages_through_the_longest_non_ascii_keys(client):
    sub = in_flight_keys(LONG_KEYS)
    key = ApiKeyFactory(scopes=[READ])

    seen: list[str] = []
    cursor = None
    for _ in range(len(LONG_KEYS)):
        params = {"page_size": 2} | ({"cursor": cursor} if cursor else {})
        response = get_page(client, sub, key, **params)
        assert response.status_code == 200, response.content
        body = response.json()
        seen += [item["partitionKey"] for item in body["items"]]
        cursor = body["nextCursor"]
        if cursor is None:
            break

    assert seen == LONG_KEYS


@pytest.mark.parametrize("cursor", TAMPERED)
def test_rest_refuses_a_tampered_cursor_with_400(client, cursor):
    sub = in_flight_keys(["a", "b"])

    response = get_page(client, sub, ApiKeyFactory(scopes=[READ]), cursor=cursor)

    assert response.status_code == 400, response.content
    assert "cursor is not valid" in response.json()["detail"]


# -- CLI --------------------------------------------------------------------------------------


def partitions(sub: Any, *args: str) -> dict[str, Any]:
    out = io.StringIO()
    call_command(
        "workqueue", "partitions", "-s", sub.name, "--json", *args, stdout=out, stderr=io.StringIO()
    )
    return json.loads(out.getvalue())


def test_cli_pages_through_the_longest_non_ascii_keys():
    sub = in_flight_keys(LONG_KEYS)

    seen: list[str] = []
    args: list[str] = []
    for _ in range(len(LONG_KEYS)):
        page = partitions(sub, "--page-size", "2", *args)
        seen += [item["partition_key"] for item in page["items"]]
        if page["next_cursor"] is None:
            break
        args = ["--cursor", page["next_cursor"]]

    assert seen == LONG_KEYS


@pytest.mark.parametrize("cursor", TAMPERED)
def test_cli_refuses_a_tampered_cursor(cursor):
    sub = in_flight_keys(["a", "b"])

    with pytest.raises(CommandError, match="cursor is not valid"):
        partitions(sub, "--cursor", cursor)
