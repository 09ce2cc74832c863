"""Review helper-172: the REST dead-letter page written by hand answers what ninja wrote."""

from __future__ import annotations

import json

import pytest
from ninja.renderers import JSONRenderer

from tests.factories import ApiKeyFactory, SubscriptionFactory, TopicFactory
from tests.support.api import call
from tests.support.queue import dead_letter
from workqueue.api.schemas import DeadLetterPageOut
from workqueue.operators import operations
from workqueue.operators.permissions import READ

pytestmark = pytest.mark.usefixtures("queue_db")

PAYLOADS = [
    {"b": [1, 2.5, None, True], "a": "\u00e9\u2028</script>"},
    None,
    "text",
    [],
    0,
]


def test_the_page_is_what_ninja_answered_before(client):
    sub = SubscriptionFactory(topic=TopicFactory())
    for payload in PAYLOADS:
        dead_letter(sub, payload, attributes={"k": "v"}, partition_key="p", correlation_id="c")
    dead_letter(sub, payload_ref={"uri": "s3://b/k", "sizeBytes": 10})
    key, path = ApiKeyFactory(scopes=[READ]), f"/subscriptions/{sub.name}/dead-letters"

    response = call(client, "get", path, key=key, page_size=3)
    cursor = response.json()["nextCursor"]
    second = call(client, "get", path, key=key, page_size=3, cursor=cursor)

    def before(cursor: str | None) -> dict:
        page = operations.list_dead_letters(sub.name, cursor=cursor, page_size=3)
        items = []
        for item in page.items:
            items.append(
                {
                    "delivery_id": item.delivery_id,
                    "partition_key": item.partition_key,
                    "attempts": item.attempts,
                    "reason": item.reason,
                    "last_error": item.last_error,
                    "dead_lettered_at": item.dead_lettered_at,
                    "blocks_key": item.blocks_key,
                    "message": {
                        "message_id": item.message_id,
                        "topic": item.topic,
                        "partition_key": item.message_partition_key,
                        "attributes": item.attributes,
                        "payload": None
                        if item.payload_json is None
                        else json.loads(item.payload_json),
                        "payload_ref": item.payload_ref,
                        "correlation_id": item.correlation_id,
                        "published_at": item.published_at,
                    },
                }
            )
        shown = DeadLetterPageOut.model_validate(
            {"supported": page.supported, "items": items, "next_cursor": page.next_cursor}
        ).model_dump(by_alias=True)
        return json.loads(JSONRenderer().render(None, shown, response_status=200))

    for got, cur in ((response, None), (second, cursor)):
        assert got.status_code == 200, got.content[:300]
        assert got["Content-Type"] == "application/json; charset=utf-8"
        assert "no-cache" in got["Cache-Control"] and "no-store" in got["Cache-Control"]
        assert json.loads(got.content) == before(cur)


def test_a_transport_that_reads_payloads_anyway_does_not_show_them_to_a_non_viewer(
    client, monkeypatch
):
    """Before this change operations blanked payload and payload_ref for a caller without
    view_payload whatever the transport gave (the seam's contract: with_payload false, "read
    as little of them as it can"; the AWS transport read them whole and left the dropping to
    the caller). Now nothing blanks them: a transport of one's own that reads them anyway,
    renamed to payload_json as the upgrade note says, shows them to a read key without
    view_payload."""
    from tests.api.test_operator_api import WITHOUT_PAYLOAD, owner_with
    from tests.support.api import reader
    from workqueue.transports.database import DatabaseTransport

    real = DatabaseTransport.list_dead_letters

    def reads_them_anyway(self, subscription_id, after, size, *, with_payload=True):
        return real(self, subscription_id, after, size)  # as little as it can: all of them

    monkeypatch.setattr(DatabaseTransport, "list_dead_letters", reads_them_anyway)
    sub = SubscriptionFactory()
    dead_letter(sub, {"secret": "personal data"})
    key = reader(owner=owner_with(*WITHOUT_PAYLOAD))

    response = call(client, "get", f"/subscriptions/{sub.name}/dead-letters", key=key)

    assert response.status_code == 200
    assert "personal data" not in response.content.decode(), response.content.decode()
