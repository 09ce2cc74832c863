"""The admin through Django's test client, for permitted and refused staff users.

Deliveries are made the real way (publish, then receive / dead-letter through the transport's
Receiver), which runs on the driver's own connection: these tests use committed data.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.contrib.staticfiles import finders
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

import workqueue
from tests.factories import SubscriptionFactory
from tests.support.queue import dead_letter
from tests.support.queue import pending as _pending
from tests.support.seeding import seed_deliveries
from workqueue import publish
from workqueue.admin import dashboard
from workqueue.models import ApiKey, Delivery, HostRecord, Subscription
from workqueue.models.apikeys import hash_key
from workqueue.models.hosts import database_now
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")

OPERATOR_PERMISSIONS = [
    "view_delivery",
    "view_message",
    "view_deduplication",
    "view_subscription",
    "operate_subscription",
    "view_topic",
    "view_transport",
]
QUEUE_CHANGELISTS = ["delivery", "message", "deduplication"]
TOPOLOGY_CHANGELISTS = ["subscription", "topic", "transport"]


def _staff(username: str, *codenames: str) -> User:
    user = User.objects.create_user(username, password="pw", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="workqueue", codename__in=codenames)
    )
    return user


@pytest.fixture
def operator_client(client):
    client.force_login(_staff("operator", *OPERATOR_PERMISSIONS))
    return client


@pytest.fixture
def reader_client(client):
    client.force_login(_staff("reader", "view_delivery", "view_message"))
    return client


@pytest.fixture
def refused_client(client):
    client.force_login(_staff("refused"))
    return client


def _url(name: str, *args: object) -> str:
    return reverse(f"admin:{name}", args=args)


def _in_flight(subscription: Subscription) -> str:
    delivery_id = _pending(subscription)
    claimed = Receiver(subscription.id).receive(1).deliveries
    assert [c.delivery_id for c in claimed] == [delivery_id]
    return delivery_id


def _messages(response) -> list[str]:
    return [str(m) for m in response.context["messages"]]


def _act(client, action: str, ids: list[str], **form: str):
    """The changelist's action POST; with ``post="yes"`` it is the confirmation POST."""
    data = {"action": action, "_selected_action": ids, **form}
    if "post" not in form:
        data["index"] = "0"
    return client.post(_url("workqueue_delivery_changelist"), data, follow="post" in form)


# -- rendering and permissions --------------------------------------------------------------


def test_changelists_render_for_a_permitted_staff_user(operator_client):
    dead_letter(SubscriptionFactory())

    for model in QUEUE_CHANGELISTS + TOPOLOGY_CHANGELISTS:
        response = operator_client.get(_url(f"workqueue_{model}_changelist"))
        assert response.status_code == 200, model


def test_a_staff_user_without_permissions_is_refused_everything(refused_client):
    dead_letter(SubscriptionFactory())

    for model in QUEUE_CHANGELISTS + TOPOLOGY_CHANGELISTS + ["apikey"]:
        assert refused_client.get(_url(f"workqueue_{model}_changelist")).status_code == 403
    assert refused_client.get(_url("workqueue_dashboard")).status_code == 403
    index = refused_client.get(_url("index"))
    assert index.status_code == 200
    assert _url("workqueue_dashboard") not in index.content.decode()


