"""Attacks on the operator endpoints by callers holding a valid key, each refused, with the
legitimate caller shown to keep what it needs."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.urls import reverse
from django.utils import timezone

from tests.factories import (
    ALL_PERMISSIONS,
    ApiKeyFactory,
    SubscriptionFactory,
    TopicFactory,
    TransportFactory,
    UserFactory,
)
from tests.support.api import call
from tests.support.memory import SWOLLEN_PAYLOAD, peak_bytes
from tests.support.queue import dead_letter, pending
from workqueue.driver.base import SparseIndex
from workqueue.exceptions import PermissionDeniedError
from workqueue.models import ApiKey, Delivery, HostRecord, Message
from workqueue.models.apikeys import hash_key
from workqueue.operators import operations
from workqueue.operators.permissions import (
    OPERATE,
    OPERATE_PERMISSION,
    PUBLISH,
    READ,
    READ_PERMISSION,
    Actor,
)
from workqueue.types import MAX_PAYLOAD_BYTES

pytestmark = pytest.mark.usefixtures("queue_db")

# Spelled out: the tests pin the permission's public name, not whatever the constant holds.
OPERATE_SUBSCRIPTION = "workqueue.operate_subscription"


def limited_reader() -> Any:
    return ApiKeyFactory(scopes=[READ], subscriptions=["mine.sub"])


def unrestricted_reader() -> Any:
    return ApiKeyFactory(scopes=[READ])


# -- item 10: a key limited to subscriptions sees only their part of the system --------------


@pytest.fixture
def topology(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two subscriptions with an issue each, on FIFO topics (a Warning each), one of them on a
    disabled second transport, and a database-wide finding."""
    SubscriptionFactory(
        name="mine.sub", handler_key="mine.handler", topic=TopicFactory(name="mine", is_fifo=True)
    )
    other = TransportFactory(name="Other", status="Disabled")
    SubscriptionFactory(
        name="theirs.sub",
        handler_key="theirs.handler",
        topic=TopicFactory(name="theirs", is_fifo=True, transport=other),
    )
    sparse = [SparseIndex("wq_dlv_claim_keyless_ix", pages=9000, entries=3)]
    monkeypatch.setattr(operations.transport, "sparse_queue_indexes", lambda: sparse)


def subjects(response: Any) -> set[str]:
    assert response.status_code == 200, response.content
    return {issue["subject"] for issue in response.json()["issues"]}


def test_a_limited_key_sees_only_binding_issues_of_its_subscriptions(client, topology):
    limited = call(client, "get", "/bindings/validate", key=limited_reader())

    assert subjects(limited) == {"subscription mine.sub", "topic mine"}
    assert "theirs" not in limited.content.decode()
    assert "wq_dlv_claim_keyless_ix" not in limited.content.decode()


def test_a_limited_key_cannot_probe_transports_outside_its_subscriptions(client, topology):
    key = limited_reader()

    outside = call(client, "get", "/bindings/validate", key=key, transport="Other")
    unknown = call(client, "get", "/bindings/validate", key=key, transport="Nowhere")
    own = call(client, "get", "/bindings/validate", key=key, transport="Database")

    # An existing transport the key cannot see answers exactly like one that does not exist.
    assert (outside.status_code, unknown.status_code) == (404, 404)
    assert outside.json()["detail"].replace("Other", "Nowhere") == unknown.json()["detail"]
    assert subjects(own) == {"subscription mine.sub", "topic mine"}


def test_an_unrestricted_key_still_sees_every_binding_issue(client, topology):
    response = call(client, "get", "/bindings/validate", key=unrestricted_reader())

    assert subjects(response) == {
        "database",
        "transport Other",
        "topic mine",
        "topic theirs",
        "subscription mine.sub",
        "subscription theirs.sub",
    }


