"""Operator endpoints (stats, dead letters, partitions, backlog, replay, discard, validate
bindings, health) through Django's test client against the real queue: API keys with scopes and
limits acting as their owners, sessions held to Django permissions, and refusals that change
nothing."""

from __future__ import annotations

import datetime as dt
import io
import json
import time
import uuid
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.core.management import CommandError, call_command
from django.db import connection
from django.middleware.csrf import _get_new_csrf_string
from django.test import Client
from django.utils import timezone

from tests.factories import ALL_PERMISSIONS, ApiKeyFactory, SubscriptionFactory, UserFactory
from tests.support.api import call, operator, reader
from tests.support.database import queue_connection_settings
from tests.support.queue import dead_letter, pending, row_held
from workqueue import publish
from workqueue.api import subscriptions as subscriptions_api
from workqueue.driver import get_driver
from workqueue.models import Delivery, HostRecord, Subscription
from workqueue.operators.permissions import (
    OPERATE,
    OPERATE_PERMISSION,
    PAYLOAD_PERMISSION,
    PUBLISH,
    READ,
    READ_PERMISSION,
)
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")

WITHOUT_PAYLOAD = (READ_PERMISSION, OPERATE_PERMISSION)


def owner_with(*perms: str) -> Any:
    return UserFactory(perms=list(perms))


def status_of(delivery_id: str) -> str:
    return Delivery.objects.get(pk=delivery_id).status


# -- stats ------------------------------------------------------------------------------------


def test_stats_lists_every_subscription_by_name_in_camel_case(client):
    b = SubscriptionFactory(name="b.sub")
    a = SubscriptionFactory(name="a.sub")
    pending(a)
    dead_letter(b)

    response = call(client, "get", "/subscriptions/stats", key=reader())

    assert response.status_code == 200, response.content
    body = response.json()
    assert [s["subscriptionName"] for s in body["subscriptions"]] == ["a.sub", "b.sub"]
    first, second = body["subscriptions"]
    assert first["pending"] == 1 and first["deadLettered"] == 0
    assert second["deadLettered"] == 1
    assert {"inFlight", "blockedKeys", "oldestPendingAgeSeconds", "completedLastHour", "asOf"} <= (
        set(first)
    )
    assert body["failures"] == []


def test_stats_with_a_key_limited_to_one_subscription_lists_only_that_one(client):
    SubscriptionFactory(name="a.sub")
    SubscriptionFactory(name="b.sub")

    response = call(client, "get", "/subscriptions/stats", key=reader(subscriptions=["b.sub"]))

    assert [s["subscriptionName"] for s in response.json()["subscriptions"]] == ["b.sub"]


def test_stats_of_one_subscription(client):
    sub = SubscriptionFactory()
    pending(sub)

    response = call(client, "get", f"/subscriptions/{sub.name}/stats", key=reader())

    assert response.status_code == 200
    assert response.json()["subscriptions"][0]["pending"] == 1


def test_stats_count_up_to_the_stats_cap_and_say_so_on_every_surface(client, settings):
    """The counts stop at STATS_COUNT_CAP (a reader must not have a backlog of millions counted
    at every call); ``capped`` says so on REST, the CLI notes it and may count further."""
    settings.WORKQUEUE = {**settings.WORKQUEUE, "STATS_COUNT_CAP": 2}
    sub = SubscriptionFactory()
    for _ in range(3):
        pending(sub)

    body = call(client, "get", f"/subscriptions/{sub.name}/stats", key=reader()).json()
    [stats] = body["subscriptions"]
    assert (stats["pending"], stats["capped"]) == (2, True)

    out = io.StringIO()
    call_command("workqueue", "stats", "-s", sub.name, stdout=out)
    assert f"Counting stopped at the cap for {sub.name}" in out.getvalue()
    out = io.StringIO()
    call_command("workqueue", "stats", "-s", sub.name, "--cap", "10", "--json", stdout=out)
    [stats] = json.loads(out.getvalue())["subscriptions"]
    assert (stats["pending"], stats["capped"]) == (3, False)
    with pytest.raises(CommandError, match="cap must be 1 to 1,000,000; got 0"):
        call_command("workqueue", "stats", "--cap", "0")


def test_stats_of_an_unknown_subscription_is_404(client):
    response = call(client, "get", "/subscriptions/no.such-sub/stats", key=reader())

    assert response.status_code == 404
    assert response.json()["detail"]


@pytest.mark.parametrize(
    "path", ["/subscriptions/stats", "/subscriptions/{name}/stats", "/subscriptions/{name}/backlog"]
)
def test_read_endpoints_without_credentials_are_401(client, path):
    sub = SubscriptionFactory()

    assert call(client, "get", path.format(name=sub.name)).status_code == 401