def test_deleting_a_subscription_or_topic_queue_rows_hold_is_refused_without_loading_them(
    admin_client, pg_conn, django_assert_max_num_queries
):
    """Audit helper-96: the delete confirmation (a GET is enough, and "Delete selected") loaded
    and listed every delivery or message protecting the row before saying no: for 200,000
    deliveries, 18 s and 700 MB of the web process. One existence check says it now, and how
    to retire the subscription."""
    subscription = SubscriptionFactory()
    seed_deliveries(pg_conn, subscription, 300, status="Pending")

    with django_assert_max_num_queries(12):
        page = admin_client.get(_url("workqueue_subscription_delete", subscription.pk))
    text = page.content.decode()
    assert f"retire-subscription {subscription.name}" in text
    assert "Delivery:" not in text  # no row listed
    with django_assert_max_num_queries(12):
        page = admin_client.get(_url("workqueue_topic_delete", subscription.topic_id))
    said = page.content.decode()
    assert "its messages or deduplication records" in said
    assert "never while one waits or is dead-lettered" in said  # review helper-164
    assert "retire-subscription" in said
    confirm = admin_client.post(
        _url("workqueue_subscription_changelist"),
        {"action": "delete_selected", "_selected_action": [subscription.pk]},
    )
    assert f"retire-subscription {subscription.name}" in confirm.content.decode()

    refused = admin_client.post(
        _url("workqueue_subscription_delete", subscription.pk), {"post": "yes"}
    )
    assert f"retire-subscription {subscription.name}" in refused.content.decode()
    assert Subscription.objects.filter(pk=subscription.pk).exists()


def test_the_delivery_list_reads_its_first_page_not_the_whole_table(operator_client, pg_conn):
    """Audit helper-96: ordered by order_key, which no index of all deliveries leads with, the
    default list sorted every delivery to show its first hundred (over a second at a few
    million). It walks the primary key now, newest first (ids are time-ordered)."""
    subscription = SubscriptionFactory()
    # Enough that reading the whole table costs the planner clearly more than walking the
    # index: at 5,000 it once chose a sort of every row on a loaded machine (a CI-like run).
    seed_deliveries(pg_conn, subscription, 20_000)
    pg_conn.execute("ANALYZE workqueue_delivery")
    with CaptureQueriesContext(connection) as queries:
        page = operator_client.get(_url("workqueue_delivery_changelist"))
    assert page.status_code == 200
    [listing] = [q["sql"] for q in queries if "LIMIT 100" in q["sql"]]
    plan = "\n".join(r[0] for r in pg_conn.execute("EXPLAIN ANALYZE " + listing).fetchall())
    read = [int(n) for n in re.findall(r"actual time=\S+ rows=(\d+)", plan)]
    assert max(read) <= 200, plan
    newest = Delivery.objects.order_by("-id").values_list("id", flat=True)[:3]
    assert [d.id for d in page.context["cl"].result_list[:3]] == list(newest)


def test_the_admin_index_links_the_dashboard_for_a_permitted_user(operator_client):
    index = operator_client.get(_url("index"))

    assert _url("workqueue_dashboard") in index.content.decode()


def test_queue_models_have_no_add_change_or_delete_even_for_a_superuser(admin_client):
    subscription = SubscriptionFactory()
    delivery_id = dead_letter(subscription)
    delivery = Delivery.objects.get(pk=delivery_id)

    for model, pk in [("delivery", delivery_id), ("message", delivery.message_id)]:
        assert admin_client.get(_url(f"workqueue_{model}_add")).status_code == 403
        assert admin_client.get(_url(f"workqueue_{model}_delete", pk)).status_code == 403
        page = admin_client.get(_url(f"workqueue_{model}_change", pk))
        assert page.status_code == 200
        assert page.context["has_change_permission"] is False
        assert 'name="_save"' not in page.content.decode()
        posted = admin_client.post(_url(f"workqueue_{model}_change", pk), {"status": "Pending"})
        assert posted.status_code == 403
    assert admin_client.get(_url("workqueue_deduplication_add")).status_code == 403
    changelist = admin_client.get(_url("workqueue_delivery_changelist"))
    actions = dict(changelist.context["action_form"].fields["action"].choices)
    assert "delete_selected" not in actions
    assert {"replay_deliveries", "discard_deliveries"} <= set(actions)
    assert Delivery.objects.get(pk=delivery_id).status == "DeadLettered"