def host(
    instance_id: str,
    names: list[str],
    hostname: str,
    pid: int,
    *,
    subscriptions: Any = None,
    handler_keys: Any = None,
) -> HostRecord:
    """A live host running ``names`` (or recording ``subscriptions`` as given)."""
    now = timezone.now()
    return HostRecord.objects.create(
        instance_id=instance_id,
        hostname=hostname,
        pid=pid,
        started_at=now - dt.timedelta(minutes=5),
        last_seen_at=now,
        subscriptions=[
            {"name": name, "state": "Running", "reason": "", "in_flight": 0, "concurrency": 2}
            for name in names
        ]
        if subscriptions is None
        else subscriptions,
        handler_keys=[] if handler_keys is None else handler_keys,
    )


@pytest.fixture
def hosts() -> None:
    host("db-worker-7:4242:aaaa1111", ["mine.sub", "theirs.sub"], "db-worker-7", 4242)
    host("pay-worker-3:77:bbbb2222", ["theirs.sub"], "pay-worker-3", 77)


def test_a_limited_key_sees_hosts_only_through_its_subscriptions_without_names_or_pids(
    client, hosts
):
    response = call(client, "get", "/health", key=limited_reader())

    assert response.status_code == 200, response.content
    body = response.json()
    (shown,) = body["hosts"]
    assert (shown["hostname"], shown["pid"]) == (None, None)
    assert [s["name"] for s in shown["subscriptions"]] == ["mine.sub"]
    assert [s["name"] for s in body["subscriptions"]] == ["mine.sub"]
    text = json.dumps(body)
    for secret in ["db-worker-7", "4242", "aaaa1111", "pay-worker-3", "theirs"]:
        assert secret not in text, secret
    # A pseudonym, stable across calls, so a caller can still tell hosts apart over time.
    again = call(client, "get", "/health", key=limited_reader()).json()
    assert again["hosts"][0]["instanceId"] == shown["instanceId"]


def test_a_limited_key_reads_why_a_subscription_fails_without_the_errors_text(client):
    """Audit helper-88: a host records why a subscription is not claiming with the error's text,
    which can name the database's host and address: /health passed it to keys it shows no
    hostname to."""
    failing = (
        "Not claiming: receive failed: connection to server at "
        '"db-primary.internal" (10.20.30.40), port 5432 failed: Connection refused'
    )
    host(
        "db-worker-7:4242:aaaa1111",
        ["mine.sub"],
        "db-worker-7",
        4242,
        subscriptions=[
            {"name": "mine.sub", "state": "Error", "reason": failing, "in_flight": 0},
        ],
    )

    limited = call(client, "get", "/health", key=limited_reader()).json()
    unrestricted = call(client, "get", "/health", key=unrestricted_reader()).json()

    (shown,) = limited["subscriptions"]
    assert shown["reason"].startswith("Not claiming: receive failed (")
    for secret in ["db-primary", "10.20.30.40"]:
        assert secret not in json.dumps(limited), secret
    assert unrestricted["subscriptions"][0]["reason"] == failing


def test_a_limited_key_is_told_no_other_subscriptions_name_in_a_hosts_suggestion(client, make_host):
    """Review helper-167: a host asked to run a subscription that does not exist (retired, not
    synced yet) records "Subscription not found; did you mean <near names>?" picked among
    every subscription, and /health passed it to a key limited to the missing name, where
    the API's own 404 suggests only names the key may see."""
    SubscriptionFactory(name="payroll.salaries-ceo", topic=TopicFactory(name="payroll"))
    host = make_host([{"name": "payroll.salaries-cfo"}])  # retired; the key still names it
    host.start()
    host.record_health()
    key = ApiKeyFactory(scopes=[READ], subscriptions=["payroll.salaries-cfo"])

    limited = call(client, "get", "/health", key=key).json()
    unrestricted = call(client, "get", "/health", key=unrestricted_reader()).json()

    (entry,) = limited["subscriptions"]
    assert entry["reason"] == "Subscription not found"
    assert "payroll.salaries-ceo" not in json.dumps(limited)
    assert "payroll.salaries-ceo" in json.dumps(unrestricted)  # told to who may see it


