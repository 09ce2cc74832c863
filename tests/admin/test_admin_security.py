"""Attacks on the admin by signed-in staff users, each refused, with the legitimate use kept.

Rows are made the real way (publish, receive, dead-letter through the transport), on the
driver's own connection: these tests use committed data.
"""

from __future__ import annotations

import datetime as dt
import json
from types import SimpleNamespace
from typing import Any

import pytest
from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from tests.factories import (
    ApiKeyFactory,
    SubscriptionFactory,
    TopicFactory,
    TransportFactory,
    UserFactory,
)
from tests.support.memory import SWOLLEN_PAYLOAD, peak_bytes
from tests.support.queue import dead_letter
from workqueue import publish
from workqueue.models import ApiKey, Delivery
from workqueue.operators.permissions import OPERATE, PUBLISH, READ
from workqueue.transport import Receiver
from workqueue.types import MAX_PAYLOAD_BYTES

pytestmark = pytest.mark.usefixtures("queue_db")

CARD = "4111111111111111"
REF_URI = "s3://vault/customers/4111.json"
# Everything a queue reader needs, but not workqueue.view_payload.
READER_PERMISSIONS = [
    "workqueue.view_message",
    "workqueue.view_delivery",
    "workqueue.view_deduplication",
    "workqueue.view_subscription",
    "workqueue.view_topic",
    "workqueue.view_transport",
]


def _url(name: str, *args: object) -> str:
    return reverse(f"admin:{name}", args=args)


def _signed_in(client: Client, *perms: str) -> Client:
    client.force_login(UserFactory(is_staff=True, perms=list(perms)))
    return client


def _listed(response: Any) -> set[str]:
    return {str(row.pk) for row in response.context["cl"].result_list}


@pytest.fixture
def secret() -> Delivery:
    """A dead letter whose message carries a card number (its last error quotes it), beside
    another card and two payload references, one of them pointing into a vault."""
    subscription = SubscriptionFactory()
    delivery = Delivery.objects.get(
        pk=dead_letter(subscription, {"card": CARD}, error=f"ValueError: bad card {CARD}")
    )
    publish(subscription.topic.name, {"card": "5500000000000004"})
    publish(subscription.topic.name, payload_ref={"uri": "s3://public/readme.json"})
    publish(subscription.topic.name, payload_ref={"uri": REF_URI})
    return delivery


# -- item 2: the queue lists are no oracle on what their pages do not show --------------------

# Query-string lookups a staff user could type; none is a declared list filter.
UNDECLARED_LOOKUPS = [
    pytest.param("message", "payload__card__startswith", "4", id="message-payload-prefix"),
    pytest.param("message", "payload__card", CARD, id="message-payload-exact"),
    pytest.param("message", "payload__has_key", "card", id="message-payload-has-key"),
    pytest.param("message", "payload_ref__uri__startswith", "s3://vault", id="message-ref-uri"),
    pytest.param("message", "payload__isnull", "False", id="message-payload-isnull"),
    pytest.param("message", "attributes__tier", "gold", id="message-attributes"),
    pytest.param("message", "partition_key__startswith", "c", id="message-key-prefix"),
    pytest.param("delivery", "last_error__contains", "411", id="delivery-last-error"),
    pytest.param("delivery", "progress__step", "1", id="delivery-progress"),
    pytest.param("delivery", "lease_token__isnull", "False", id="delivery-lease-token"),
    pytest.param("delivery", "status__regex", "^Dead", id="delivery-status-regex"),
    pytest.param(
        "delivery", "message__payload__card__startswith", "4", id="delivery-message-payload"
    ),
    pytest.param("deduplication", "deduplication_key__startswith", "a", id="dedup-key-prefix"),
    pytest.param("topic", "messages__payload__card__startswith", "4", id="topic-messages-payload"),
    pytest.param(
        "subscription",
        "deliveries__message__payload__card__startswith",
        "4",
        id="subscription-deliveries-payload",
    ),
]


@pytest.mark.parametrize("model, lookup, value", UNDECLARED_LOOKUPS)
def test_a_staff_user_without_view_payload_cannot_filter_on_undeclared_lookups(
    client, secret, model, lookup, value
):
    _signed_in(client, *READER_PERMISSIONS)

    response = client.get(_url(f"workqueue_{model}_changelist"), {lookup: value})

    # Django's own refusal (DisallowedModelAdminLookup, a SuspiciousOperation): 400, no rows.
    assert response.status_code == 400
    assert CARD not in response.content.decode()