def test_deliveries_filter_by_subscription_and_status_and_search_by_key_and_ids(operator_client):
    ordered = SubscriptionFactory(partition_mode="Ordered")
    other = SubscriptionFactory()
    dead = dead_letter(ordered, partition_key="venue-42", correlation_id="corr-7")
    waiting = _pending(ordered, partition_key="venue-42")
    elsewhere = _pending(other)
    changelist = _url("workqueue_delivery_changelist")

    def listed(query: dict[str, str]) -> set[str]:
        response = operator_client.get(changelist, query)
        assert response.status_code == 200
        return {str(d.pk) for d in response.context["cl"].result_list}

    assert listed({"subscription__id__exact": str(ordered.pk)}) == {dead, waiting}
    assert listed({"status__exact": "DeadLettered"}) == {dead}
    assert listed({"q": "venue-42"}) == {dead, waiting}
    assert listed({"q": "Venue-42"}) == set()  # keys compare byte for byte
    assert listed({"q": "corr-7"}) == {dead}
    assert listed({"q": elsewhere}) == {elsewhere}
    message_id = str(Delivery.objects.get(pk=dead).message_id)
    assert listed({"q": message_id}) == {dead}
    messages = operator_client.get(_url("workqueue_message_changelist"), {"q": "corr-7"})
    assert [str(m.pk) for m in messages.context["cl"].result_list] == [message_id]


def _breadcrumbs(page) -> str:
    """The page's breadcrumbs element, from its opening tag to its closing one."""
    html = page.content.decode()
    start = html.rindex("<", 0, html.index('class="breadcrumbs"'))
    tag = html[start + 1 : html.index(" ", start)]
    return html[start : html.index(f"</{tag}>", start)]


def test_the_queues_pages_draw_breadcrumbs_in_the_markup_of_the_admins_own(operator_client):
    """Django 6.1's admin stylesheet styles only a list of breadcrumbs (``ol.breadcrumbs``),
    earlier ones only a line of links (``div.breadcrumbs``): pages written the old way lost
    their styling on 6.1 (review helper-203)."""
    own = _breadcrumbs(operator_client.get(_url("workqueue_delivery_changelist")))
    subscription = SubscriptionFactory()
    pages = {
        "dashboard": operator_client.get(_url("workqueue_dashboard")),
        "action": _act(operator_client, "replay_deliveries", [dead_letter(subscription)]),
    }

    element = own[: own.index(" ")]
    for name, page in pages.items():
        trail = _breadcrumbs(page)
        assert trail.startswith(element), (name, trail, own)
        assert f'href="{reverse("admin:index")}"' in trail, (name, trail)
        assert 'href="/admin/workqueue/"' in trail, (name, trail)


def test_the_queues_pages_carry_no_inline_style_so_a_strict_csp_leaves_them_whole(
    operator_client,
):
    """A project that turns on Django 6's Content-Security-Policy without 'unsafe-inline'
    blocks <style> elements and style="" attributes: the dashboard lost its layout and its
    chart's legend, the forms their spacing (review helper-203). Their rules are a static
    file."""
    templates = Path(workqueue.__file__).parent / "templates" / "workqueue" / "admin"
    inline = {
        page.name: re.findall(r"<style\b|\sstyle=", page.read_text())
        for page in templates.glob("*.html")
    }
    assert not any(inline.values()), inline

    pages = {
        "dashboard": operator_client.get(_url("workqueue_dashboard")),
        "action": _act(operator_client, "replay_deliveries", [dead_letter(SubscriptionFactory())]),
    }
    for name, page in pages.items():
        [sheet] = re.findall(
            r'<link rel="stylesheet" href="/static/(workqueue/[^"]+)">', page.content.decode()
        )
        rules = Path(finders.find(sheet)).read_text()
        assert ".workqueue-legend .dead-lettered" in rules, name
        assert "#workqueue-action-form fieldset" in rules, name


# -- actions ----------------------------------------------------------------------------------