def test_an_unrestricted_key_still_sees_every_host_by_name_and_pid(client, hosts):
    body = call(client, "get", "/health", key=unrestricted_reader()).json()

    assert [(h["instanceId"], h["hostname"], h["pid"]) for h in body["hosts"]] == [
        ("db-worker-7:4242:aaaa1111", "db-worker-7", 4242),
        ("pay-worker-3:77:bbbb2222", "pay-worker-3", 77),
    ]


# -- item 11: operating needs its own permission, not the right to edit subscriptions --------


def operate_key(*perms: str) -> Any:
    return ApiKeyFactory(scopes=[OPERATE], owner=UserFactory(perms=list(perms)))


def test_a_key_whose_owner_may_only_edit_subscriptions_cannot_replay_or_discard(client):
    sub = SubscriptionFactory()
    delivery_id = dead_letter(sub)
    key = operate_key(READ_PERMISSION, "workqueue.change_subscription")
    path = f"/subscriptions/{sub.name}/deliveries/{delivery_id}"

    replayed = call(client, "post", f"{path}/replay", {"note": "sneaky"}, key=key)
    discarded = call(client, "post", f"{path}/discard", {"reason": "sneaky"}, key=key)

    assert (replayed.status_code, discarded.status_code) == (403, 403)
    assert "workqueue.operate_subscription" in replayed.json()["detail"]
    assert Delivery.objects.get(pk=delivery_id).status == "DeadLettered"


def test_a_key_whose_owner_may_operate_replays_and_discards(client):
    sub = SubscriptionFactory()
    first, second = dead_letter(sub), dead_letter(sub)
    key = operate_key(OPERATE_SUBSCRIPTION)
    path = f"/subscriptions/{sub.name}/deliveries"

    replayed = call(client, "post", f"{path}/{first}/replay", {"note": "fixed"}, key=key)
    discarded = call(client, "post", f"{path}/{second}/discard", {"reason": "dupe"}, key=key)

    assert replayed.json() == {"supported": True, "replayed": True}
    assert discarded.json() == {
        "supported": True,
        "discarded": True,
        "cancelRequested": False,
        "holdsKey": False,
    }


def test_the_operator_service_holds_a_user_to_the_operate_permission():
    sub = SubscriptionFactory()
    delivery_id = dead_letter(sub)
    editor = Actor(user=UserFactory(perms=["workqueue.change_subscription"]))
    operator = Actor(user=UserFactory(perms=[OPERATE_SUBSCRIPTION]))

    with pytest.raises(PermissionDeniedError, match=r"workqueue\.operate_subscription"):
        operations.replay(sub.name, delivery_id, actor=editor)
    with pytest.raises(PermissionDeniedError, match=r"workqueue\.operate_subscription"):
        operations.discard(sub.name, delivery_id, reason="x", actor=editor)
    assert operations.replay(sub.name, delivery_id, actor=operator).replayed


def test_the_operate_permission_is_declared_on_subscriptions():
    assert OPERATE_PERMISSION == OPERATE_SUBSCRIPTION
    permission = Permission.objects.get(
        content_type__app_label="workqueue", codename="operate_subscription"
    )
    assert permission.content_type.model == "subscription"


# -- a limit confines every scope a key holds ------------------------------------------------


def _key_issued_before_limits_covered_scopes(**fields: Any) -> Any:
    """A key as an earlier release issued it: limited in one dimension only. Written directly,
    since issuing one is refused now."""
    raw = f"wq_0badc0de_{'k' * 43}"
    key = ApiKey.objects.create(
        owner=UserFactory(perms=ALL_PERMISSIONS),
        prefix="0badc0de",
        key_hash=hash_key(raw),
        **fields,
    )
    key.raw_key = raw
    return key


def test_a_key_limited_to_topics_cannot_read_or_operate_other_topics_subscriptions(client):
    """``--topics orders --scopes workqueue:read workqueue:operate`` looked confined to orders,
    and read and discarded the dead letters of every subscription of every topic."""
    theirs = SubscriptionFactory(name="billing.charge", topic=TopicFactory(name="billing"))
    delivery_id = dead_letter(theirs)
    key = _key_issued_before_limits_covered_scopes(
        scopes=[READ, OPERATE], topics=["orders"], subscriptions=[]
    )

    listed = call(client, "get", f"/subscriptions/{theirs.name}/dead-letters", key=key)
    discarded = call(
        client,
        "post",
        f"/subscriptions/{theirs.name}/dead-letters/discard",
        {"filter": {}, "reason": "x"},
        key=key,
    )

    assert (listed.status_code, discarded.status_code) == (403, 403)
    assert "--subscriptions" in discarded.json()["detail"]
    assert Delivery.objects.get(pk=delivery_id).status == "DeadLettered"