@pytest.mark.parametrize(
    "model", ["message", "delivery"], ids=["message-payload", "delivery-last-error"]
)
def test_the_queue_lists_refuse_undeclared_lookups_even_for_a_payload_viewer(client, secret, model):
    lookup = {"message": "payload__card__startswith", "delivery": "last_error__contains"}[model]
    _signed_in(client, *READER_PERMISSIONS, "workqueue.view_payload")

    response = client.get(_url(f"workqueue_{model}_changelist"), {lookup: "4"})

    assert response.status_code == 400


@pytest.mark.parametrize("model", ["message", "delivery", "deduplication"])
def test_every_link_of_the_declared_filters_still_works(client, secret, model):
    _signed_in(client, *READER_PERMISSIONS)
    # A second topic and subscription, so the related filters have choices to offer.
    dead_letter(SubscriptionFactory(), payload={"n": 1}, deduplication_key="dedup-1")
    changelist = _url(f"workqueue_{model}_changelist")

    page = client.get(changelist)

    assert page.status_code == 200
    cl: ChangeList = page.context["cl"]
    links = [choice["query_string"] for spec in cl.filter_specs for choice in spec.choices(cl)]
    assert len(links) > len(cl.filter_specs)  # each filter offers its choices
    for query_string in links:
        assert client.get(changelist + query_string).status_code == 200, query_string


def test_declared_filters_narrow_the_queue_lists(client, secret):
    _signed_in(client, *READER_PERMISSIONS)
    other = Delivery.objects.get(pk=dead_letter(SubscriptionFactory(), payload={"n": 2}))

    deliveries = client.get(
        _url("workqueue_delivery_changelist"),
        {"subscription__id__exact": str(secret.subscription_id), "status__exact": "DeadLettered"},
    )
    messages = client.get(
        _url("workqueue_message_changelist"), {"topic__id__exact": str(other.message.topic_id)}
    )

    assert _listed(deliveries) == {str(secret.pk)}
    assert _listed(messages) == {str(other.message_id)}


def test_search_matches_no_payload_field(client, secret):
    _signed_in(client, *READER_PERMISSIONS)

    for model in ["message", "delivery"]:
        for term in [CARD, REF_URI, "card", "s3://vault"]:
            response = client.get(_url(f"workqueue_{model}_changelist"), {"q": term})
            assert response.status_code == 200
            assert _listed(response) == set(), (model, term)
    found = client.get(_url("workqueue_message_changelist"), {"q": str(secret.message_id)})
    assert _listed(found) == {str(secret.message_id)}


@pytest.mark.parametrize("order", ["payload", "-payload", "payload_ref", "payload.-1", "99", "-7"])
def test_ordering_cannot_sort_by_a_payload_field(client, secret, order):
    _signed_in(client, *READER_PERMISSIONS)

    response = client.get(_url("workqueue_message_changelist"), {"o": order})

    # ?o= takes indexes of list_display columns only, and no column shows a payload.
    assert response.status_code == 200
    order_by = [str(term) for term in response.context["cl"].queryset.query.order_by]
    assert order_by and not any("payload" in term for term in order_by), order_by


# -- item 3: a staff user manages their own API keys only -------------------------------------

KEY_ADMIN_PERMISSIONS = [
    "workqueue.add_apikey",
    "workqueue.view_apikey",
    "workqueue.change_apikey",
    "workqueue.delete_apikey",
]


@pytest.fixture
def keys(admin_user: Any) -> dict[str, Any]:
    """A superuser's narrow key, and a staff user allowed to manage keys with a key of their own."""
    keymaker = UserFactory(is_staff=True, perms=KEY_ADMIN_PERMISSIONS)
    return {
        "keymaker": keymaker,
        "boss": ApiKeyFactory(owner=admin_user, scopes=[READ]),
        "own": ApiKeyFactory(owner=keymaker),
    }


def _key_form(**changes: Any) -> dict[str, Any]:
    return {
        "name": "widened",
        "scopes": [PUBLISH, READ, OPERATE],
        "topics": "",
        "subscriptions": "",
        "expires_at_0": "",
        "expires_at_1": "",
        **changes,
    }


