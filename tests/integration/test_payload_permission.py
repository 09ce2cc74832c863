"""Payloads and payload references (they may hold personal data) reach only users with
``workqueue.view_payload``, on every surface that shows a message, whatever the credential:
{API key, session} x {payload, payloadRef} x {REST dead letters, admin lists, admin change
pages}. Each case reads the surface twice, as an owner without and with the permission, and
checks the row itself is on the page, so a hidden secret is never just a missing row.
"""

from __future__ import annotations

import pytest
from django.urls import reverse

from tests.factories import ApiKeyFactory, SubscriptionFactory, UserFactory
from tests.support.queue import dead_letter
from workqueue.models import Delivery
from workqueue.operators.permissions import PAYLOAD_PERMISSION, READ, READ_PERMISSION

pytestmark = pytest.mark.usefixtures("queue_db")

SECRET = "personal-4111-1111"
DATA = {
    "payload": {"payload": {"card": SECRET}},
    "payloadRef": {"payload_ref": {"uri": f"s3://vault/{SECRET}", "checksum": "sha256:ab"}},
}
# What a reader needs for each surface, apart from view_payload.
READER = [
    READ_PERMISSION,
    "workqueue.view_message",
    "workqueue.view_subscription",
    "workqueue.view_topic",
]
SURFACES = {
    "api-dead-letters": lambda ids: f"/work-queue/subscriptions/{ids['subscription']}/dead-letters",
    "admin-message-list": lambda ids: reverse("admin:workqueue_message_changelist"),
    "admin-delivery-list": lambda ids: reverse("admin:workqueue_delivery_changelist"),
    "admin-message-change": lambda ids: reverse(
        "admin:workqueue_message_change", args=[ids["message"]]
    ),
    "admin-delivery-change": lambda ids: reverse(
        "admin:workqueue_delivery_change", args=[ids["delivery"]]
    ),
}
LISTS = {"admin-message-list", "admin-delivery-list"}


def _dead_letter(data: str) -> dict[str, str]:
    sub = SubscriptionFactory()
    delivery_id = dead_letter(sub, **DATA[data])
    message_id = Delivery.objects.get(pk=delivery_id).message_id
    return {"subscription": sub.name, "message": str(message_id), "delivery": delivery_id}


def _expected(credential: str, surface: str) -> dict[bool, tuple[int, bool, bool]]:
    """(status, row shown, secret shown) for an owner without (False) and with (True) the
    permission."""
    if credential == "api-key" and surface.startswith("admin"):
        return {False: (302, False, False), True: (302, False, False)}  # no API keys in admin
    if surface in LISTS:
        return {False: (200, True, False), True: (200, True, False)}  # lists never show them
    return {False: (200, True, False), True: (200, True, True)}


@pytest.mark.parametrize("data", list(DATA))
@pytest.mark.parametrize("credential", ["api-key", "session"])
def test_payloads_and_references_reach_only_payload_viewers(client, credential, data):
    ids = _dead_letter(data)
    owners = {
        may_view: UserFactory(is_staff=True, perms=READER + [PAYLOAD_PERMISSION] * may_view)
        for may_view in (False, True)
    }
    keys = {may_view: ApiKeyFactory(owner=owners[may_view], scopes=[READ]) for may_view in owners}

    seen: dict[str, dict[bool, tuple[int, bool, bool]]] = {}
    for surface, url in SURFACES.items():
        # The row's own id shows that the page lists it (lists show ids).
        row_id = ids["message"] if "message" in surface else ids["delivery"]
        for may_view in (False, True):
            client.logout()
            headers = {}
            if credential == "api-key":
                headers["X-API-Key"] = keys[may_view].raw_key
            else:
                client.force_login(owners[may_view])
            response = client.get(url(ids), headers=headers)
            body = response.content.decode()
            seen.setdefault(surface, {})[may_view] = (
                response.status_code,
                row_id in body,
                SECRET in body,
            )

    assert seen == {surface: _expected(credential, surface) for surface in SURFACES}