def test_a_key_limited_to_subscriptions_cannot_publish_to_every_topic(client):
    topic = TopicFactory(name="payments", allow_external_publish=True)
    SubscriptionFactory(topic=topic)
    key = _key_issued_before_limits_covered_scopes(
        scopes=[PUBLISH], topics=[], subscriptions=["mine.sub"]
    )

    published = call(
        client, "post", f"/topics/{topic.name}/messages", {"messages": [{"payload": {}}]}, key=key
    )

    assert published.status_code == 403
    assert "--topics" in published.json()["detail"]
    assert not Message.objects.filter(topic=topic).exists()


@pytest.mark.parametrize(
    ("scopes", "topics", "subscriptions", "fix"),
    [
        ([READ], ["orders"], [], "--subscriptions"),
        ([PUBLISH, OPERATE], ["orders"], [], "--subscriptions"),
        ([PUBLISH], [], ["orders.ship"], "--topics"),
    ],
)
def test_a_key_whose_limit_leaves_a_scope_unconfined_is_not_issued(
    scopes, topics, subscriptions, fix
):
    with pytest.raises(ValueError, match=fix):
        ApiKey.objects.issue(UserFactory(), scopes, topics=topics, subscriptions=subscriptions)
    assert not ApiKey.objects.exists()


def test_keys_limited_for_every_scope_they_hold_are_issued_and_work(client):
    mine = SubscriptionFactory(
        name="orders.ship", topic=TopicFactory(name="orders", allow_external_publish=True)
    )
    key = ApiKeyFactory(scopes=[PUBLISH, READ], topics=["orders"], subscriptions=["orders.ship"])

    published = call(
        client, "post", "/topics/orders/messages", {"messages": [{"payload": {}}]}, key=key
    )
    stats = call(client, "get", f"/subscriptions/{mine.name}/stats", key=key)

    assert (published.status_code, stats.status_code) == (202, 200)


# -- host records are the hosts' own word ------------------------------------------------------


@pytest.mark.parametrize(
    ("subscriptions", "handler_keys"),
    [
        ([{"name": "mine.sub", "state": "Running", "in_flight": "a", "concurrency": None}], 7),
        ({"name": "mine.sub"}, "workqueue.tasks"),
        (["mine.sub", 3, {"name": ["x"], "state": {"y": 1}, "in_flight": -5}], [1, None]),
        (
            [
                {
                    "name": "mine.sub",
                    "state": "Running",
                    "oldest_run_seconds": "long",
                    "stuck_count": 1.5,
                    "stuck_runs": [{"delivery_id": 5}, "x", {"delivery_id": "d", "seconds": []}],
                },
                {"name": "mine.sub", "oldest_run_seconds": -3, "stuck_runs": {"d": 1}},
            ],
            [],
        ),
    ],
)
def test_a_malformed_host_record_breaks_no_operator_page(client, subscriptions, handler_keys):
    """The runtime role writes its hosts' records (grant-runtime: INSERT, UPDATE on the host
    table). One with a count that is no number made /health, the admin dashboard and
    validate-bindings answer 500 for every operator."""
    SubscriptionFactory(name="mine.sub")
    host("odd:1:cccc3333", [], "odd", 1, subscriptions=subscriptions, handler_keys=handler_keys)
    client.force_login(UserFactory(is_staff=True, perms=list(ALL_PERMISSIONS)))

    health = call(client, "get", "/health", key=unrestricted_reader())
    bindings = call(client, "get", "/bindings/validate", key=unrestricted_reader())
    dashboard = client.get(reverse("admin:workqueue_dashboard"))

    assert (health.status_code, bindings.status_code, dashboard.status_code) == (200, 200, 200)