def test_a_staff_user_sees_only_their_own_api_keys(client, keys):
    client.force_login(keys["keymaker"])

    listed = client.get(_url("workqueue_apikey_changelist"))
    searched = client.get(_url("workqueue_apikey_changelist"), {"q": keys["boss"].prefix})

    assert listed.status_code == 200
    assert _listed(listed) == {str(keys["own"].pk)}
    assert _listed(searched) == set()
    assert keys["boss"].prefix not in listed.content.decode()


def test_a_staff_user_cannot_open_or_widen_another_users_key(client, keys):
    boss = keys["boss"]
    client.force_login(keys["keymaker"])

    opened = client.get(_url("workqueue_apikey_change", boss.pk))
    history = client.get(_url("workqueue_apikey_history", boss.pk))
    posted = client.post(_url("workqueue_apikey_change", boss.pk), _key_form())

    # Django's answer for an object outside the admin's queryset: back to the index, "doesn't
    # exist"; nothing about the key is drawn.
    for response in (opened, history, posted):
        assert response.status_code == 302 and response["Location"] == _url("index")
    boss.refresh_from_db()
    assert (boss.scopes, boss.name) == ([READ], "")


def test_a_staff_user_cannot_revoke_or_delete_another_users_key(client, keys):
    boss, own = keys["boss"], keys["own"]
    client.force_login(keys["keymaker"])
    changelist = _url("workqueue_apikey_changelist")

    client.post(
        changelist,
        {"action": "revoke_keys", "_selected_action": [boss.pk, own.pk], "index": "0"},
    )
    client.post(
        changelist,
        {"action": "delete_selected", "_selected_action": [boss.pk], "post": "yes"},
    )
    deleted = client.post(_url("workqueue_apikey_delete", boss.pk), {"post": "yes"})

    assert deleted.status_code == 302 and deleted["Location"] == _url("index")
    boss.refresh_from_db()
    assert boss.revoked_at is None
    assert ApiKey.objects.authenticate(boss.raw_key) == boss
    own.refresh_from_db()
    assert own.revoked_at is not None  # the same action on their own key worked


def test_a_staff_user_still_edits_and_deletes_their_own_key(client, keys):
    own = keys["own"]
    client.force_login(keys["keymaker"])

    changed = client.post(
        _url("workqueue_apikey_change", own.pk),
        _key_form(topics="orders", subscriptions="orders.billing"),
    )

    assert changed.status_code == 302, changed.context and changed.context["adminform"].errors
    own.refresh_from_db()
    assert set(own.scopes) == {OPERATE, PUBLISH, READ}
    assert (own.topics, own.subscriptions) == (["orders"], ["orders.billing"])
    deleted = client.post(_url("workqueue_apikey_delete", own.pk), {"post": "yes"})
    assert deleted.status_code == 302
    assert not ApiKey.objects.filter(pk=own.pk).exists()


def test_the_admin_refuses_a_key_limit_that_leaves_a_scope_unconfined(client, keys):
    own = keys["own"]
    client.force_login(keys["keymaker"])

    changed = client.post(_url("workqueue_apikey_change", own.pk), _key_form(topics="orders"))

    assert changed.status_code == 200  # the form again, with the error
    errors = changed.context["adminform"].form.non_field_errors()
    assert "--subscriptions" in str(errors)
    own.refresh_from_db()
    assert own.name != "widened"


def test_a_superuser_manages_every_users_keys(admin_client, keys):
    own = keys["own"]

    listed = admin_client.get(_url("workqueue_apikey_changelist"))
    changed = admin_client.post(_url("workqueue_apikey_change", own.pk), _key_form())
    admin_client.post(
        _url("workqueue_apikey_changelist"),
        {"action": "revoke_keys", "_selected_action": [own.pk], "index": "0"},
    )

    assert _listed(listed) == {str(keys["boss"].pk), str(own.pk)}
    assert changed.status_code == 302
    own.refresh_from_db()
    assert own.name == "widened" and own.revoked_at is not None


def test_the_key_admin_refuses_another_users_key_even_when_handed_the_object(rf, keys):
    # Views reach keys through get_queryset(); the per-object rule holds without it too.
    model_admin = admin.site._registry[ApiKey]
    request = rf.get("/")
    request.user = keys["keymaker"]

    for check in (
        model_admin.has_view_permission,
        model_admin.has_change_permission,
        model_admin.has_delete_permission,
    ):
        assert not check(request, keys["boss"])
        assert check(request, keys["own"])
        assert check(request)  # the list and the add page stay open to them