@pytest.mark.parametrize(
    "path",
    [
        "/subscriptions/stats",
        "/subscriptions/{name}/stats",
        "/subscriptions/{name}/dead-letters",
        "/subscriptions/{name}/partitions",
        "/subscriptions/{name}/backlog",
        "/bindings/validate",
        "/health",
    ],
)
def test_read_endpoints_need_the_read_scope(client, path):
    sub = SubscriptionFactory()
    key = ApiKeyFactory(scopes=[PUBLISH, OPERATE])

    response = call(client, "get", path.format(name=sub.name), key=key)

    assert response.status_code == 403
    assert "workqueue:read" in response.json()["detail"]


@pytest.mark.parametrize(
    "path",
    [
        "/subscriptions/stats",
        "/subscriptions/{name}/stats",
        "/subscriptions/{name}/dead-letters",
        "/subscriptions/{name}/partitions",
        "/subscriptions/{name}/backlog",
        "/bindings/validate",
        "/health",
    ],
)
def test_read_endpoints_need_the_owners_view_delivery_permission(client, path):
    sub = SubscriptionFactory()
    key = reader(owner=owner_with(OPERATE_PERMISSION, PAYLOAD_PERMISSION))

    response = call(client, "get", path.format(name=sub.name), key=key)

    assert response.status_code == 403
    assert READ_PERMISSION in response.json()["detail"]


@pytest.mark.parametrize(
    "path",
    [
        "/subscriptions/{name}/stats",
        "/subscriptions/{name}/dead-letters",
        "/subscriptions/{name}/partitions",
        "/subscriptions/{name}/backlog",
    ],
)
def test_read_endpoints_refuse_a_subscription_outside_the_keys_limit(client, path):
    sub = SubscriptionFactory()
    other = SubscriptionFactory()

    response = call(
        client, "get", path.format(name=sub.name), key=reader(subscriptions=[other.name])
    )

    assert response.status_code == 403


# -- dead letters -----------------------------------------------------------------------------


def test_dead_letters_show_the_message_and_its_payload_to_a_payload_viewer(client):
    sub = SubscriptionFactory()
    delivery_id = dead_letter(sub, {"secret": "personal data"})

    response = call(client, "get", f"/subscriptions/{sub.name}/dead-letters", key=reader())

    assert response.status_code == 200, response.content
    body = response.json()
    assert body["supported"] is True and body["nextCursor"] is None
    [item] = body["items"]
    assert item["deliveryId"] == delivery_id
    assert item["reason"] == "Poison" and item["lastError"] == "ValueError: boom"
    assert item["attempts"] == 1 and item["blocksKey"] is False
    assert item["message"]["topic"] == sub.topic.name
    assert item["message"]["payload"] == {"secret": "personal data"}


def test_dead_letter_payloads_are_hidden_without_view_payload(client):
    sub = SubscriptionFactory()
    dead_letter(sub, {"secret": "personal data"})
    key = reader(owner=owner_with(*WITHOUT_PAYLOAD))

    response = call(client, "get", f"/subscriptions/{sub.name}/dead-letters", key=key)

    assert response.status_code == 200
    assert response.json()["items"][0]["message"]["payload"] is None
    assert "personal data" not in response.content.decode()


def test_payloads_a_caller_may_not_see_are_not_read_from_the_database(client, monkeypatch):
    """They were read (a page of up to a thousand) and blanked in the web process: a read key
    without view_payload could make it hold hundreds of megabytes per request."""
    sub = SubscriptionFactory()
    dead_letter(sub, {"secret": "x" * 100_000}, payload_ref=None)
    driver = get_driver()
    returned: list[dict[str, Any]] = []
    original = driver.call

    def recording(name: str, values: Any, *args: Any, **kwargs: Any) -> Any:
        rows = original(name, values, *args, **kwargs)
        if name == "wq_list_dead_letters":
            returned.extend(rows)
        return rows

    monkeypatch.setitem(vars(driver), "call", recording)
    hidden = reader(owner=owner_with(*WITHOUT_PAYLOAD))
    shown = reader()

    for key in (hidden, shown):
        response = call(client, "get", f"/subscriptions/{sub.name}/dead-letters", key=key)
        assert response.status_code == 200

    assert [row["payload"] is None for row in returned] == [True, False]