def test_a_session_form_post_to_an_operator_endpoint_is_a_400_not_a_500(caplog):
    """Audit helper-137: the session's CSRF check reads request.POST, which for a form post
    (multipart) consumes the body; django-ninja then read request.body, Django raised
    RawPostDataException, and the API answered 500 with an ERROR and its traceback."""
    from django.test import Client

    client = Client(enforce_csrf_checks=True)
    client.force_login(UserFactory(is_staff=True, perms=ALL_PERMISSIONS))
    client.get("/work-queue/docs")  # the docs page sets the CSRF cookie, as in a browser
    token = client.cookies["csrftoken"].value
    subscription = SubscriptionFactory()

    response = client.post(
        f"/work-queue/subscriptions/{subscription.name}/pending/discard",
        data={"csrfmiddlewaretoken": token, "reason": "form"},  # multipart/form-data
    )

    assert response.status_code == 400, (response.status_code, response.content)
    assert "application/json" in response.json()["detail"]
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_no_cache_keeps_what_the_api_answers_a_signed_in_browser(client):
    """Review helper-143: the admin's pages are sent never to be cached, the API's answers
    were sent with no Cache-Control at all, so a browser that opened a dead-letter listing
    from the dashboard kept its payloads in its cache and history after signing out. Seen
    failing: no Cache-Control header."""
    subscription = SubscriptionFactory()
    dead_letter(subscription, {"card": "4111111111111111"})
    client.force_login(UserFactory(is_staff=True, perms=list(ALL_PERMISSIONS)))

    answers = {
        path: client.get(f"/work-queue{path}")
        for path in (
            f"/subscriptions/{subscription.name}/dead-letters",
            "/subscriptions/stats",
            "/health",
            "/metrics",
            "/subscriptions/no.such/stats",
        )
    }
    asset = client.get("/work-queue/docs/assets/swagger-ui.css")
    asset.close()  # a file response: its file is not read here

    for path, answer in answers.items():
        directives = {d.strip() for d in answer.get("Cache-Control", "").split(",")}
        assert {"no-store", "private"} <= directives, (path, answer.status_code)
    assert answers[f"/subscriptions/{subscription.name}/dead-letters"].status_code == 200
    # Swagger UI's own files stay cacheable: they are the same for everyone.
    assert asset["Cache-Control"].startswith("public")


# -- what a bulk operation's filter and count reveal ------------------------------------------

CONTENT_FILTERS = {
    "errorContains": {"errorContains": "card 4"},
    "partitionKey": {"partitionKey": "customer-4"},
    "deadLetterReason": {"deadLetterReason": "Card 4111 declined"},
}


@pytest.mark.parametrize("content", CONTENT_FILTERS.values(), ids=CONTENT_FILTERS.keys())
def test_a_key_that_may_not_read_cannot_read_dead_letters_through_a_bulk_filters_count(
    client, content
):
    """Review helper-143: a key that may operate but not read got 403 listing the dead letters,
    yet a dry run filtered by error text (or key, or reason) answered how many matched: "card
    4" 1, "card 5" 0, which reads the error a character at a time. A filter on what dead
    letters hold needs the read scope and permission too; filters on nothing they hold (none,
    a time window) do not."""
    sub = SubscriptionFactory()
    dead_letter(
        sub, reason="Card 4111 declined", error="ValueError: card 4111", partition_key="customer-4"
    )
    path = f"/subscriptions/{sub.name}"
    operate_only = operate_key(OPERATE_SUBSCRIPTION)
    may_read = ApiKeyFactory(
        scopes=[OPERATE, READ], owner=UserFactory(perms=[OPERATE_SUBSCRIPTION, READ_PERMISSION])
    )
    dry_run = {"filter": content, "dryRun": True}
    discard = {"filter": content, "dryRun": True, "reason": "cleanup"}

    listed = call(client, "get", f"{path}/dead-letters", key=operate_only)
    counted = call(client, "post", f"{path}/dead-letters/replay", dry_run, key=operate_only)
    discarded = call(client, "post", f"{path}/dead-letters/discard", discard, key=operate_only)
    read_permission_only = operate_key(OPERATE_SUBSCRIPTION, READ_PERMISSION)
    scope_lacking = call(
        client, "post", f"{path}/dead-letters/replay", dry_run, key=read_permission_only
    )
    allowed = call(client, "post", f"{path}/dead-letters/replay", dry_run, key=may_read)
    unfiltered = call(
        client, "post", f"{path}/dead-letters/replay", {"dryRun": True}, key=operate_only
    )

    assert listed.status_code == 403
    assert (counted.status_code, discarded.status_code, scope_lacking.status_code) == (
        403,
        403,
        403,
    ), counted.content
    assert "workqueue:read" in counted.json()["detail"]
    assert allowed.json()["matched"] == 1
    assert unfiltered.json()["matched"] == 1