# -- item 11: operating and re-routing are separate permissions -------------------------------

TOPOLOGY_EDITOR = [
    "workqueue.view_delivery",
    "workqueue.view_subscription",
    "workqueue.change_subscription",
]
OPERATOR = [
    "workqueue.view_delivery",
    "workqueue.view_subscription",
    "workqueue.operate_subscription",
]


def _act(client: Client, action: str, ids: list[str], **form: str) -> Any:
    data = {"action": action, "_selected_action": ids, "post": "yes", **form}
    return client.post(_url("workqueue_delivery_changelist"), data, follow=True)


def _actions(client: Client) -> set[str]:
    page = client.get(_url("workqueue_delivery_changelist"))
    assert page.status_code == 200
    action_form = page.context["action_form"]
    return set(dict(action_form.fields["action"].choices)) if action_form else set()


def test_editing_subscriptions_does_not_let_a_user_replay_or_discard(client):
    dead = Delivery.objects.get(pk=dead_letter(SubscriptionFactory(), payload={"n": 1}))
    _signed_in(client, *TOPOLOGY_EDITOR)

    offered = _actions(client)
    _act(client, "replay_deliveries", [str(dead.pk)], note="sneaky")
    _act(client, "discard_deliveries", [str(dead.pk)], reason="sneaky")

    assert not offered & {"replay_deliveries", "discard_deliveries"}
    dead.refresh_from_db()
    assert (dead.status, dead.resolved_by) == ("DeadLettered", None)


def test_an_operator_replays_and_discards_without_editing_topology(client):
    subscription = SubscriptionFactory()
    dead = Delivery.objects.get(pk=dead_letter(subscription, payload={"n": 1}))
    other = Delivery.objects.get(pk=dead_letter(SubscriptionFactory(), payload={"n": 2}))
    _signed_in(client, *OPERATOR)

    offered = _actions(client)
    replayed = _act(client, "replay_deliveries", [str(dead.pk)], note="fixed")
    discarded = _act(client, "discard_deliveries", [str(other.pk)], reason="dupe")
    rerouted = client.post(
        _url("workqueue_subscription_change", subscription.pk),
        {"name": subscription.name, "topic": subscription.topic_id, "filter": '{"x": 1}'},
    )

    assert {"replay_deliveries", "discard_deliveries"} <= offered
    assert [str(m) for m in replayed.context["messages"]] == ["Replayed 1"]
    assert [str(m) for m in discarded.context["messages"]] == ["Discarded 1"]
    assert Delivery.objects.get(pk=dead.pk).status == "Pending"
    assert Delivery.objects.get(pk=other.pk).status == "Discarded"
    assert rerouted.status_code == 403
    subscription.refresh_from_db()
    assert subscription.filter is None


def test_the_key_list_is_no_oracle_on_the_never_shown_hash(client, admin_client, keys):
    own = keys["own"]
    client.force_login(keys["keymaker"])
    changelist = _url("workqueue_apikey_changelist")

    for user_client in (client, admin_client):
        probe = user_client.get(changelist, {"key_hash__startswith": own.key_hash[:2]})
        assert probe.status_code == 400
    active = client.get(changelist, {"state": "active"})
    assert _listed(active) == {str(own.pk)}


# -- transports: where messages go is for superusers ------------------------------------------


def test_a_view_only_user_cannot_run_the_provisioning_dry_run(client, monkeypatch):
    """The dry run calls the cloud's API with the server's credentials; it was offered to
    anyone who could view transports."""
    from workqueue.operators import topology

    ran: list[str] = []
    monkeypatch.setattr(
        topology, "provision", lambda name, **kw: ran.append(name) or SimpleNamespace(changes={})
    )
    transport = TransportFactory(name="Cloud")
    _signed_in(client, "workqueue.view_transport")

    page = client.get(_url("workqueue_transport_changelist"))
    offered = page.context["action_form"]
    client.post(
        _url("workqueue_transport_changelist"),
        {"action": "show_provisioning", "_selected_action": [str(transport.pk)]},
    )

    assert offered is None or "show_provisioning" not in dict(offered.fields["action"].choices)
    assert ran == []