def test_dead_letters_page_with_a_cursor(client):
    sub = SubscriptionFactory()
    ids = sorted(dead_letter(sub, {"n": n}) for n in range(3))
    key = reader()
    path = f"/subscriptions/{sub.name}/dead-letters"

    first = call(client, "get", path, key=key, page_size=2).json()
    second = call(client, "get", path, key=key, page_size=2, cursor=first["nextCursor"]).json()

    assert [i["deliveryId"] for i in first["items"]] == ids[:2]
    assert [i["deliveryId"] for i in second["items"]] == ids[2:]
    assert second["nextCursor"] is None


def test_a_cursor_from_another_subscriptions_listing_is_400(client):
    """Cursors named only a position: another subscription's cursor was read as a place in
    this listing, and every dead letter before it was skipped without a word."""
    first, other = SubscriptionFactory(), SubscriptionFactory()
    for n in range(3):
        dead_letter(first, {"n": n})
        dead_letter(other, {"n": n})
    key = reader()
    page = call(
        client, "get", f"/subscriptions/{first.name}/dead-letters", key=key, page_size=2
    ).json()

    response = call(
        client,
        "get",
        f"/subscriptions/{other.name}/dead-letters",
        key=key,
        page_size=2,
        cursor=page["nextCursor"],
    )

    assert response.status_code == 400, response.content
    assert "cursor is not valid" in response.json()["detail"]


@pytest.mark.parametrize(
    "params",
    [{"page_size": 0}, {"page_size": 501}, {"page_size": "abc"}, {"cursor": "not-a-cursor"}],
)
def test_dead_letters_with_invalid_paging_is_400_with_the_reason(client, params):
    sub = SubscriptionFactory()

    response = call(
        client, "get", f"/subscriptions/{sub.name}/dead-letters", key=reader(), **params
    )

    assert response.status_code == 400
    assert response.json()["detail"]


def test_dead_letters_of_an_unknown_subscription_is_404(client):
    response = call(client, "get", "/subscriptions/no.such-sub/dead-letters", key=reader())

    assert response.status_code == 404


# -- partitions and backlog -------------------------------------------------------------------


def test_partitions_show_a_blocked_ordered_key_with_its_head(client):
    sub = SubscriptionFactory(partition_mode="Ordered")
    head = dead_letter(sub, {"n": 1}, partition_key="customer-1")
    publish(sub.topic.name, {"n": 2}, partition_key="customer-1")

    response = call(
        client, "get", f"/subscriptions/{sub.name}/partitions", key=reader(), condition="Blocked"
    )

    assert response.status_code == 200, response.content
    [item] = response.json()["items"]
    assert item["partitionKey"] == "customer-1"
    assert item["condition"] == "Blocked"
    assert item["headDeliveryId"] == head
    assert item["waitingItems"] >= 1


def test_partitions_name_an_in_flight_keys_holder_and_its_lease_end(client):
    sub = SubscriptionFactory(partition_mode="Exclusive")
    publish(sub.topic.name, {"n": 1}, partition_key="customer-1")
    [held] = Receiver(sub.id, "host-a").receive(1).deliveries

    response = call(client, "get", f"/subscriptions/{sub.name}/partitions", key=reader())

    assert response.status_code == 200, response.content
    [item] = response.json()["items"]
    assert (item["condition"], item["leaseOwner"]) == ("InFlight", "host-a")
    ends = dt.datetime.fromisoformat(item["leaseExpiresAt"])  # to the millisecond
    assert abs(ends - held.lease_expires_at) < dt.timedelta(milliseconds=1)

    # A key limited to named subscriptions sees a pseudonym, as on /health: the host's id
    # carries its hostname and process id (review helper-87).
    limited = reader(subscriptions=[sub.name])
    response = call(client, "get", f"/subscriptions/{sub.name}/partitions", key=limited)
    [item] = response.json()["items"]
    assert item["leaseOwner"].startswith("host-") and item["leaseOwner"] != "host-a"
    assert (
        item["leaseOwner"]
        == call(client, "get", f"/subscriptions/{sub.name}/partitions", key=limited).json()[
            "items"
        ][0]["leaseOwner"]
    )


def test_partitions_of_a_subscription_without_partitions_are_empty(client):
    sub = SubscriptionFactory()

    response = call(client, "get", f"/subscriptions/{sub.name}/partitions", key=reader())

    assert response.json() == {"supported": True, "items": [], "nextCursor": None}


def test_partitions_with_an_unknown_condition_is_400(client):
    sub = SubscriptionFactory(partition_mode="Exclusive")

    response = call(
        client, "get", f"/subscriptions/{sub.name}/partitions", key=reader(), condition="Sleepy"
    )

    assert response.status_code == 400
    assert "condition" in response.json()["detail"]