@pytest.mark.parametrize("content", ["errorContains", "partitionKey"])
def test_a_key_that_may_not_read_cannot_read_waiting_work_through_a_bulk_filters_count(
    client, content
):
    sub = SubscriptionFactory()
    pending(sub, partition_key="customer-4")
    body = {"filter": CONTENT_FILTERS[content], "dryRun": True, "reason": "cleanup"}
    path = f"/subscriptions/{sub.name}/pending/discard"

    refused = call(client, "post", path, body, key=operate_key(OPERATE_SUBSCRIPTION))
    unfiltered = call(
        client, "post", path, {**body, "filter": {}}, key=operate_key(OPERATE_SUBSCRIPTION)
    )

    assert refused.status_code == 403, refused.content
    assert unfiltered.json()["matched"] == 1


def test_an_admin_user_who_may_not_read_cannot_count_dead_letters_by_their_content():
    sub = SubscriptionFactory()
    dead_letter(sub, error="ValueError: card 4111")
    operate_only = Actor(user=UserFactory(perms=[OPERATE_SUBSCRIPTION]))
    probe = operations.DeadLetterSelection(error_contains="card 4")

    with pytest.raises(PermissionDeniedError, match=r"workqueue\.view_delivery"):
        operations.resolve_dead_letters(sub.name, "replay", probe, dry_run=True, actor=operate_only)
    everything = operations.resolve_dead_letters(
        sub.name, "replay", operations.DeadLetterSelection(), dry_run=True, actor=operate_only
    )
    assert everything.matched == 1


# -- a page of dead letters holds its payloads as text, and at most a budget of them ----------


def test_a_page_of_swollen_payloads_holds_the_web_process_to_megabytes_not_hundreds(client):
    """Review helper-167: each payload was decoded to Python objects, validated and encoded
    again, and JSON of empty objects grows some 25 times decoded: a reader with view_payload
    made one request of 16 such dead letters hold over 200 MB of the web process (500 of them
    gigabytes). A page carries its payloads as the stored text, and stops once they reach the
    page's budget; the rest follow by cursor, whole and once each."""
    sub = SubscriptionFactory(topic=TopicFactory(max_payload_bytes=MAX_PAYLOAD_BYTES))
    ids = sorted(dead_letter(sub, SWOLLEN_PAYLOAD) for _ in range(16))
    key, path = ApiKeyFactory(scopes=[READ]), f"/subscriptions/{sub.name}/dead-letters"

    first, peak = peak_bytes(lambda: call(client, "get", path, key=key, page_size=500))
    pages = [first.json()]
    while pages[-1]["nextCursor"]:
        cursor = pages[-1]["nextCursor"]
        pages.append(call(client, "get", path, key=key, page_size=500, cursor=cursor).json())

    assert first.status_code == 200, first.content[:500]
    assert peak < 48 * 2**20, f"one page held {peak / 2**20:.0f} MB"
    assert len(pages[0]["items"]) < len(ids), "all 16 payloads came in one page: no budget"
    items = [item for page in pages for item in page["items"]]
    assert [item["deliveryId"] for item in items] == ids
    assert all(item["message"]["payload"] == SWOLLEN_PAYLOAD for item in items)