def test_only_a_superuser_sets_where_a_transport_sends_messages(client, admin_client):
    """A transport's configuration names its endpoint and credentials profile: an editor who
    may not read payloads could point it at their own server and receive every message."""
    transport = TransportFactory(name="Cloud")
    before = transport.configuration
    _signed_in(client, "workqueue.view_transport", "workqueue.change_transport")
    form = {
        "name": "Cloud",
        "driver_class": transport.driver_class,
        "status": "Active",
        "description": "edited",
        "configuration": '{"endpoint_url": "https://attacker.example"}',
    }

    edited = client.post(_url("workqueue_transport_change", transport.pk), form)
    transport.refresh_from_db()

    assert edited.status_code == 302
    assert transport.description == "edited"  # what they may edit, they edit
    assert transport.configuration == before
    page = admin_client.get(_url("workqueue_transport_change", transport.pk))
    assert "configuration" in page.context["adminform"].form.fields


def test_a_key_owner_brings_an_expiry_forward_but_cannot_revive_or_extend_their_key(client, keys):
    """Audit helper-88: the change form took any expiry: an owner allowed to edit their keys
    (not to add one) revived their expired key, or set an expiry of 2999, past the 10 years
    issuing a key allows."""
    own = keys["own"]
    expired = timezone.now() - dt.timedelta(days=1)
    ApiKey.objects.filter(pk=own.pk).update(expires_at=expired)
    client.force_login(keys["keymaker"])
    change = _url("workqueue_apikey_change", own.pk)

    for refused in ({"expires_at_0": "2999-01-01", "expires_at_1": "00:00:00"}, {}):
        answered = client.post(change, _key_form(**refused))
        assert answered.status_code == 200  # the form again, with the error
        assert "expires_at" in answered.context["adminform"].form.errors
    own.refresh_from_db()
    assert own.expires_at == expired and not own.is_active

    soon = timezone.now() + dt.timedelta(days=3)
    ApiKey.objects.filter(pk=own.pk).update(expires_at=soon)
    earlier = (timezone.now() + dt.timedelta(days=1)).replace(microsecond=0)
    moved = client.post(
        change,
        _key_form(
            expires_at_0=earlier.astimezone(timezone.get_current_timezone()).date().isoformat(),
            expires_at_1=earlier.astimezone(timezone.get_current_timezone()).time().isoformat(),
        ),
    )
    assert moved.status_code == 302, moved.context and moved.context["adminform"].form.errors
    own.refresh_from_db()
    assert own.expires_at == earlier


def test_a_superuser_may_extend_an_expiry_up_to_ten_years(admin_client, keys):
    own = keys["own"]
    ApiKey.objects.filter(pk=own.pk).update(expires_at=timezone.now() - dt.timedelta(days=1))
    change = _url("workqueue_apikey_change", own.pk)

    too_far = admin_client.post(
        change, _key_form(expires_at_0="2999-01-01", expires_at_1="00:00:00")
    )
    extended = admin_client.post(change, _key_form())  # no expiry

    assert "expires_at" in too_far.context["adminform"].form.errors
    assert extended.status_code == 302
    own.refresh_from_db()
    assert own.expires_at is None


def test_a_key_whose_stored_expiry_is_past_the_limit_can_still_be_renamed(client, keys):
    """Review helper-90: a key given 2999 before the limit was checked could not be saved at
    all, whatever was changed."""
    own = keys["own"]
    far = dt.datetime(2999, 1, 1, tzinfo=dt.UTC)
    ApiKey.objects.filter(pk=own.pk).update(expires_at=far)
    client.force_login(keys["keymaker"])
    shown = far.astimezone(timezone.get_current_timezone())

    renamed = client.post(
        _url("workqueue_apikey_change", own.pk),
        _key_form(expires_at_0=shown.date().isoformat(), expires_at_1=shown.time().isoformat()),
    )

    assert renamed.status_code == 302, renamed.context["adminform"].form.errors
    own.refresh_from_db()
    assert (own.name, own.expires_at) == ("widened", far)


# -- what an operator reads is what is stored (review helper-143) ------------------------------

# Characters Django's escaping leaves alone: U+202E RIGHT-TO-LEFT OVERRIDE draws the text after
# it backwards, so this key reads "customer-42"; U+200B ZERO WIDTH SPACE draws as nothing, and
# U+E0001 LANGUAGE TAG (beyond the BMP) too.
SPOOFED_KEY = "\u202e24-remotsuc"
INVISIBLE = ("\u202e", "\u200b", "\U000e0001")


