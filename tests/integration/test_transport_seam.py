"""The transport seam (issue 14, section 1): ``Transport.driver_class`` names a registered
transport class, whose capability flags decide what its subscriptions and operators may do.

A second transport, ``tests.support.transports.LimitedTransport``, lacks some capabilities: the
host plans what it cannot honour as Unsupported naming the flag, ``validate-bindings`` reports
the same as an Error, and the operator surfaces refuse (CLI exit 1, REST 409, admin message).
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import CommandError, call_command
from django.urls import reverse

from tests.factories import SubscriptionFactory, TopicFactory
from tests.support.api import call, operator
from tests.support.hosts import one, states, sub
from tests.support.queue import dead_letter
from tests.support.transports import LIMITED, LimitedReceiver, limited_transport
from workqueue import publish
from workqueue.exceptions import TopologyValidationError, UnsupportedByTransportError
from workqueue.models import Delivery, Transport
from workqueue.operators import operations
from workqueue.testing.conformance import DATABASE_TRAITS, TransportTraits
from workqueue.transport import Receiver
from workqueue.transports import transport_class
from workqueue.transports.database import DatabaseTransport

pytestmark = pytest.mark.usefixtures("queue_db")


@pytest.fixture
def limited() -> Iterator[Transport]:
    with limited_transport() as row:
        yield row


def limited_sub(limited: Transport, **fields: object):
    return sub(topic=TopicFactory(transport=limited), **fields)


# -- the registry and the Database transport ---------------------------------------------------


def test_the_database_transport_hands_the_runtime_the_procedures_receiver_unwrapped():
    # The hot path gains no work: a consumer holds workqueue.transport.Receiver itself.
    s = SubscriptionFactory()
    receiver = transport_class("Database")().receiver(str(s.id), "owner-1")

    assert type(receiver) is Receiver
    assert transport_class("Database") is DatabaseTransport
    flags = DatabaseTransport.capabilities()
    assert {k for k, v in flags.items() if v is False} == {"supports_external_consumers"}
    assert flags["heartbeat_modes"] == ["Auto", "Manual"]


def test_conformance_traits_follow_the_transports_capability_flags(limited):
    assert TransportTraits.of_transport("Database") == DATABASE_TRAITS
    limited_traits = TransportTraits.of_transport(LIMITED)
    assert (limited_traits.supports_ordered, limited_traits.cancel_in_flight) == (False, False)
    assert limited_traits.supports_list_partitions is False


def test_an_unregistered_driver_class_is_refused_at_save_naming_the_registered_ones():
    with pytest.raises(TopologyValidationError, match="No transport is registered as 'Kafka'"):
        Transport.objects.create(name="Stream", driver_class="Kafka")


def test_a_registered_transport_may_be_saved_and_is_refused_once_unregistered():
    with limited_transport():
        Transport.objects.create(name="Second", driver_class=LIMITED)
    with pytest.raises(TopologyValidationError, match=f"registered as '{LIMITED}'"):
        Transport.objects.create(name="Third", driver_class=LIMITED)


# -- the host's plan ---------------------------------------------------------------------------


def test_the_host_plans_what_the_transport_cannot_honour_as_unsupported_naming_the_capability(
    limited, make_host
):
    ordered = limited_sub(limited, partition_mode="Ordered")
    manual = limited_sub(limited, heartbeat_mode="Manual")
    limited_rate = limited_sub(limited, rate_limit_per_second=5)
    plain = limited_sub(limited, partition_mode="Exclusive")
    on_database = sub(partition_mode="Ordered", heartbeat_mode="Manual")
    names = [ordered, manual, limited_rate, plain, on_database]
    host = make_host([{"name": s.name} for s in names])

    host.start()

    found = states(host)
    assert found[ordered.name][0] == "Unsupported"
    assert found[ordered.name][1].startswith("Ordered needs supports_ordered, which the Limited")
    assert found[manual.name][0] == "Unsupported"
    assert "Heartbeat mode Manual needs heartbeat_modes" in found[manual.name][1]
    assert found[limited_rate.name][0] == "Unsupported"
    assert "rate_limit_per_second needs supports_rate_limit" in found[limited_rate.name][1]
    assert found[plain.name] == ("Running", "")
    assert found[on_database.name] == ("Running", "")


def test_a_subscription_on_the_second_transport_is_claimed_through_that_transport(
    limited, make_host
):
    s = limited_sub(limited)
    message = publish(s.topic.name, {"then": "complete"}).message_id
    host = make_host(one(s))

    result = host.run_once(max_deliveries=1, idle_exit_ms=5_000)

    assert result.processed == 1
    assert Delivery.objects.get(message_id=message).status == "Completed"
    assert LimitedReceiver.receives >= 1  # not a Receiver made past the transport


def test_validate_bindings_reports_the_same_as_an_error(limited):
    ordered = limited_sub(limited, partition_mode="Ordered")
    fine = limited_sub(limited)

    issues = operations.validate_bindings(LIMITED)

    errors = [(i.subject, i.message) for i in issues if i.severity == "Error"]
    assert (
        f"subscription {ordered.name}",
        transport_class(LIMITED).refusal("supports_ordered", "Ordered", LIMITED),
    ) in errors
    assert not [s for s, _ in errors if s == f"subscription {fine.name}"]
    out = io.StringIO()
    with pytest.raises(CommandError, match="found errors") as cli:
        call_command("workqueue", "validate-bindings", "--transport", LIMITED, stdout=out)
    assert cli.value.returncode == 1
    assert "Ordered needs supports_ordered" in out.getvalue()


# -- operator refusals -------------------------------------------------------------------------


def test_replay_on_a_transport_without_it_is_refused_by_every_surface(limited, client):
    s = limited_sub(limited)
    delivery_id = dead_letter(s)

    with pytest.raises(UnsupportedByTransportError) as refused:
        operations.replay(s.name, delivery_id)
    assert refused.value.capability == "supports_replay"
    assert "Replaying a dead letter needs supports_replay" in str(refused.value)

    with pytest.raises(CommandError, match="needs supports_replay") as cli:
        call_command("workqueue", "replay", "-s", s.name, "--delivery", delivery_id)
    assert cli.value.returncode == 1

    path = f"/subscriptions/{s.name}/deliveries/{delivery_id}/replay"
    response = call(client, "post", path, {"note": "x"}, key=operator())
    assert response.status_code == 409, response.content
    assert response.json()["capability"] == "supports_replay"
    assert "needs supports_replay" in response.json()["detail"]

    staff = User.objects.create_user("op", is_staff=True)
    staff.user_permissions.add(
        *Permission.objects.filter(
            content_type__app_label="workqueue",
            codename__in=[
                "view_delivery",
                "view_message",
                "view_subscription",
                "operate_subscription",
            ],
        )
    )
    client.force_login(staff)
    done = client.post(
        reverse("admin:workqueue_delivery_changelist"),
        {"action": "replay_deliveries", "_selected_action": [delivery_id], "post": "yes"},
        follow=True,
    )
    assert [str(m) for m in done.context["messages"]] == [
        "Replayed 0; not supported by the transport (supports_replay): 1"
    ]
    assert Delivery.objects.get(pk=delivery_id).status == "DeadLettered"


def test_bulk_replay_and_cancel_of_a_running_delivery_are_refused_naming_their_capability(
    limited,
):
    s = limited_sub(limited)
    dead_letter(s)
    publish(s.topic.name, {"n": 1})
    (running,) = Receiver(s.id).receive(1).deliveries

    with pytest.raises(UnsupportedByTransportError, match="needs supports_replay"):
        operations.resolve_dead_letters(s.name, "replay", operations.DeadLetterSelection())
    with pytest.raises(UnsupportedByTransportError, match="needs supports_cancel"):
        operations.discard(s.name, running.delivery_id, reason="stop")
    assert Delivery.objects.get(pk=running.delivery_id).status == "InFlight"
    # What the transport can do still works: bulk discard of dead letters.
    outcome = operations.resolve_dead_letters(
        s.name, "discard", operations.DeadLetterSelection(), note="gone"
    )
    assert outcome.matched == 1


def test_is_fifo_is_reported_where_the_topics_transport_has_no_fifo_topics(monkeypatch):
    topic = TopicFactory(is_fifo=True)
    warning = ("Warning", f"topic {topic.name}", "is_fifo has no effect on the Database transport.")

    assert warning in [(i.severity, i.subject, i.message) for i in operations.validate_bindings()]

    # The capability decides, not the transport's name (the AWS transport has it).
    monkeypatch.setattr(DatabaseTransport, "honours_topic_is_fifo", True)
    assert warning not in [
        (i.severity, i.subject, i.message) for i in operations.validate_bindings()
    ]