def test_backlog_counts_claimable_and_in_flight(client):
    sub = SubscriptionFactory()
    pending(sub)
    pending(sub)
    Receiver(sub.id).receive(1)

    response = call(client, "get", f"/subscriptions/{sub.name}/backlog", key=reader())

    assert response.status_code == 200
    assert response.json() == {
        "supported": True,
        "claimable": 1,
        "inFlight": 1,
        "total": 2,
        "capped": False,
    }


def test_backlog_of_an_unknown_subscription_is_404(client):
    assert call(client, "get", "/subscriptions/no.such-sub/backlog", key=reader()).status_code == (
        404
    )


# -- replay -----------------------------------------------------------------------------------


def replay_path(sub: Any, delivery_id: str) -> str:
    return f"/subscriptions/{sub.name}/deliveries/{delivery_id}/replay"


def discard_path(sub: Any, delivery_id: str) -> str:
    return f"/subscriptions/{sub.name}/deliveries/{delivery_id}/discard"


def test_replay_returns_a_dead_letter_to_pending_as_the_keys_owner(client):
    sub = SubscriptionFactory()
    delivery_id = dead_letter(sub)
    key = operator()

    response = call(client, "post", replay_path(sub, delivery_id), {"note": "fixed"}, key=key)

    assert response.status_code == 200, response.content
    assert response.json() == {"supported": True, "replayed": True}
    row = Delivery.objects.get(pk=delivery_id)
    assert row.status == "Pending" and row.attempt_count == 0 and row.is_replay
    assert row.resolved_by == f"{key.owner.username} via API key wq_{key.prefix}"
    assert row.resolution_note == "fixed"


def test_replay_without_a_body_is_allowed(client):
    sub = SubscriptionFactory()
    delivery_id = dead_letter(sub)

    response = call(client, "post", replay_path(sub, delivery_id), key=operator())

    assert response.json() == {"supported": True, "replayed": True}


def test_replay_keeps_an_ordered_heads_position(client):
    sub = SubscriptionFactory(partition_mode="Ordered")
    head = dead_letter(sub, {"n": 1}, partition_key="customer-1")
    publish(sub.topic.name, {"n": 2}, partition_key="customer-1")
    receiver = Receiver(sub.id)
    assert receiver.receive(10).deliveries == []  # the dead-lettered head blocks its key

    response = call(client, "post", replay_path(sub, head), key=operator())

    assert response.json()["replayed"] is True
    claimed = receiver.receive(10).deliveries
    assert [d.delivery_id for d in claimed] == [head]
    assert claimed[0].is_replay and claimed[0].attempt == 1


def test_replay_of_a_delivery_that_is_not_a_dead_letter_changes_nothing(client):
    sub = SubscriptionFactory()
    delivery_id = pending(sub)

    response = call(client, "post", replay_path(sub, delivery_id), key=operator())

    assert response.json() == {"supported": True, "replayed": False}
    assert status_of(delivery_id) == "Pending"


def test_replay_with_an_id_that_is_not_a_uuid_is_400_naming_the_whole_id_needed(client):
    sub = SubscriptionFactory()

    response = call(client, "post", replay_path(sub, "0190a5d4"), key=operator())

    assert response.status_code == 400
    assert "is not a delivery id: give the whole id" in response.content.decode()


def test_replay_with_a_note_over_1000_characters_is_400_and_changes_nothing(client):
    sub = SubscriptionFactory()
    delivery_id = dead_letter(sub)

    response = call(
        client, "post", replay_path(sub, delivery_id), {"note": "x" * 1001}, key=operator()
    )

    assert response.status_code == 400
    assert "1000" in response.json()["detail"]
    assert status_of(delivery_id) == "DeadLettered"


@pytest.mark.parametrize(
    ("action", "body"),
    [
        ("replay", {"Note": "INC-512: the API is back"}),
        ("replay", ["INC-512"]),
        ("replay", "INC-512"),
        ("discard", {"reason": "duplicate order", "dryRun": True}),
        ("discard", ["duplicate order"]),
    ],
    ids=["misspelt note", "replay list", "replay text", "discard dry run", "discard list"],
)
def test_a_replay_or_discard_body_it_cannot_read_is_400_and_changes_nothing(client, action, body):
    """Audit helper-88: unknown fields and bodies that are no object were dropped, and the
    action went ahead: a replay without its audit note, a discard asked as a dry run done for
    real."""
    sub = SubscriptionFactory()
    delivery_id = dead_letter(sub)
    path = replay_path(sub, delivery_id) if action == "replay" else discard_path(sub, delivery_id)

    response = call(client, "post", path, body, key=operator())

    assert response.status_code == 400, response.content
    assert status_of(delivery_id) == "DeadLettered"