def _spoofed_dead_letter() -> Delivery:
    """A dead letter whose publisher and handler chose text that draws as something else."""
    return Delivery.objects.get(
        pk=dead_letter(
            # Ordered: its deliveries carry the message's partition key.
            SubscriptionFactory(partition_mode="Ordered"),
            {"amount": "\u202e00.01", "note\u200b": ["\U000e0001x"]},
            partition_key=SPOOFED_KEY,
            correlation_id="order-7\u200b",
            attributes={"tier": "gold\u200b"},
            deduplication_key="import-1\u200b",
            reason="Poison\u200b",
            error='Traceback (most recent call last):\n  File "h.py", line 1\n'
            "ValueError: card \u202e1234 declined",
        )
    )


def _page(client: Client, url: str) -> str:
    response = client.get(url)
    assert response.status_code == 200
    return response.content.decode()


def _drawn_as_stored(html: str) -> None:
    assert not [c for c in INVISIBLE if c in html], "an invisible character reached the page"


def test_the_queue_pages_draw_invisible_and_reordering_characters_as_escapes(client):
    """The delivery and message lists and detail pages, and the deduplication list, drew a key
    published as "\\u202e24-remotsuc" as "customer-42", and "order-7\\u200b" as "order-7"; the
    CLI's tables escape them. Seen failing: each page held the characters as they came."""
    delivery = _spoofed_dead_letter()
    _signed_in(client, *READER_PERMISSIONS, "workqueue.view_payload")
    pages = {
        name: _page(client, url)
        for name, url in {
            "deliveries": _url("workqueue_delivery_changelist"),
            "delivery": _url("workqueue_delivery_change", delivery.pk),
            "messages": _url("workqueue_message_changelist"),
            "message": _url("workqueue_message_change", delivery.message_id),
            "deduplications": _url("workqueue_deduplication_changelist"),
        }.items()
    }

    for html in pages.values():
        _drawn_as_stored(html)
    assert "\\u202e24-remotsuc" in pages["deliveries"]
    assert "Poison\\u200b" in pages["deliveries"]
    assert "ValueError: card \\u202e1234 declined" in pages["deliveries"]
    assert "\\u202e24-remotsuc" in pages["delivery"]
    # The traceback keeps its lines; the payload is the same JSON, its strings escaped.
    assert "line 1<br>ValueError: card \\u202e1234 declined" in pages["delivery"]
    assert "&quot;amount&quot;: &quot;\\u202e00.01&quot;" in pages["delivery"]
    assert "\\udb40\\udc01x" in pages["message"]
    assert "order-7\\u200b" in pages["messages"]
    assert "gold\\u200b" in pages["message"]
    assert "import-1\\u200b" in pages["deduplications"]


def test_the_replay_confirmation_draws_the_key_it_acts_on_as_stored(client):
    delivery = _spoofed_dead_letter()
    _signed_in(client, *OPERATOR)

    confirm = client.post(
        _url("workqueue_delivery_changelist"),
        {"action": "replay_deliveries", "_selected_action": [str(delivery.pk)]},
    )

    assert confirm.status_code == 200
    html = confirm.content.decode()
    _drawn_as_stored(html)
    assert "<td>\\u202e24-remotsuc</td>" in html
    assert f'value="{delivery.pk}"' in html


def test_the_escaped_payload_is_the_same_json():
    import json

    from workqueue.admin.display import visible_json

    value = {"amount": "\u202e00.01", "k\u200b": ["\U000e0001", "日本", "😀", "a\nb"], "n": 1}

    for indent in (None, 2):
        text = visible_json(value, indent=indent)
        assert json.loads(text) == value
        assert not [c for c in INVISIBLE if c in text]
    assert "日本" in visible_json(value) and "😀" in visible_json(value)


def test_a_reader_without_view_payload_still_sees_no_payload_on_the_message_page(client):
    delivery = _spoofed_dead_letter()
    _signed_in(client, *READER_PERMISSIONS)

    html = _page(client, _url("workqueue_message_change", delivery.message_id))
    delivery_html = _page(client, _url("workqueue_delivery_change", delivery.pk))

    for page in (html, delivery_html):
        assert "amount" not in page and "00.01" not in page
    assert "gold\\u200b" in html