def test_replay_asks_for_a_note_then_replays_the_dead_letter_and_reports_each_row(
    operator_client,
):
    subscription = SubscriptionFactory()
    dead = dead_letter(subscription)
    pending = _pending(subscription)

    form = _act(operator_client, "replay_deliveries", [dead, pending])

    assert form.status_code == 200
    assert "workqueue/admin/delivery_action.html" in [t.name for t in form.templates]
    assert 'name="note"' in form.content.decode()
    assert Delivery.objects.get(pk=dead).status == "DeadLettered"  # nothing happened yet

    done = _act(operator_client, "replay_deliveries", [dead, pending], post="yes", note="fixed")

    assert done.status_code == 200
    assert _messages(done) == ["Replayed 1; not a dead letter: 1"]
    replayed = Delivery.objects.get(pk=dead)
    assert replayed.status == "Pending"
    assert replayed.is_replay and replayed.attempt_count == 0
    assert (replayed.resolved_by, replayed.resolution_note) == ("operator", "fixed")
    assert Delivery.objects.get(pk=pending).status == "Pending"
    history = LogEntry.objects.filter(object_id=str(dead))
    assert [(e.user.username, e.change_message) for e in history] == [
        ("operator", "Replayed (note: fixed)")
    ]
    assert not LogEntry.objects.filter(object_id=str(pending)).exists()


def test_discard_requires_a_reason_discards_pending_and_cancels_running(operator_client):
    waiting = SubscriptionFactory()
    running = SubscriptionFactory()
    pending = _pending(waiting)
    in_flight = _in_flight(running)

    missing = _act(operator_client, "discard_deliveries", [pending, in_flight], post="yes")

    assert missing.status_code == 200
    assert missing.context["form"].errors == {"reason": ["This field is required."]}
    assert Delivery.objects.get(pk=pending).status == "Pending"

    done = _act(
        operator_client, "discard_deliveries", [pending, in_flight], post="yes", reason="dupe"
    )

    assert _messages(done) == ["Discarded 1; cancel requested (running): 1"]
    discarded = Delivery.objects.get(pk=pending)
    assert (discarded.status, discarded.resolution_note) == ("Discarded", "dupe")
    cancelled = Delivery.objects.get(pk=in_flight)
    assert cancelled.status == "InFlight" and cancelled.cancel_requested_at is not None


def test_discard_asks_a_handler_that_holds_its_key_after_completing_to_stop(operator_client):
    """Review helper-199: the admin reported such a delivery "already finished"."""
    from django.db import transaction

    from workqueue.transport import Receiver

    subscription = SubscriptionFactory(partition_mode="Exclusive")
    publish(subscription.topic.name, {}, partition_key="k")
    receiver = Receiver(str(subscription.id), "host-a")
    (held,) = receiver.receive(1).deliveries
    with transaction.atomic():
        assert receiver.complete(held, connection=transaction.get_connection(), holding_key=True)

    for label in ("told to stop", "already told to stop"):
        done = _act(
            operator_client, "discard_deliveries", [held.delivery_id], post="yes", reason="3am"
        )
        assert _messages(done) == [
            f"Discarded 0; completed, its handler still running with the key: {label}: 1"
        ]
    row = Delivery.objects.get(pk=held.delivery_id)
    assert row.status == "Completed" and row.cancel_requested_at is not None


@pytest.mark.parametrize(
    ("action", "field"), [("replay_deliveries", "note"), ("discard_deliveries", "reason")]
)
def test_a_note_the_operation_would_refuse_is_the_forms_error_on_its_field(
    operator_client, action, field
):
    """Audit helper-132: the forms counted characters, the operations count an emoji as two,
    so 600 emoji passed the form and every row came back a bare "failed", never saying why."""
    dead = dead_letter(SubscriptionFactory())

    refused = _act(operator_client, action, [dead], post="yes", **{field: "\N{PILE OF POO}" * 600})

    assert "counts as two" in str(refused.context["form"].errors[field])
    assert Delivery.objects.get(pk=dead).status == "DeadLettered"