def test_a_mistyped_subscription_name_is_404_naming_the_ones_it_resembles(client):
    """The 404 said only that no subscription had the name (newcomer review, helper-139)."""
    SubscriptionFactory(name="orders.email")

    response = call(client, "get", "/subscriptions/orders.emial/stats", key=reader())

    assert response.status_code == 404
    assert "Did you mean 'orders.email'?" in response.json()["detail"]


def test_a_limited_key_is_told_no_name_beyond_its_limit_in_a_404(client):
    """Suggestions come from the subscriptions the caller may read: a key limited to some is
    never told the names of the others."""
    SubscriptionFactory(name="orders.email")
    SubscriptionFactory(name="orders.emails")
    key = reader(subscriptions=["orders.emailz", "orders.emails"])

    response = call(client, "get", "/subscriptions/orders.emailz/stats", key=key)

    assert response.status_code == 404
    detail = response.json()["detail"]
    assert "'orders.emails'" in detail and "'orders.email'" not in detail


def test_replay_on_an_unknown_subscription_is_404(client):
    sub = SubscriptionFactory(name="real.sub")
    delivery_id = dead_letter(sub)

    response = call(
        client,
        "post",
        f"/subscriptions/no.such-sub/deliveries/{delivery_id}/replay",
        key=operator(),
    )

    assert response.status_code == 404
    assert status_of(delivery_id) == "DeadLettered"


@pytest.mark.parametrize(
    "make_key",
    [
        pytest.param(lambda sub: ApiKeyFactory(scopes=[READ, PUBLISH]), id="wrong-scope"),
        pytest.param(lambda sub: operator(subscriptions=["some.other-sub"]), id="outside-limit"),
        pytest.param(
            lambda sub: operator(owner=owner_with(READ_PERMISSION, PAYLOAD_PERMISSION)),
            id="owner-lacks-operate-permission",
        ),
    ],
)
def test_replay_and_discard_refused_are_403_and_change_nothing(client, make_key):
    sub = SubscriptionFactory()
    delivery_id = dead_letter(sub)
    key = make_key(sub)

    replayed = call(client, "post", replay_path(sub, delivery_id), key=key)
    discarded = call(client, "post", discard_path(sub, delivery_id), {"reason": "x"}, key=key)

    assert replayed.status_code == 403 and discarded.status_code == 403
    assert status_of(delivery_id) == "DeadLettered"


def test_replay_and_discard_without_credentials_are_401(client):
    sub = SubscriptionFactory()
    delivery_id = dead_letter(sub)

    assert call(client, "post", replay_path(sub, delivery_id)).status_code == 401
    assert call(client, "post", discard_path(sub, delivery_id), {"reason": "x"}).status_code == 401
    assert status_of(delivery_id) == "DeadLettered"


# -- discard ----------------------------------------------------------------------------------


def test_discard_of_a_pending_delivery_discards_it(client):
    sub = SubscriptionFactory()
    delivery_id = pending(sub)

    response = call(
        client, "post", discard_path(sub, delivery_id), {"reason": "spam"}, key=operator()
    )

    assert response.status_code == 200, response.content
    assert response.json() == {
        "supported": True,
        "discarded": True,
        "cancelRequested": False,
        "holdsKey": False,
    }
    assert status_of(delivery_id) == "Discarded"


def test_discard_of_an_in_flight_delivery_requests_a_cancel(client):
    sub = SubscriptionFactory()
    delivery_id = pending(sub)
    [claimed] = Receiver(sub.id).receive(1).deliveries

    response = call(
        client, "post", discard_path(sub, claimed.delivery_id), {"reason": "stuck"}, key=operator()
    )

    assert response.json() == {
        "supported": True,
        "discarded": True,
        "cancelRequested": True,
        "holdsKey": False,
    }
    assert Delivery.objects.get(pk=delivery_id).cancel_requested_at is not None


def test_discard_of_a_delivery_an_open_transaction_holds_is_409_at_once_and_changes_nothing(
    client,
):
    sub = SubscriptionFactory()
    delivery_id = pending(sub)
    [claimed] = Receiver(sub.id).receive(1).deliveries

    with row_held(claimed.delivery_id):
        began = time.monotonic()
        response = call(
            client, "post", discard_path(sub, delivery_id), {"reason": "stuck"}, key=operator()
        )
        waited = time.monotonic() - began

    assert response.status_code == 409, response.content
    assert waited < 4, f"the request waited {waited:.1f} s for the transaction"
    body = response.json()
    assert body["deliveryId"] == delivery_id and "try again" in body["detail"].lower()
    assert Delivery.objects.get(pk=delivery_id).cancel_requested_at is None