PROXY = "https://relay:s3cret-pw@proxy.example:8443/aws"


def test_a_transport_reader_sees_its_endpoint_without_the_urls_password(client, admin_client):
    """Review helper-143: a transport's endpoint_url may carry a proxy's user and password,
    which the AWS transport's error texts leave out; its admin page showed them to every user
    allowed to view transports, and its list answered ?configuration__endpoint_url__contains=,
    row by row. Seen failing: the page held s3cret-pw and the probe listed the row."""
    transport = TransportFactory(name="Cloud")
    transport.configuration = {"region": "eu-west-1", "endpoint_url": PROXY}
    transport.save(update_fields=["configuration"])
    _signed_in(client, "workqueue.view_transport")

    page = _page(client, _url("workqueue_transport_change", transport.pk))
    probe = client.get(
        _url("workqueue_transport_changelist"), {"configuration__endpoint_url__contains": "s3c"}
    )
    listed = client.get(_url("workqueue_transport_changelist"), {"status__exact": "Active"})

    assert "s3cret" not in page
    assert "https://***@proxy.example:8443/aws" in page and "eu-west-1" in page
    assert probe.status_code == 400
    assert str(transport.pk) in _listed(listed)
    # Whoever may set it sees it whole, in the form that edits it.
    assert PROXY in _page(admin_client, _url("workqueue_transport_change", transport.pk))


def test_a_key_copied_from_the_page_finds_its_deliveries(client):
    delivery = _spoofed_dead_letter()
    _signed_in(client, *READER_PERMISSIONS)

    found = client.get(_url("workqueue_delivery_changelist"), {"q": "\\u202e24-remotsuc"})
    by_correlation = client.get(_url("workqueue_message_changelist"), {"q": "order-7\\u200b"})
    as_stored = client.get(_url("workqueue_delivery_changelist"), {"q": SPOOFED_KEY})
    shown_key = client.get(_url("workqueue_delivery_changelist"), {"q": "customer-42"})

    assert _listed(found) == _listed(as_stored) == {str(delivery.pk)}
    assert _listed(by_correlation) == {str(delivery.message_id)}
    assert _listed(shown_key) == set()


def test_the_escapes_read_back_as_the_text_drawn():
    from workqueue.admin.display import stored_text, visible_text

    for text in ["\u202e24-remotsuc", "a\u200bb\U000e0001", "tab\there\x1b[31m", "日本 😀", "x"]:
        assert stored_text(visible_text(text)) == text


# Characters str.isprintable accepts that draw as nothing or as a blank (review helper-144).
DRAWN_AS_NOTHING = [
    "\u034f",  # combining grapheme joiner
    "\u115f",  # Hangul choseong filler
    "\u1160",  # Hangul jungseong filler
    "\u17b4",  # Khmer vowel inherent aq
    "\u180b",  # Mongolian free variation selector one
    "\u2800",  # Braille pattern blank
    "\u3164",  # Hangul filler
    "\ufe0f",  # variation selector 16
    "\uffa0",  # halfwidth Hangul filler
    "\U000e0100",  # variation selector 17
]


@pytest.mark.parametrize("hidden", DRAWN_AS_NOTHING, ids=lambda c: f"U+{ord(c):04X}")
def test_characters_that_draw_as_nothing_are_written_as_escapes_everywhere(hidden):
    from workqueue.admin.display import stored_text, visible_json, visible_text
    from workqueue.logtext import log_text, log_value

    key = f"customer-42{hidden}"
    for shown in (visible_text(key), log_text(key), log_value(key), visible_json({"k": key})):
        assert hidden not in shown, shown
        assert "\\u" in shown or "\\U" in shown, shown
    assert stored_text(visible_text(key)) == key
    assert json.loads(visible_json({"k": key})) == {"k": key}


@pytest.mark.parametrize("typed", ["\\x00", "\\u0000", "\\ud800", "x\\udfffy"])
def test_an_escape_of_what_no_key_can_hold_searches_for_the_text_as_typed(client, typed):
    """Review helper-144: the search read a typed "\\x00" back as a NUL character, which
    PostgreSQL refuses in text (a 500), and "\\ud800" as a lone surrogate (a 500)."""
    _spoofed_dead_letter()
    _signed_in(client, *READER_PERMISSIONS)

    for page in ("workqueue_delivery_changelist", "workqueue_message_changelist"):
        answer = client.get(_url(page), {"q": typed})
        assert answer.status_code == 200, answer.content[:300]
        assert _listed(answer) == set()