def test_a_reader_without_operate_permission_gets_no_actions(reader_client):
    dead = dead_letter(SubscriptionFactory())

    changelist = reader_client.get(_url("workqueue_delivery_changelist"))

    assert changelist.status_code == 200
    assert "action_form" not in changelist.context or changelist.context["action_form"] is None
    assert "replay_deliveries" not in changelist.content.decode()
    for form in ({}, {"post": "yes", "note": "sneaky"}):
        _act(reader_client, "replay_deliveries", [dead], **form)
    assert Delivery.objects.get(pk=dead).status == "DeadLettered"


def test_a_refused_user_cannot_post_an_action(refused_client):
    dead = dead_letter(SubscriptionFactory())

    response = _act(refused_client, "replay_deliveries", [dead])

    assert response.status_code == 403
    assert Delivery.objects.get(pk=dead).status == "DeadLettered"


# -- dashboard --------------------------------------------------------------------------------


def test_dashboard_shows_counts_blocked_keys_hosts_and_an_svg_chart(operator_client):
    ordered = SubscriptionFactory(partition_mode="Ordered")
    dead_letter(ordered, partition_key="k1")
    _pending(ordered, partition_key="k1")
    plain = SubscriptionFactory()
    receiver = Receiver(plain.id)
    _pending(plain)
    assert receiver.complete(receiver.receive(1).deliveries[0]).settled
    now = timezone.now()
    HostRecord.objects.create(
        instance_id="worker-1:42:abcd",
        hostname="worker-1",
        pid=42,
        started_at=now,
        last_seen_at=now,
        subscriptions=[{"name": plain.name, "state": "HandlerNotRegistered", "in_flight": 0}],
    )

    response = operator_client.get(_url("workqueue_dashboard"))

    assert response.status_code == 200
    rows = {row["stats"].subscription_name: row["stats"] for row in response.context["rows"]}
    assert (rows[ordered.name].pending, rows[ordered.name].dead_lettered) == (1, 1)
    assert rows[ordered.name].blocked_keys == 1
    assert rows[plain.name].completed_last_hour == 1
    assert response.context["chart"]["completed"] == 1
    assert response.context["chart"]["dead_lettered"] == 1
    (host,) = response.context["hosts"]
    assert host["record"].hostname == "worker-1" and not host["healthy"]
    html = response.content.decode()
    assert '<svg id="workqueue-chart"' in html and "<rect" in html
    assert "HandlerNotRegistered" in html and "needs attention" in html
    assert "<script" not in html.split('id="workqueue-dashboard"')[1]


def test_the_throughput_chart_counts_every_subscription_in_chunks(monkeypatch):
    """It counts along each subscription's index entries, a list of ids a query, which SQL
    Server caps at 2,100 parameters: a thousand subscriptions a query, the counts summed."""
    monkeypatch.setattr(dashboard, "SUBSCRIPTIONS_A_QUERY", 1)
    for _ in range(3):
        receiver = Receiver(SubscriptionFactory().id)
        _pending(Subscription.objects.get(pk=receiver.subscription_id))
        assert receiver.complete(receiver.receive(1).deliveries[0]).settled

    buckets = dashboard.throughput(database_now())

    assert sum(b.completed for b in buckets) == 3


def test_dashboard_lists_only_live_hosts(operator_client):
    stale = timezone.now() - timezone.timedelta(minutes=5)
    HostRecord.objects.create(
        instance_id="gone", hostname="gone", pid=1, started_at=stale, last_seen_at=stale
    )

    response = operator_client.get(_url("workqueue_dashboard"))

    assert response.context["hosts"] == []
    assert 'id="workqueue-no-hosts"' in response.content.decode()


def test_dashboard_says_how_long_ago_each_host_reported_by_the_databases_clock(operator_client):
    # Hosts stamp their reports with the database's clock; a web server whose own clock is off
    # must not show a live host as seen minutes ago (or in the future). A live host reported
    # within the last 45 s, so the age is shown in seconds.
    seen = database_now() - timezone.timedelta(seconds=20)
    HostRecord.objects.create(
        instance_id="w:1:a", hostname="w", pid=1, started_at=seen, last_seen_at=seen
    )

    response = operator_client.get(_url("workqueue_dashboard"))

    (host,) = response.context["hosts"]
    assert 20 <= host["seen_seconds_ago"] <= 25
    assert re.search(r"last seen 2[0-5]s ago", response.content.decode())