@pytest.mark.parametrize(
    "body", [None, {}, {"reason": ""}, {"reason": "   "}, {"reason": "x" * 1001}]
)
def test_discard_needs_a_reason_of_at_most_1000_characters(client, body):
    sub = SubscriptionFactory()
    delivery_id = pending(sub)

    response = call(client, "post", discard_path(sub, delivery_id), body, key=operator())

    assert response.status_code == 400
    assert status_of(delivery_id) == "Pending"


# -- sessions ---------------------------------------------------------------------------------


def test_a_session_user_with_the_permission_reads_stats(client):
    SubscriptionFactory()
    client.force_login(owner_with(READ_PERMISSION))

    assert call(client, "get", "/subscriptions/stats").status_code == 200


def test_a_session_user_without_the_permission_is_403(client):
    SubscriptionFactory()
    client.force_login(UserFactory(is_staff=True))

    assert call(client, "get", "/subscriptions/stats").status_code == 403


def csrf_client(user: Any) -> tuple[Client, str]:
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    token = _get_new_csrf_string()
    client.cookies[django_settings.CSRF_COOKIE_NAME] = token
    return client, token


def test_a_session_post_without_the_csrf_token_is_403_and_changes_nothing():
    sub = SubscriptionFactory()
    delivery_id = dead_letter(sub)
    client, _ = csrf_client(owner_with(*ALL_PERMISSIONS))

    response = client.post(
        f"/work-queue{replay_path(sub, delivery_id)}", data="{}", content_type="application/json"
    )

    assert response.status_code == 403
    assert status_of(delivery_id) == "DeadLettered"


def test_a_session_post_with_the_csrf_token_replays_as_the_session_user():
    sub = SubscriptionFactory()
    delivery_id = dead_letter(sub)
    user = owner_with(*ALL_PERMISSIONS)
    client, token = csrf_client(user)

    response = client.post(
        f"/work-queue{replay_path(sub, delivery_id)}",
        data="{}",
        content_type="application/json",
        headers={"X-CSRFToken": token},
    )

    assert response.status_code == 200, response.content
    assert response.json()["replayed"] is True
    assert Delivery.objects.get(pk=delivery_id).resolved_by == user.username


# -- validate bindings and health -------------------------------------------------------------


def host(instance_id: str, subscriptions: list[dict[str, Any]], **fields: Any) -> HostRecord:
    now = timezone.now()
    values = {
        "hostname": "worker-1",
        "pid": 4242,
        "started_at": now - dt.timedelta(minutes=5),
        "last_seen_at": now,
        "subscriptions": subscriptions,
        "handler_keys": ["tests.noop"],
        **fields,
    }
    return HostRecord.objects.create(instance_id=instance_id, **values)


#: What /health adds to a subscription none of whose handlers runs (see test_stuck_handlers).
NO_RUNS = {"oldestRunSeconds": None, "stuckCount": 0, "stuckRuns": []}


def running(name: str, in_flight: int = 0) -> dict[str, Any]:
    return {
        "name": name,
        "state": "Running",
        "reason": "",
        "in_flight": in_flight,
        "concurrency": 4,
    }


def test_validate_bindings_warns_about_a_handler_key_no_live_host_serves(client):
    SubscriptionFactory(name="unserved.sub", handler_key="nobody.runs.this")
    SubscriptionFactory(name="served.sub", handler_key="tests.noop")
    host("a:1", [running("served.sub")])

    response = call(client, "get", "/bindings/validate", key=reader())

    assert response.status_code == 200, response.content
    by_subject = {i["subject"]: i for i in response.json()["issues"]}
    assert by_subject["subscription unserved.sub"]["severity"] == "Warning"
    assert "not registered in any live host" in by_subject["subscription unserved.sub"]["message"]
    assert "subscription served.sub" not in by_subject


def test_validate_bindings_for_an_unknown_transport_is_404(client):
    response = call(client, "get", "/bindings/validate", key=reader(), transport="Nowhere")

    assert response.status_code == 404