@pytest.mark.parametrize("page", ["delivery", "deduplication", "subscription", "topic"])
def test_a_nul_in_a_list_filters_value_is_refused_not_a_server_error(client, page):
    """Review helper-167: helper-144 fixed a NUL typed into the search, but a list filter's
    value went to the database as given: ``?status__exact=%00``, from any staff user who may
    view the list, was PostgreSQL's refusal, an unhandled 500 mailed to ADMINS each time."""
    dead_letter(SubscriptionFactory())
    client.raise_request_exception = False
    client.force_login(
        UserFactory(
            is_staff=True,
            perms=[f"workqueue.view_{name}" for name in ("delivery", "deduplication")]
            + ["workqueue.view_subscription", "workqueue.view_topic"],
        )
    )

    answer = client.get(_url(f"workqueue_{page}_changelist"), {"status__exact": "\x00"})

    assert answer.status_code == 400, answer.status_code


def test_an_api_keys_name_is_drawn_with_its_invisible_characters_as_escapes(client):
    """Round 40's leftover (helper-143): a staff user names their own key, and the superuser's
    list of every key drew the name as given, so "\\u202etob-yolped" read "deploy-bot" there,
    beside the real one."""
    owner = UserFactory(is_staff=True, perms=["workqueue.add_apikey", "workqueue.view_apikey"])
    ApiKeyFactory(owner=owner, name="\u202etob-yolped\u200b")
    client.force_login(UserFactory(is_staff=True, is_superuser=True))

    page = client.get(_url("workqueue_apikey_changelist")).content.decode()
    found = client.get(_url("workqueue_apikey_changelist"), {"q": "\\u202etob"})

    assert "\u202e" not in page and "\u200b" not in page
    assert "\\u202etob-yolped\\u200b" in page
    assert len(found.context["cl"].result_list) == 1  # the name copied from the page finds it


# -- the message list reads no payload -----------------------------------------------------


def test_the_message_list_holds_none_of_its_messages_payloads(client):
    """The list shows no payload, but read every listed message's whole row: a publisher's
    hundred messages of JSON empty objects (some 25 times their text once decoded) made each
    staff user who opened the list hold over a gigabyte of the web process. The list reads
    none; a message's page still shows its own."""
    topic = TopicFactory(max_payload_bytes=MAX_PAYLOAD_BYTES)
    ids = [str(publish(topic.name, SWOLLEN_PAYLOAD).message_id) for _ in range(16)]
    _signed_in(client, "workqueue.view_message", "workqueue.view_payload")

    listed, peak = peak_bytes(lambda: client.get(_url("workqueue_message_changelist")))
    shown = client.get(_url("workqueue_message_change", ids[0]))

    assert listed.status_code == 200 and _listed(listed) == set(ids)
    assert peak < 24 * 2**20, f"the list held {peak / 2**20:.0f} MB"
    assert shown.status_code == 200 and "{}," in shown.content.decode()


def test_the_delivery_list_reads_none_of_its_deliveries_progress(client, pg_conn):
    """Review helper-173: the procedure stored a lease holder's progress whole (the runtime
    cuts it, a role calling the procedure need not; since 0055 the procedure cuts it too, but
    rows stored before keep theirs), and the delivery list read every listed row's progress to
    draw a list that shows none of it."""
    subscription = SubscriptionFactory()
    for n in range(10):
        publish(subscription.topic.name, {"n": n})
    Receiver(subscription.id).receive(10)
    # As a holder stored it before 0055: 2 MB of progress on each delivery.
    pg_conn.execute(
        "UPDATE workqueue_delivery SET progress = jsonb_build_object('step', repeat('x', 2000000))"
        " WHERE subscription_id = %s",
        [subscription.id],
    )
    _signed_in(client, "workqueue.view_delivery")

    listed, peak = peak_bytes(lambda: client.get(_url("workqueue_delivery_changelist")))

    assert listed.status_code == 200 and len(_listed(listed)) == 10
    assert peak < 8 * 2**20, f"the list held {peak / 2**20:.0f} MB"