def test_dashboard_names_a_hosts_stuck_handler_runs_and_the_oldest_runs_age(operator_client):
    """An operator who opens the dashboard at 3 a.m. sees which delivery to cancel
    (helper-147; seen failing: the host read healthy, the run unnamed)."""
    now = database_now()
    HostRecord.objects.create(
        instance_id="w:1:a",
        hostname="w",
        pid=1,
        started_at=now,
        last_seen_at=now,
        subscriptions=[
            {
                "name": "orders.email",
                "state": "Running",
                "in_flight": 2,
                "oldest_run_seconds": 2412.6,
                "stuck_count": 1,
                "stuck_runs": [
                    {
                        "delivery_id": "7f9c0000-0000-4000-8000-000000000001",
                        "handler_key": "orders.send_email\u202e",
                        "seconds": 2412.6,
                        "threshold_seconds": 1800,
                    }
                ],
            }
        ],
    )

    response = operator_client.get(_url("workqueue_dashboard"))

    (host,) = response.context["hosts"]
    assert not host["healthy"]
    html = response.content.decode()
    assert "needs attention" in html and "40m 12s" in html
    assert "7f9c0000-0000-4000-8000-000000000001" in html and "orders.send_email" in html
    assert "\\u202e" in html and "\u202e" not in html  # a hostile key reads as written


# -- payloads -----------------------------------------------------------------------------


def test_payloads_are_hidden_without_view_payload(client):
    subscription = SubscriptionFactory()
    result = publish(subscription.topic.name, {"card": "secret-payload-value"})
    delivery = Delivery.objects.get(message_id=result.message_id)
    pages = [
        _url("workqueue_message_change", result.message_id),
        _url("workqueue_delivery_change", delivery.pk),
    ]

    client.force_login(_staff("no-payload", *OPERATOR_PERMISSIONS))
    for page in pages:
        response = client.get(page)
        assert response.status_code == 200
        assert "secret-payload-value" not in response.content.decode()

    client.force_login(_staff("payload", *OPERATOR_PERMISSIONS, "view_payload"))
    for page in pages:
        assert "secret-payload-value" in client.get(page).content.decode()


# -- topology -----------------------------------------------------------------------------


def _subscription_form(subscription: Subscription, **changes: object) -> dict[str, object]:
    data = {
        field: getattr(subscription, field)
        for field in [
            "name",
            "description",
            "partition_mode",
            "max_attempts",
            "backoff_base_seconds",
            "backoff_max_seconds",
            "lease_seconds",
            "heartbeat_mode",
            "host_type",
            "handler_key",
            "external_ref",
            "status",
        ]
    }
    data.update(
        topic=subscription.topic_id, filter="", binding_config="", max_processing_seconds=""
    )
    data.update(changes)
    return data


def test_subscription_clean_errors_are_shown_on_their_fields(admin_client):
    subscription = SubscriptionFactory()
    url = _url("workqueue_subscription_change", subscription.pk)

    response = admin_client.post(
        url,
        _subscription_form(
            subscription,
            backoff_base_seconds=100,
            backoff_max_seconds=10,
            handler_key="",
            filter='{"logic": "xor"}',
        ),
    )

    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert {"backoff_max_seconds", "handler_key", "filter"} <= set(errors)
    assert "Must be at least backoff_base_seconds" in errors["backoff_max_seconds"][0]


def test_partition_mode_cannot_change_once_deliveries_exist(admin_client):
    subscription = SubscriptionFactory()
    _pending(subscription)
    url = _url("workqueue_subscription_change", subscription.pk)

    response = admin_client.post(url, _subscription_form(subscription, partition_mode="Ordered"))

    assert response.status_code == 200
    assert "partition_mode" in response.context["adminform"].form.errors
    assert Subscription.objects.get(pk=subscription.pk).partition_mode == "None"