def test_health_lists_live_hosts_and_each_subscriptions_state(client):
    host("a:1", [running("orders.sub", in_flight=2), running("mail.sub")])
    host(
        "b:2",
        [
            running("orders.sub", in_flight=1),
            {
                "name": "mail.sub",
                "state": "Paused",
                "reason": "Subscription is Paused",
                "in_flight": 0,
                "concurrency": 1,
            },
        ],
    )
    host("gone:3", [running("old.sub")], last_seen_at=timezone.now() - dt.timedelta(minutes=5))
    host("stopped:4", [running("old.sub")], stopped_at=timezone.now())

    response = call(client, "get", "/health", key=reader())

    assert response.status_code == 200, response.content
    body = response.json()
    assert body["status"] == "ok"
    assert [h["instanceId"] for h in body["hosts"]] == ["a:1", "b:2"]
    assert body["hosts"][0]["subscriptions"][0] == {
        "name": "orders.sub",
        "state": "Running",
        "reason": "",
        "inFlight": 2,
        "concurrency": 4,
        "oldestRunSeconds": None,
        "stuckCount": 0,
        "stuckRuns": [],
    }
    assert body["subscriptions"] == [
        {"name": "mail.sub", "state": "Running", "reason": "", "runningHosts": 1, "inFlight": 0}
        | NO_RUNS,
        {"name": "orders.sub", "state": "Running", "reason": "", "runningHosts": 2, "inFlight": 3}
        | NO_RUNS,
    ]


def test_a_subscription_paused_on_purpose_leaves_health_ok(client):
    """Hosts run every subscription by default (``*``) and list a Paused or Disabled one as
    Paused: health read that as degraded for as long as anything was paused on purpose."""
    paused = {
        "name": "mail.sub",
        "state": "Paused",
        "reason": "Subscription is Disabled",
        "in_flight": 0,
        "concurrency": 1,
    }
    host("a:1", [running("orders.sub"), paused])

    body = call(client, "get", "/health", key=reader()).json()

    assert body["status"] == "ok"
    assert [(s["name"], s["state"]) for s in body["subscriptions"]] == [
        ("mail.sub", "Paused"),
        ("orders.sub", "Running"),
    ]


def test_health_is_degraded_when_a_subscription_runs_nowhere_and_down_without_hosts(client):
    key = reader()
    assert call(client, "get", "/health", key=key).json() == {
        "status": "down",
        "hosts": [],
        "subscriptions": [],
        "databaseWarnings": [],
    }

    host(
        "a:1",
        [
            {
                "name": "mail.sub",
                "state": "HandlerNotRegistered",
                "reason": "no handler",
                "in_flight": 0,
                "concurrency": 1,
            }
        ],
    )

    body = call(client, "get", "/health", key=key).json()
    assert body["status"] == "degraded"
    assert body["subscriptions"][0]["state"] == "HandlerNotRegistered"
    assert body["subscriptions"][0]["reason"] == "no handler"


def test_due_work_that_no_live_host_runs_degrades_health_and_warns_in_validate_bindings(client):
    served = SubscriptionFactory(name="orders.sub")
    unserved = SubscriptionFactory(name="audit.sub")
    paused = SubscriptionFactory(name="paused.sub")
    disabled = SubscriptionFactory(name="disabled.sub")
    idle = SubscriptionFactory(name="idle.sub")  # no host either, but nothing is due
    for sub in (served, unserved, unserved, paused, disabled):
        pending(sub)
    # Work was due before they were stopped on purpose: that is not a problem to report.
    Subscription.objects.filter(pk=paused.pk).update(status="Paused")
    Subscription.objects.filter(pk=disabled.pk).update(status="Disabled")
    host("a:1", [running("orders.sub")])
    key = reader()

    body = call(client, "get", "/health", key=key).json()
    assert body["status"] == "degraded"
    assert body["subscriptions"] == [
        {
            "name": "audit.sub",
            "state": "NotRunning",
            "reason": "No live host runs it; 2 deliveries are due.",
            "runningHosts": 0,
            "inFlight": 0,
        }
        | NO_RUNS,
        {"name": "orders.sub", "state": "Running", "reason": "", "runningHosts": 1, "inFlight": 0}
        | NO_RUNS,
    ]

    issues = call(client, "get", "/bindings/validate", key=key).json()["issues"]
    due = [i for i in issues if "deliveries are due" in i["message"]]
    assert [(i["severity"], i["subject"]) for i in due] == [("Warning", "subscription audit.sub")]
    assert "workqueue_host -s audit.sub" in due[0]["message"]
    assert not {i["subject"] for i in issues} & {
        f"subscription {s.name}" for s in (paused, disabled, idle)
    }

    # Once a live host runs it, the same backlog is served work, not a problem.
    host("b:2", [running("audit.sub")])
    assert call(client, "get", "/health", key=key).json()["status"] == "ok"
    issues = call(client, "get", "/bindings/validate", key=key).json()["issues"]
    assert not [i for i in issues if "deliveries are due" in i["message"]]


def test_due_work_with_no_live_host_at_all_is_listed_while_health_is_down(client):
    pending(SubscriptionFactory(name="audit.sub"))

    body = call(client, "get", "/health", key=reader()).json()

    assert body["status"] == "down"
    assert [(s["name"], s["state"]) for s in body["subscriptions"]] == [("audit.sub", "NotRunning")]
    limited = call(client, "get", "/health", key=reader(subscriptions=["other.sub"])).json()
    assert limited["subscriptions"] == []


def test_work_held_by_hosts_that_are_gone_is_listed_as_waiting_for_a_host(client):
    """Every host killed mid-work: an Exclusive subscription's deliveries sat InFlight under
    leases no host would renew, the rest of their keys behind them, and nothing was due, so
    /health and validate-bindings reported nothing and the alert on due work could not fire."""
    sub = SubscriptionFactory(name="ledger.sub", partition_mode="Exclusive")
    for n in range(2):
        publish(sub.topic.name, {"n": n}, partition_key="acct")
    Receiver(sub.id, "killed-host").receive(1)  # its host then died: no record is live

    body = call(client, "get", "/health", key=reader()).json()
    issues = call(client, "get", "/bindings/validate", key=reader()).json()["issues"]

    [entry] = body["subscriptions"]
    assert (entry["name"], entry["state"]) == ("ledger.sub", "NotRunning")
    assert entry["reason"] == "No live host runs it; 1 delivery held by hosts no longer seen."
    assert any("1 delivery held by hosts no longer seen" in i["message"] for i in issues)


def test_work_in_flight_on_a_draining_live_host_is_not_called_held_by_hosts_gone(client):
    """A host draining lists its subscriptions Paused while it still holds their leases: its
    in-flight work was reported as held by hosts no longer seen."""
    sub = SubscriptionFactory(name="ledger.sub")
    publish(sub.topic.name, {"n": 1})
    Receiver(sub.id, "draining-host").receive(1)
    draining = {"name": "ledger.sub", "state": "Paused", "reason": "Host is shut down"}
    host("a:1", [{**draining, "in_flight": 1, "concurrency": 1}])

    issues = call(client, "get", "/bindings/validate", key=reader()).json()["issues"]

    assert not [i for i in issues if "held by hosts no longer seen" in i["message"]]


def test_health_with_a_key_limited_to_subscriptions_shows_only_those(client):
    host("a:1", [running("orders.sub"), running("mail.sub")])

    body = call(client, "get", "/health", key=reader(subscriptions=["mail.sub"])).json()

    assert [s["name"] for s in body["subscriptions"]] == ["mail.sub"]
    assert [s["name"] for s in body["hosts"][0]["subscriptions"]] == ["mail.sub"]


def test_health_without_credentials_is_401(client):
    assert call(client, "get", "/health").status_code == 401


# -- failures stay private --------------------------------------------------------------------


def test_with_the_database_away_every_endpoint_is_503_not_500(client):
    """The API key lookup and Django's own reads raise Django's OperationalError, which the
    catch-all turned into 500: a load balancer could not tell an outage from a bug."""
    key = reader()
    connection.close()
    get_driver().close_all()
    with queue_connection_settings(options={}, PORT="1"):  # nothing listens there
        answers = {
            path: call(client, "get", path, key=key).status_code
            for path in ("/health", "/metrics", "/subscriptions/stats")
        }

    assert answers == {"/health": 503, "/metrics": 503, "/subscriptions/stats": 503}


def test_a_database_failure_is_503_without_internals(client, monkeypatch):
    from workqueue.exceptions import DriverError

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise DriverError("connection to 10.0.0.7:5432 refused (user=wq_runtime)")

    monkeypatch.setattr(subscriptions_api.operations, "backlog", fail)
    sub = SubscriptionFactory()

    response = call(client, "get", f"/subscriptions/{sub.name}/backlog", key=reader())

    assert response.status_code == 503
    assert "10.0.0.7" not in response.content.decode()
    assert set(response.json()) == {"detail"}


def test_an_unknown_delivery_id_is_not_confused_with_an_unknown_subscription(client):
    sub = SubscriptionFactory()

    response = call(
        client, "post", discard_path(sub, str(uuid.uuid4())), {"reason": "x"}, key=operator()
    )

    assert response.status_code == 200
    assert response.json() == {
        "supported": True,
        "discarded": False,
        "cancelRequested": False,
        "holdsKey": False,
    }