def test_a_valid_subscription_change_saves(admin_client):
    subscription = SubscriptionFactory()
    url = _url("workqueue_subscription_change", subscription.pk)

    response = admin_client.post(url, _subscription_form(subscription, max_attempts=9))

    assert response.status_code == 302
    assert Subscription.objects.get(pk=subscription.pk).max_attempts == 9


# -- API keys -----------------------------------------------------------------------------


def test_creating_an_api_key_shows_the_raw_key_once_and_never_the_hash(admin_client, admin_user):
    response = admin_client.post(
        _url("workqueue_apikey_add"),
        {
            "owner": admin_user.pk,
            "name": "ci",
            "scopes": ["workqueue:read", "workqueue:operate"],
            "topics": "",
            "subscriptions": "Orders.Billing, orders.billing",
            "expires_days": "30",
        },
    )

    # The key is drawn into this response only, never parked in messages (cookie or session).
    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]
    key = ApiKey.objects.get()
    raw_key = response.context["raw_key"]
    assert '<code id="workqueue-new-api-key"' in response.content.decode()
    assert '<link rel="stylesheet" href="/static/workqueue/admin.css">' in response.content.decode()
    assert raw_key in response.content.decode()
    assert _messages(response) == []
    assert not any(raw_key in morsel.value for morsel in response.cookies.values())
    assert hash_key(raw_key) == key.key_hash
    assert ApiKey.objects.authenticate(raw_key) == key
    assert key.subscriptions == ["orders.billing"] and key.expires_at is not None
    for page in [_url("workqueue_apikey_change", key.pk), _url("workqueue_apikey_changelist")]:
        html = admin_client.get(page).content.decode()
        assert key.key_hash not in html and raw_key not in html
        assert f"wq_{key.prefix}_" in html


def test_a_non_superuser_can_create_keys_only_for_themselves(client, admin_user):
    user = _staff("keymaker", "add_apikey", "view_apikey", "change_apikey")
    client.force_login(user)

    response = client.post(
        _url("workqueue_apikey_add"),
        {"owner": admin_user.pk, "name": "x", "scopes": ["workqueue:operate"]},
    )

    assert response.status_code == 200
    assert "owner" in response.context["adminform"].form.errors
    assert not ApiKey.objects.exists()


def test_the_revoke_action_revokes_keys(admin_client, admin_user):
    key, raw_key = ApiKey.objects.issue(admin_user, ["workqueue:read"])

    response = admin_client.post(
        _url("workqueue_apikey_changelist"),
        {"action": "revoke_keys", "_selected_action": [key.pk], "index": "0"},
        follow=True,
    )

    assert _messages(response) == ["Revoked 1 API key(s)."]
    assert ApiKey.objects.get(pk=key.pk).revoked_at is not None
    assert ApiKey.objects.authenticate(raw_key) is None


def test_the_key_list_finds_a_key_as_the_audit_trail_names_it_and_says_why_it_is_refused(
    admin_client,
):
    """The audit trail names a key ``wq_<prefix>`` and the list shows ``wq_<prefix>_…``: a
    search for either found nothing; and a key whose owner was deactivated (every call 401)
    was listed under the "Active" filter (review helper-156)."""
    from tests.factories import ApiKeyFactory, UserFactory

    leaver = UserFactory()
    kept, left = ApiKeyFactory(), ApiKeyFactory(owner=leaver)
    leaver.is_active = False
    leaver.save()
    changelist = _url("workqueue_apikey_changelist")

    def listed(**query: str) -> set[int]:
        return {row.pk for row in admin_client.get(changelist, query).context["cl"].result_list}

    assert listed(q=f"wq_{kept.prefix}") == {kept.pk}
    assert listed(q=f"wq_{kept.prefix}_…") == {kept.pk}
    assert listed(state="active") == {kept.pk}
    assert listed(state="owner inactive") == {left.pk}
    assert "owner inactive" in admin_client.get(changelist).content.decode()
