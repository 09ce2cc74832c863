"""The AWS transport (issue 14, sections 2 and 3) against moto's standalone server, through real
boto3 HTTP calls (or real AWS with WORKQUEUE_TEST_AWS_REGION set): configuration and names
checked at save, filters translated to SNS filter policies, provisioning, publishing through
the seam, and the receiver's claim, heartbeat and settles with their fencing."""

from __future__ import annotations

import datetime as dt
import io
import json
import logging
import re
import subprocess
import sys
import time
import tracemalloc
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import EndpointConnectionError
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.db import connection
from django.urls import reverse
from django.utils import timezone

from tests.factories import (
    ApiKeyFactory,
    SubscriptionFactory,
    TopicFactory,
    TransportFactory,
    UserFactory,
    write_unchecked,
)
from tests.support.api import post as rest_post
from tests.support.executions import ExecutionRig
from tests.support.filter_cases import leaf, root
from tests.support.handlers import probe, registry
from tests.support.memory import SWOLLEN_PAYLOAD
from tests.support.waiting import wait_until
from workqueue import publish, publish_many
from workqueue.exceptions import (
    TopologyValidationError,
    TransientTransportError,
    TransportUnavailableError,
    UnsupportedByTransportError,
    WorkQueueConfigurationError,
)
from workqueue.models import Deduplication, Message, Subscription, Topic, Transport
from workqueue.operators import operations
from workqueue.operators.permissions import Actor
from workqueue.transports import transport_for
from workqueue.transports.aws import (
    AwsClients,
    AwsNames,
    AwsReceiver,
    AwsSettings,
    AwsTransport,
    QueueBinding,
    _attribute_bytes,
    _payload_held_as_text,
    _Provisioner,
    clients_for,
    send_copy,
)
from workqueue.transports.ledger import content_fingerprint
from workqueue.types import DeliveryStatus, SettleOutcome, SettleResult

pytestmark = pytest.mark.usefixtures("queue_db")


@pytest.fixture
def aws(aws_endpoint) -> Transport:
    """An AWS Transport row on the test endpoint, its resources under a fresh prefix."""
    return TransportFactory(
        name="aws-test", driver_class="AWS", configuration=aws_endpoint.configuration()
    )


def provisioned(aws: Transport, *, fifo: bool = False, **subscription: Any) -> Subscription:
    """A topic on ``aws`` with one subscription (model ``subscription`` fields), provisioned."""
    topic = TopicFactory(transport=aws, is_fifo=fifo)
    found = SubscriptionFactory(topic=topic, **subscription)
    transport_for("AWS").provision(aws, dry_run=False)
    return found


def receiver(subscription: Subscription) -> AwsReceiver:
    return transport_for("AWS").receiver(str(subscription.id))


def arrivals(subscription_receiver: AwsReceiver, *, complete: bool = False) -> list[Any]:
    """Every delivery received within 3 s (a second copy would be visible by then), each
    completed as it comes with ``complete``."""
    found: list[Any] = []
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        for delivery in subscription_receiver.receive(10).deliveries:
            found.append(delivery)
            if complete:
                subscription_receiver.complete(delivery)
    return found


def receive_one(subscription_receiver: AwsReceiver, timeout: float = 10) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = subscription_receiver.receive(1).deliveries
        if found:
            return found[0]
    raise AssertionError("no delivery arrived")


# -- configuration, names, filters ----------------------------------------------------------


@pytest.mark.parametrize(
    ("configuration", "named"),
    [
        (None, "region"),
        ({"prefix": "wq"}, "region"),
        ({"region": "eu-west-1", "regoin": "x"}, "regoin"),
        ({"region": "eu-west-1", "prefix": "bad prefix"}, "prefix"),
        ({"region": "eu-west-1", "endpoint_url": "localhost:4566"}, "endpoint_url"),
        ({"region": ""}, "region"),
    ],
)
def test_an_aws_transport_configuration_is_checked_on_save_naming_the_key(configuration, named):
    with pytest.raises(TopologyValidationError) as refused:
        Transport.objects.create(name="aws-x", driver_class="AWS", configuration=configuration)

    assert named in str(refused.value.message_dict["configuration"])


SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY"


@pytest.mark.parametrize(
    "endpoint",
    [
        f"http://AKIAEXAMPLE:{SECRET}@local_stack:4566",  # botocore refuses the underscore
        f"HTTPS://AKIAEXAMPLE:{SECRET}@localhost:4566",  # not lower-case http(s)
    ],
)
def test_an_endpoint_botocore_would_refuse_is_refused_on_save_without_its_credentials(endpoint):
    """Review helper-168: an endpoint whose host botocore calls invalid (a docker-compose
    service such as local_stack) passed the check, and botocore's ValueError, raised while
    building its client where no AWS call's error is cleaned, quoted the whole URL."""
    with pytest.raises(TopologyValidationError) as refused:
        Transport.objects.create(
            name="aws-x",
            driver_class="AWS",
            configuration={"region": "eu-west-1", "endpoint_url": endpoint},
        )

    said = str(refused.value.message_dict["configuration"])
    assert "endpoint_url" in said
    assert SECRET not in said


def test_an_endpoint_stored_before_the_check_leaks_no_credentials_where_it_fails(make_host):
    """The same endpoint in a row stored unchecked (an earlier release, SQL): the publish's
    error and the host's health (stored, shown by /health and the admin) quoted it whole."""
    transport = TransportFactory(
        name="aws-creds", driver_class="AWS", configuration={"region": "eu-west-1"}
    )
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE workqueue_transport SET configuration = %s WHERE id = %s",
            [
                json.dumps(
                    {
                        "region": "eu-west-1",
                        "endpoint_url": f"http://AKIAEXAMPLE:{SECRET}@local_stack:4566",
                    }
                ),
                transport.id,
            ],
        )
    topic = TopicFactory(transport=transport)
    subscription = SubscriptionFactory(topic=topic, handler_key="t.script")

    with pytest.raises(WorkQueueConfigurationError) as publishing:
        publish(topic.name, {"n": 1})
    host = make_host([{"name": subscription.name, "concurrency": 1}])
    host.start()
    wait_until(lambda: host.health()["subscriptions"][0]["state"] == "Error", timeout=10)

    said = [repr(publishing.value), host.health()["subscriptions"][0]["reason"]]
    assert [text for text in said if SECRET in text] == [], said


def test_a_region_botocore_cannot_parse_is_named_as_a_configuration_mistake():
    """botocore refuses to build a client for such a region with a ValueError, which went
    raw through a publish (a traceback), where every other configuration mistake names the
    setting to fix."""
    transport = TransportFactory(
        name="aws-region", driver_class="AWS", configuration={"region": "eu west 1"}
    )

    with pytest.raises(WorkQueueConfigurationError, match="region"):
        publish(TopicFactory(transport=transport).name, {"n": 1})


def test_resource_names_are_derived_from_the_prefix_and_the_topology_names():
    names = AwsNames.of("wq", "orders.created", "orders.created.billing", fifo=True)

    assert names == AwsNames(
        topic="wq-orders--created.fifo",
        queue="wq-orders--created--billing.fifo",
        dead_letter_queue="wq-orders--created--billing-dlq.fifo",
    )


def test_a_subscription_whose_queue_name_sqs_would_refuse_is_refused_on_save(aws):
    topic = TopicFactory(transport=aws)

    with pytest.raises(TopologyValidationError) as refused:
        SubscriptionFactory(topic=topic, name="a" * 70)

    assert "SQS allows 80" in str(refused.value.message_dict["name"])


@pytest.mark.parametrize("fifo", [False, True])
def test_a_subscription_named_after_another_ones_dead_letter_queue_is_refused_on_save(aws, fifo):
    """Subscription "billing-dlq"'s queue was subscription "billing"'s dead-letter queue, so
    its consumer ran, and by completing deleted, billing's dead letters (payloads included),
    and its own messages were listed and could be replayed as billing's (helper-123)."""
    topic = TopicFactory(transport=aws, is_fifo=fifo)
    billing = SubscriptionFactory(topic=topic, name="billing")

    with pytest.raises(TopologyValidationError) as refused:
        SubscriptionFactory(topic=TopicFactory(transport=aws, is_fifo=fifo), name="billing-dlq")

    assert "may not end in '-dlq'" in str(refused.value.message_dict["name"])
    assert QueueBinding.of(str(billing.id)).names.dead_letter_queue.startswith("wq")
    # A dotted name whose last word is "dlq" makes "...--dlq": no other queue's dead letters.
    SubscriptionFactory(topic=topic, name="billing.dlq")


def test_a_subscription_saved_before_the_dead_letter_queue_rule_is_neither_bound_nor_provisioned(
    aws,
):
    topic = TopicFactory(transport=aws)
    SubscriptionFactory(topic=topic, name="billing")
    intruder = SubscriptionFactory(topic=topic, name="billing-audit")
    replacement = SubscriptionFactory(topic=TopicFactory(transport=aws), name="zz-replacement")
    # As a row saved by an earlier release, which had no such rule.
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE workqueue_subscription SET name = 'billing-dlq' WHERE id = %s", [intruder.pk]
        )

    with pytest.raises(WorkQueueConfigurationError, match="may not end in '-dlq'"):
        transport_for("AWS").receiver(str(intruder.id))
    # Refused alone: the rest of the transport, the subscription replacing it included, is
    # provisioned (helper-126: one such row stopped every provisioning).
    changes = transport_for("AWS").provision(aws, dry_run=False)
    [refused] = [c for c in changes if c.action == "refuse"]
    assert "dead-letter queue of subscription 'billing'" in refused.detail
    assert receiver(replacement).receive(1).deliveries == []  # its queue exists
    with pytest.raises(CommandError, match="1 resource"):
        workqueue_cli("provision", "--transport", aws.name)
    # What an earlier provision made for it is named for removal, and the bindings check says
    # so as an error, not as "run provision" for ever (helper-127).
    assert "RedrivePolicy" in refused.detail and "SNS subscription" in refused.detail
    [error] = [i for i in operations.validate_bindings() if i.severity == "Error"]
    assert "is refused" in error.message and "billing" in error.message


def test_only_a_name_ending_in_dash_dlq_names_another_subscriptions_dead_letter_queue():
    assert AwsNames.of("wq", "t", "billing-dlq", False).dead_letter_queue_of == "billing"
    for name in ("dlq", "billing.dlq", "billing_dlq", "dlq-billing"):
        assert AwsNames.of("wq", "t", name, False).problem() is None, name


def test_a_lease_longer_than_sqs_can_hide_a_message_is_refused_on_save(aws):
    """SQS's visibility timeout, which is the lease, stops at 12 hours: a longer lease was
    saved, and provisioning and every receive then failed."""
    topic = TopicFactory(transport=aws)
    with pytest.raises(TopologyValidationError) as refused:
        SubscriptionFactory(topic=topic, lease_seconds=43_201)
    assert "12 hours" in str(refused.value)
    assert SubscriptionFactory(topic=topic, lease_seconds=43_200).lease_seconds == 43_200


def test_more_attempts_than_an_sqs_redrive_counts_are_refused_on_save(aws):
    # The queue dead-letters after max_attempts + 1 receives, and SQS counts at most 1,000:
    # max_attempts 1,000 was saved and provisioning then failed.
    topic = TopicFactory(transport=aws)
    with pytest.raises(TopologyValidationError) as refused:
        SubscriptionFactory(topic=topic, max_attempts=1000)
    assert "at most 999" in str(refused.value)
    assert SubscriptionFactory(topic=topic, max_attempts=999).max_attempts == 999


def test_a_filter_sns_cannot_express_is_refused_on_save(aws):
    topic = TopicFactory(transport=aws)
    many = [
        {
            "logic": "or",
            "filters": [{"field": f, "operator": "eq", "value": str(v)} for v in range(6)],
        }
        for f in ("a", "b", "c")
    ]

    with pytest.raises(TopologyValidationError) as refused:
        SubscriptionFactory(topic=topic, filter={"logic": "and", "filters": many})

    assert "150 value combinations; this one has 216" in str(refused.value.message_dict["filter"])


def test_subscription_filters_deliver_through_sns_filter_policies(aws):
    topic = TopicFactory(transport=aws)
    cases = {
        "eq": {"field": "region", "operator": "eq", "value": "eu"},
        "neq": {"field": "region", "operator": "neq", "value": "eu"},
        "prefix": {"field": "region", "operator": "startswith", "value": "e"},
        "absent": {"field": "region", "operator": "isnull"},
        "present": {"field": "region", "operator": "isnotnull"},
    }
    subscriptions = {
        name: SubscriptionFactory(
            topic=topic, name=f"f.{name}", filter={"logic": "and", "filters": [clause]}
        )
        for name, clause in cases.items()
    }
    any_of = SubscriptionFactory(
        topic=topic,
        name="f.anyof",
        filter={
            "logic": "and",
            "filters": [
                {
                    "logic": "or",
                    "filters": [
                        {"field": "region", "operator": "eq", "value": v} for v in ("us", "ap")
                    ],
                }
            ],
        },
    )
    subscriptions["anyof"] = any_of
    transport_for("AWS").provision(aws, dry_run=False)

    for region in ("eu", "us", "ex", None):
        publish(topic.name, {"region": region}, attributes={"region": region} if region else None)

    received = {}
    for name, subscription in subscriptions.items():
        found = receiver(subscription).receive(10).deliveries
        received[name] = sorted(str(d.decoded_payload()["region"]) for d in found)
    assert received == {
        "eq": ["eu"],
        "neq": ["ex", "us"],
        "prefix": ["eu", "ex"],
        "absent": ["None"],
        "present": ["eu", "ex", "us"],
        "anyof": ["us"],
    }


def test_a_message_without_attributes_reaches_sns_with_one_so_isnull_filters_match_it(aws):
    """SNS matches no filter policy against a message without attributes, not even
    ``exists: false`` (AWS's filter documentation; moto matches it, so what is sent is what is
    checked): an ``isnull`` subscription missed every message published without attributes."""
    subscription = provisioned(
        aws, filter={"logic": "and", "filters": [{"field": "tenant", "operator": "isnull"}]}
    )
    sent: list[dict[str, Any]] = []

    def record(params: dict[str, Any], **_: Any) -> None:
        sent.append(params.get("MessageAttributes"))

    sns = QueueBinding.of(str(subscription.id)).clients.sns
    sns.meta.events.register("provide-client-params.sns.Publish", record)
    publish(subscription.topic.name, {"n": 1})

    assert sent == [{"wq_no_attributes": {"DataType": "String", "StringValue": "1"}}]
    [delivery] = receive_all(receiver(subscription), 1)
    assert delivery.attributes == {}  # the marker is SNS's alone


def _with_a_stored_filter(aws: Transport, stored_filter: Any) -> tuple[Subscription, ...]:
    """A topic on ``aws`` with a subscription holding ``stored_filter`` written behind the
    guard, and one after it (provisioned in name order)."""
    topic = TopicFactory(transport=aws)
    broken = SubscriptionFactory(topic=topic, name=f"{topic.name}.a-broken")
    after = SubscriptionFactory(topic=topic, name=f"{topic.name}.z-after")
    write_unchecked(broken, filter=stored_filter)
    broken.refresh_from_db()
    return broken, after


def test_an_invalid_stored_filter_matches_nothing_and_the_rest_is_provisioned(aws):
    """Audit helper-129: provisioning parsed the stored filter, so one invalid in the table
    (the README: it matches no message, its topic's other subscriptions get theirs) raised a
    FilterError that stopped the run: the subscriptions after it got no queue and no SNS
    subscription, and what was published to them was lost."""
    broken, after = _with_a_stored_filter(
        aws, {"logic": "or", "filters": [leaf("a", "eq", "x"), leaf("b", "eq", "y")]}
    )

    transport_for("AWS").provision(aws, dry_run=False)
    assert publish(after.topic.name, {"n": 1}, attributes={"a": "x"}).accepted

    assert [d.decoded_payload() for d in arrivals(receiver(after), complete=True)] == [{"n": 1}]
    assert arrivals(receiver(broken)) == []


def test_a_filter_stored_as_json_text_matches_nothing_on_aws_as_everywhere(aws):
    """Audit helper-129: a filter column holding a JSON string is invalid (the fan-out, Python
    and validate-bindings match nothing with it), but provisioning parsed the text into the
    filter it spells, so SNS delivered to that queue what no other reader would."""
    text = json.dumps(root(leaf("a", "eq", "x")))
    broken, _after = _with_a_stored_filter(aws, text)
    assert broken.filter == text and broken.filter_problem() is not None

    transport_for("AWS").provision(aws, dry_run=False)
    assert publish(broken.topic.name, {"n": 1}, attributes={"a": "x"}).accepted

    assert arrivals(receiver(broken)) == []


def test_a_disabled_subscription_stops_receiving_from_sns_once_provisioned(aws):
    subscription = provisioned(aws)
    sibling = SubscriptionFactory(topic=subscription.topic)
    transport_for("AWS").provision(aws, dry_run=False)
    Subscription.objects.filter(pk=subscription.pk).update(status="Disabled")

    changes = transport_for("AWS").provision(aws, dry_run=False)

    assert [(c.action, c.kind, c.detail) for c in changes if c.action != "keep"] == [
        ("update", "subscription", "FilterPolicy")
    ]
    publish(subscription.topic, {"n": 1})
    assert [d.decoded_payload()["n"] for d in receive_all(receiver(sibling), 1)] == [1]
    # As on the Database transport, publishing fans out nothing more to it.
    assert receiver(subscription).receive(10).deliveries == []

    Subscription.objects.filter(pk=subscription.pk).update(status="Active")
    transport_for("AWS").provision(aws, dry_run=False)
    publish(subscription.topic, {"n": 2})
    assert [d.decoded_payload()["n"] for d in receive_all(receiver(subscription), 1)] == [2]


def receive_all(subscription_receiver: AwsReceiver, count: int, timeout: float = 10) -> list[Any]:
    found: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(found) < count and time.monotonic() < deadline:
        found += subscription_receiver.receive(10).deliveries
    return found


# -- provisioning ----------------------------------------------------------------------------


def test_provision_creates_then_keeps_and_a_dry_run_changes_nothing(aws):
    topic = TopicFactory(transport=aws, name="prov.orders")
    subscription = SubscriptionFactory(topic=topic, name="prov.orders.billing")
    prefix = aws.configuration["prefix"]
    transport = transport_for("AWS")

    planned = transport.provision(aws, dry_run=True)
    assert {(c.action, c.kind) for c in planned} == {
        ("create", "sns-topic"),
        ("create", "sqs-queue"),
        ("create", "subscription"),
    }
    sqs = clients_for(AwsSettings.parse(aws.configuration)).sqs
    assert not sqs.list_queues(QueueNamePrefix=prefix).get("QueueUrls")

    created = transport.provision(aws, dry_run=False)
    assert [(c.action, c.kind, c.name) for c in created] == [
        ("create", "sns-topic", f"{prefix}-prov--orders"),
        ("create", "sqs-queue", f"{prefix}-prov--orders--billing-dlq"),
        ("create", "sqs-queue", f"{prefix}-prov--orders--billing"),
        ("create", "subscription", f"{prefix}-prov--orders -> {prefix}-prov--orders--billing"),
    ]
    again = transport.provision(aws, dry_run=False)
    assert {c.action for c in again} == {"keep"}

    subscription.lease_seconds = 120
    subscription.filter = {
        "logic": "and",
        "filters": [{"field": "a", "operator": "eq", "value": "1"}],
    }
    subscription.save()
    changed = transport.provision(aws, dry_run=True)
    assert [(c.action, c.kind, c.detail) for c in changed if c.action != "keep"] == [
        ("update", "sqs-queue", "VisibilityTimeout"),
        ("update", "subscription", "FilterPolicy"),
    ]
    transport.provision(aws, dry_run=False)
    assert [c for c in transport.provision(aws, dry_run=False) if c.action != "keep"] == []


def test_queues_keep_waiting_work_and_dead_letters_as_long_as_sqs_allows(aws):
    """The queue's retention was the topic's retention_days, which is about settled work: SQS
    deleted a Paused subscription's waiting work after a day with ``retention_days=1``."""
    subscription = provisioned(aws, max_attempts=2)
    Topic.objects.filter(pk=subscription.topic_id).update(retention_days=1)
    transport_for("AWS").provision(aws, dry_run=False)
    binding = QueueBinding.of(str(subscription.id))
    sqs = binding.clients.sqs

    kept = {
        queue: sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["MessageRetentionPeriod"])[
            "Attributes"
        ]["MessageRetentionPeriod"]
        for queue, url in (("queue", binding.queue_url), ("dlq", binding.dead_letter_queue_url))
    }

    assert kept == {"queue": "1209600", "dlq": "1209600"}


def test_a_message_at_the_publish_limit_fits_its_queues_once_settled_with_a_long_error(aws):
    """SNS carries messages up to 256 KiB, and SQS queues made before 2025 (or by this transport
    before it asked for more) hold no more, counting attributes: a retry's copy adds the
    delivery's id and attempts to the body, and a dead letter adds its reason and up to 4,000
    characters of error as attributes, so AWS refused the dead letter of a message near the
    limit (moto counts only bodies, so the test weighs what was sent). Provisioning now raises
    both queues to SQS's 1 MiB."""
    subscription = provisioned(aws, max_attempts=3)
    binding = QueueBinding.of(str(subscription.id))
    sqs = binding.clients.sqs
    for url in (binding.queue_url, binding.dead_letter_queue_url):
        sqs.set_queue_attributes(QueueUrl=url, Attributes={"MaximumMessageSize": "262144"})

    changed = transport_for("AWS").provision(aws, dry_run=False)
    assert publish(subscription.topic.name, "x" * 261_800).accepted
    holder = receiver(subscription)
    sent, undo = _capture(holder.binding.lease_sqs, "sqs.SendMessage")
    try:
        delivery = receive_one(holder)
        assert holder.retry(delivery, 0, "boom").status == DeliveryStatus.PENDING
        again = receive_one(holder)
        assert holder.dead_letter(again, "MaxAttemptsExceeded", "\u00e9" * 4000).settled
    finally:
        undo()

    # (moto drops a queue's Policy on a SetQueueAttributes without it, so it is set again too)
    assert [
        (c.action, "MaximumMessageSize" in c.detail) for c in changed if c.kind == "sqs-queue"
    ] == [("update", True), ("update", True)]
    assert (again.delivery_id, again.attempt) == (delivery.delivery_id, 2)
    [item] = operations.list_dead_letters(subscription.name).items
    assert item.last_error == "\u00e9" * 4000
    for params in sent:
        allowed = sqs.get_queue_attributes(
            QueueUrl=params["QueueUrl"], AttributeNames=["MaximumMessageSize"]
        )["Attributes"]["MaximumMessageSize"]
        attributes = {
            name: value["StringValue"] for name, value in params["MessageAttributes"].items()
        }
        size = len(params["MessageBody"].encode()) + _attribute_bytes(attributes)
        assert size <= int(allowed), (params["QueueUrl"], size, allowed)


def test_the_provision_verb_prints_changes_and_reports_no_changes_the_second_time(aws, capsys):
    SubscriptionFactory(topic=TopicFactory(transport=aws))

    call_command("workqueue", "provision", "--transport", aws.name, "--dry-run")
    dry = capsys.readouterr().out
    call_command("workqueue", "provision", "--transport", aws.name)
    first = capsys.readouterr().out
    call_command("workqueue", "provision", "--transport", aws.name)
    second = capsys.readouterr().out

    assert "+ sns-topic" in dry and "Dry run: 4 change(s), nothing created." in dry
    assert "Applied 4 change(s)." in first
    assert "No changes: the resources of aws-test match its topology." in second


# -- publishing ------------------------------------------------------------------------------


def test_publish_by_name_goes_to_sns_and_reaches_the_subscription_queue(aws):
    subscription = provisioned(aws)
    topic = subscription.topic

    result = publish(
        topic.name, {"n": 1}, attributes={"kind": "a"}, correlation_id="c-1", partition_key="k"
    )
    batch = publish_many(topic, [{"payload": {"n": n}} for n in range(2, 14)])

    assert result.status == "Accepted" and all(r.status == "Accepted" for r in batch)
    assert not Message.objects.exists()  # nothing written to the queue tables
    got = []
    subscription_receiver = receiver(subscription)
    while len(got) < 13:
        got += subscription_receiver.receive(10).deliveries
    first = next(d for d in got if d.decoded_payload() == {"n": 1})
    assert (first.message_id, first.attributes, first.correlation_id, first.partition_key) == (
        result.message_id,
        {"kind": "a"},
        "c-1",
        "k",
    )
    assert first.topic_id == str(topic.id) and first.attempt == 1
    assert sorted(d.message_id for d in got) == sorted(
        [result.message_id, *(r.message_id for r in batch)]
    )


def test_publish_refuses_what_the_aws_transport_lacks_naming_the_capability(aws):
    topic = provisioned(aws).topic

    delayed = publish(topic.name, 1, delay_seconds=10)
    prioritised = publish(topic.name, 1, priority=5)
    plain = publish(topic.name, 1)

    assert (delayed.error.code, prioritised.error.code) == ("InvalidSchedule", "InvalidPriority")
    assert "needs supports_scheduled_publish" in delayed.error.message
    assert "needs supports_priority" in prioritised.error.message
    assert plain.status == "Accepted"
    with pytest.raises(UnsupportedByTransportError, match="supports_enlisted_publish"):
        publish(topic.name, 1, enlist=True)


def test_a_message_too_large_for_sqs_is_refused_with_the_claim_check_hint(aws):
    topic = provisioned(aws).topic

    # Within the topic's limit as the Database transport counts it; over SQS's once the SNS
    # envelope adds the message id, topic id, publisher and time.
    result = publish(topic.name, "x" * 261_980)

    assert result.error.code == "PayloadTooLarge"
    assert "SQS allows 262144" in result.error.message
    assert "payload_ref" in result.error.message


# -- consuming and fencing -------------------------------------------------------------------


def test_a_completed_delivery_is_deleted_from_the_queue(aws):
    subscription = provisioned(aws)
    publish(subscription.topic.name, {"n": 1})
    first = receiver(subscription)

    delivery = receive_one(first)
    settled = first.complete(delivery)

    assert (settled.outcome, settled.status) == (SettleOutcome.SETTLED, DeliveryStatus.COMPLETED)
    assert operations.subscription_stats(subscription.name).subscriptions[0].pending == 0
    assert operations.subscription_stats(subscription.name).subscriptions[0].in_flight == 0


def test_deliveries_received_hold_their_payloads_as_text_until_they_start(aws):
    """As on the Database transport (tests/runtime/test_prefetch.py): what a host claims ahead
    waits for a slot, and decoded a payload can take some 25 times its size. An AWS receive
    decoded each payload with its envelope, and kept it so: 4 deliveries of 256 KiB of {}
    held some 25 MB. They now hold the payload's JSON text, decoded as their handler starts."""
    subscription = provisioned(aws)
    holder = receiver(subscription)
    assert holder.receive(1).deliveries == []  # what the first call loads is not counted
    for _ in range(4):
        assert publish(subscription.topic.name, {"pad": SWOLLEN_PAYLOAD}).accepted
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        held = receive_all(holder, 4)
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert len(held) == 4
    assert after - before < 8 * 2**20, (
        f"4 deliveries received held {(after - before) / 2**20:.0f} MB of the host"
    )
    assert held[0].decoded_payload() == {"pad": SWOLLEN_PAYLOAD}


def test_a_payload_too_deep_to_write_again_is_kept_decoded_not_a_failed_claim():
    """One body written to the queue by hand, read at the recursion limit's edge, could fail
    to be written again as text; its claim must not fail with it (every delivery in it would
    stay hidden for its lease, and come back to fail again)."""
    deep: list[Any] = []
    for _ in range(sys.getrecursionlimit() * 2):
        deep = [deep]

    assert _payload_held_as_text(deep) == (deep, None)
    assert _payload_held_as_text({"n": 1}) == (None, '{"n":1}')


def test_a_stale_receipt_handle_is_refused_and_the_new_holder_keeps_the_message(aws):
    subscription = provisioned(aws, lease_seconds=5)
    publish(subscription.topic.name, {"n": 1})
    stale_holder, new_holder = receiver(subscription), receiver(subscription)
    stale = receive_one(stale_holder)
    time.sleep(5.2)  # the visibility timeout runs out: the message is visible again
    fresh = receive_one(new_holder)

    stale_complete = stale_holder.complete(stale)
    stale_retry = stale_holder.retry(stale, 0)
    stale_heartbeat = stale_holder.extend_lease(stale)

    assert fresh.delivery_id == stale.delivery_id and fresh.attempt == 2
    assert stale_complete.outcome == SettleOutcome.LEASE_LOST
    assert stale_retry.outcome == SettleOutcome.LEASE_LOST
    assert stale_heartbeat.state == "Lost"
    # SQS itself would have accepted the stale handle and deleted the message from under the
    # new holder; the receiver's own fence kept it, so the new holder settles it.
    assert new_holder.complete(fresh).outcome == SettleOutcome.SETTLED


def test_a_heartbeat_keeps_the_lease_beyond_its_first_timeout(aws):
    subscription = provisioned(aws, lease_seconds=5)
    publish(subscription.topic.name, {"n": 1})
    holder, other = receiver(subscription), receiver(subscription)
    delivery = receive_one(holder)

    for _ in range(3):
        time.sleep(2)
        assert holder.extend_lease(delivery).state == "Held"

    assert other.receive(1).deliveries == []
    assert holder.complete(delivery).settled


def test_retry_then_dead_letter_keeps_the_reason_and_replay_resets_the_attempts(aws):
    subscription = provisioned(aws, max_attempts=2)
    result = publish(subscription.topic.name, {"n": 1}, attributes={"kind": "a"})
    holder = receiver(subscription)

    first = receive_one(holder)
    assert holder.retry(first, 0, "boom").status == DeliveryStatus.PENDING
    second = receive_one(holder)
    assert second.attempt == 2
    dead = holder.dead_letter(second, "MaxAttemptsExceeded", "boom again")
    assert dead.status == DeliveryStatus.DEAD_LETTERED
    assert holder.receive(1).deliveries == []

    page = operations.list_dead_letters(subscription.name)
    [item] = page.items
    assert (item.reason, item.last_error, item.attempts, item.message_id, item.attributes) == (
        "MaxAttemptsExceeded",
        "boom again",
        2,
        result.message_id,
        {"kind": "a"},
    )
    assert operations.subscription_stats(subscription.name).subscriptions[0].dead_lettered == 1

    assert operations.replay(subscription.name, item.delivery_id).replayed
    replayed = receive_one(holder)
    assert (replayed.message_id, replayed.attempt, replayed.is_replay) == (
        result.message_id,
        1,
        True,
    )
    assert replayed.attributes == {"kind": "a"}
    assert operations.list_dead_letters(subscription.name).items == []


def test_reading_the_dead_letters_long_polls_so_every_sqs_server_is_asked(aws):
    """Audit helper-92: the scan received with WaitTimeSeconds=0, short polling, which asks a
    sample of SQS's servers and can answer empty while messages wait; the scan stops at its
    first empty answer. (moto answers every receive in full: only the request can be checked.)"""
    subscription = provisioned(aws, max_attempts=1)
    publish(subscription.topic.name, {"n": 1})
    holder = receiver(subscription)
    holder.dead_letter(receive_one(holder), "Poison")
    waits: list[int] = []
    sqs = holder.binding.clients.sqs
    event = "provide-client-params.sqs.ReceiveMessage"
    sqs.meta.events.register(
        event, lambda params, **_: waits.append(params["WaitTimeSeconds"]), unique_id="waits"
    )
    try:
        [item] = operations.list_dead_letters(subscription.name).items
    finally:
        sqs.meta.events.unregister(event, unique_id="waits")

    assert item.reason == "Poison"
    assert waits and min(waits) >= 1, waits


@pytest.mark.parametrize(
    "change",
    [
        "topic made FIFO",
        "topic renamed",
        "topic moved off AWS",
        "subscription renamed",
        "subscription moved",
        "subscription moved off AWS",
    ],
)
def test_a_change_that_would_leave_an_aws_queues_work_unread_is_refused(aws, change):
    """Audit helper-92: the transport names its SNS topics and SQS queues after the topology,
    so a topic made FIFO or a rename made `provision` create new ones while the messages
    waiting in the old ones were read by nobody (and deleted by SQS after 14 days)."""
    subscription = provisioned(aws)
    topic = subscription.topic
    assert publish(topic.name, {"n": 1}).accepted
    before = (topic.name, topic.is_fifo, subscription.name, subscription.topic_id)
    if change == "topic made FIFO":
        row, field, topic.is_fifo = topic, "is_fifo", True
    elif change == "topic renamed":
        row, field, topic.name = topic, "name", f"{topic.name}.v2"
    elif change == "topic moved off AWS":
        row, field, topic.transport = topic, "transport", TopicFactory().transport
    elif change == "subscription renamed":
        row, field, subscription.name = subscription, "name", f"{subscription.name}.v2"
    elif change == "subscription moved":
        row, field, subscription.topic = subscription, "topic", TopicFactory(transport=aws)
    else:
        row, field, subscription.topic = subscription, "topic", TopicFactory()

    with pytest.raises(TopologyValidationError, match="names its resources after this") as err:
        row.save()

    assert field in err.value.message_dict
    stored_topic, stored = (
        Topic.objects.get(pk=topic.pk),
        Subscription.objects.get(pk=subscription.pk),
    )
    assert (stored_topic.name, stored_topic.is_fifo, stored.name, stored.topic_id) == before


def test_a_subscription_may_move_onto_an_aws_topic(aws):
    """Review helper-93: the guard looked at the new topic's transport, so a Database
    subscription (no AWS queue to strand) could not move onto an AWS topic."""
    subscription = SubscriptionFactory()
    subscription.topic = TopicFactory(transport=aws)

    subscription.save()

    assert Subscription.objects.get(pk=subscription.pk).topic.transport == aws


def test_fifo_sends_never_reuse_a_deduplication_id_so_sqs_drops_no_dead_letter_or_replay(aws):
    """SQS FIFO remembers a deduplication id for five minutes, even once the message it came
    with was deleted, and silently drops a later send with it. A dead letter was sent with
    ``<delivery>-<attempt>`` and a replay with ``replay-<delivery>``: a replayed message that
    failed again at attempt 1 within five minutes was deleted from the queue while its dead
    letter was dropped, and a second replay was dropped too — the delivery existed nowhere.
    (moto forgets ids once their message is deleted, so the ids sent are what is checked.)"""
    subscription = provisioned(aws, fifo=True, partition_mode="Exclusive", max_attempts=1)
    sends: list[tuple[str, str]] = []

    def record(params: dict[str, Any], **_: Any) -> None:
        sends.append((params["QueueUrl"].rsplit("/", 1)[-1], params["MessageDeduplicationId"]))

    binding = QueueBinding.of(str(subscription.id))
    # A settle sends through the lease's client, a replay through the one-attempt one.
    for sqs in (binding.lease_sqs, binding.clients.sqs_once):
        sqs.meta.events.register("provide-client-params.sqs.SendMessage", record)
    publish(subscription.topic.name, {"n": 1}, partition_key="k")
    holder = receiver(subscription)
    for _ in range(2):
        poisoned = receive_one(holder)
        assert poisoned.attempt == 1
        assert holder.dead_letter(poisoned, "Poison", "boom").status == "DeadLettered"
        [item] = operations.list_dead_letters(subscription.name).items
        assert operations.replay(subscription.name, item.delivery_id).replayed

    assert receive_one(holder).attempt == 1  # the second replay arrived
    assert [queue.endswith("-dlq.fifo") for queue, _ in sends] == [True, False] * 2
    assert len({dedup for _, dedup in sends}) == len(sends), sends


def test_a_release_sent_twice_for_one_receive_stores_one_copy(aws):
    """A release whose send succeeded and whose delete failed is retried: each send had a
    random deduplication id, so two copies of the delivery ran."""
    subscription = provisioned(aws, fifo=True, partition_mode="Exclusive", lease_seconds=5)
    publish(subscription.topic.name, {"n": 1}, partition_key="k")
    holder = receiver(subscription)
    held = receive_one(holder)
    binding = QueueBinding.of(str(subscription.id))

    send_copy(binding, held, attempts_before=held.attempt - 1)
    send_copy(binding, held, attempts_before=held.attempt - 1)  # the retry
    holder.complete(held)  # the received message itself is gone: only the copies are left

    copies = []
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        for copy in holder.receive(10).deliveries:
            copies.append(copy)
            holder.complete(copy)
    assert [c.delivery_id for c in copies] == [held.delivery_id]


@pytest.mark.parametrize("fifo", [False, True], ids=["standard", "fifo"])
def test_a_release_gives_the_attempt_back_so_a_last_attempt_released_at_shutdown_runs(aws, fifo):
    options = {"partition_mode": "Exclusive"} if fifo else {}
    subscription = provisioned(aws, fifo=fifo, max_attempts=1, **options)
    sent = publish(subscription.topic, {"n": 1}, partition_key="k-1")
    holder = receiver(subscription)
    first = receive_one(holder)

    released = holder.release(first)  # a shutdown drain releases what it could not finish

    assert (released.outcome, released.status) == (SettleOutcome.SETTLED, DeliveryStatus.PENDING)
    again = receive_one(holder)
    # Not dead-lettered as LeaseExpired: the release gave the only attempt back.
    assert (again.message_id, again.delivery_id, again.attempt) == (
        sent.message_id,
        first.delivery_id,
        1,
    )
    assert (again.decoded_payload(), again.partition_key) == ({"n": 1}, "k-1")
    # The attempts still count: received once more (here after a retry, which the executor
    # would not make on a last attempt), it has none left.
    assert holder.retry(again, delay_seconds=0).settled
    assert holder.receive(1).expired_dead_letters[0].reason == "LeaseExpired"


def test_a_replayed_released_copy_that_sqs_redrove_starts_again_at_attempt_1(aws):
    subscription = provisioned(aws, max_attempts=3)
    publish(subscription.topic, {"n": 1})
    holder = receiver(subscription)
    first = receive_one(holder)
    assert holder.retry(first, 0, "boom").settled
    second = receive_one(holder)
    assert holder.release(second).settled  # the copy carries attempts_before=1
    binding = QueueBinding.of(str(subscription.id))
    # SQS's own redrive (the backstop) moves the copy's body as it is, attempts_before and all.
    copy = binding.clients.sqs.receive_message(QueueUrl=binding.queue_url, WaitTimeSeconds=1)
    (moved,) = copy["Messages"]
    assert json.loads(moved["Body"])["attempts_before"] == 1
    binding.clients.sqs.send_message(
        QueueUrl=binding.dead_letter_queue_url, MessageBody=moved["Body"]
    )
    binding.clients.sqs.delete_message(
        QueueUrl=binding.queue_url, ReceiptHandle=moved["ReceiptHandle"]
    )

    (item,) = operations.list_dead_letters(subscription.name).items
    assert operations.replay(subscription.name, item.delivery_id).replayed

    replayed = receive_one(holder)
    assert (replayed.delivery_id, replayed.attempt, replayed.is_replay) == (
        first.delivery_id,
        1,
        True,
    )


def test_a_dead_letter_can_be_discarded_by_id(aws):
    subscription = provisioned(aws)
    publish(subscription.topic.name, {"n": 1})
    holder = receiver(subscription)
    holder.dead_letter(receive_one(holder), "Fatal", "no")
    [item] = operations.list_dead_letters(subscription.name).items
    [gauges] = operations.queue_gauges().gauges
    assert (gauges.subscription_name, gauges.pending, gauges.dead_lettered) == (
        subscription.name,
        0,
        1,
    )

    outcome = operations.discard(subscription.name, item.delivery_id, reason="cleanup")

    assert outcome.discarded
    assert operations.list_dead_letters(subscription.name).items == []


def test_a_lease_that_expires_on_the_last_attempt_is_dead_lettered_as_lease_expired(aws):
    subscription = provisioned(aws, max_attempts=1, lease_seconds=5)
    publish(subscription.topic.name, {"n": 1})
    holder = receiver(subscription)
    receive_one(holder)  # and never settled: its holder "died"
    time.sleep(5.2)

    deadline = time.monotonic() + 10
    expired = []
    while not expired and time.monotonic() < deadline:
        result = holder.receive(1)
        assert result.deliveries == []
        expired = result.expired_dead_letters

    assert [e.reason for e in expired] == ["LeaseExpired"]
    [item] = operations.list_dead_letters(subscription.name).items
    assert item.reason == "LeaseExpired"


def test_an_exclusive_subscription_runs_one_message_per_key_at_a_time(aws):
    subscription = provisioned(aws, fifo=True, partition_mode="Exclusive")
    publish_many(
        subscription.topic,
        [{"payload": n, "partition_key": "k"} for n in range(3)]
        + [{"payload": 10, "partition_key": "other"}],
    )
    holder = receiver(subscription)

    first = holder.receive(10).deliveries
    assert sorted(d.decoded_payload() for d in first) == [0, 10]
    assert holder.receive(10).deliveries == []  # k's next waits for k's first
    holder.complete(next(d for d in first if d.decoded_payload() == 0))
    assert [d.decoded_payload() for d in holder.receive(10).deliveries] == [1]


def test_an_exclusive_claim_makes_at_most_ten_receive_calls_however_far_ahead_it_claims(aws):
    subscription = provisioned(aws, fifo=True, partition_mode="Exclusive")
    publish_many(subscription.topic, [{"payload": n, "partition_key": f"k{n}"} for n in range(15)])
    holder = receiver(subscription)

    first = holder.receive(200).deliveries  # as a host claiming ahead asks
    assert len(first) == 10
    assert len(holder.receive(200).deliveries) == 5


def test_an_ordered_subscription_on_aws_is_planned_unsupported_naming_the_capability(aws):
    subscription = SubscriptionFactory(topic=TopicFactory(transport=aws), partition_mode="Ordered")

    problem = AwsTransport.subscription_problem(subscription, aws.name)

    assert problem.startswith("Ordered needs supports_ordered")


def test_operator_verbs_the_aws_transport_lacks_are_refused(aws):
    subscription = provisioned(aws, fifo=True, partition_mode="Exclusive")

    with pytest.raises(UnsupportedByTransportError, match="supports_partition_listing"):
        operations.list_partitions(subscription.name)
    with pytest.raises(UnsupportedByTransportError, match="supports_bulk_discard_pending"):
        operations.discard_pending(
            subscription.name, operations.PendingSelection(), reason="cleanup"
        )


def test_binding_reads_the_subscription_and_topic(aws):
    subscription = provisioned(aws, fifo=True, partition_mode="Exclusive", lease_seconds=30)

    binding = QueueBinding.of(str(subscription.id))

    assert (binding.fifo, binding.exclusive, binding.lease_seconds) == (True, True, 30)
    assert binding.names.queue.endswith(".fifo")
    assert Topic.objects.get(pk=subscription.topic_id).is_fifo


def test_without_boto3_workqueue_imports_and_the_aws_transport_names_the_extra():
    # A fresh interpreter in which boto3 and botocore cannot be imported.
    script = (
        "import sys; sys.modules['boto3'] = None; sys.modules['botocore'] = None\n"
        "import workqueue, workqueue.publishing, workqueue.transports.aws as aws\n"
        "print(aws.AwsTransport.supports_exclusive)\n"
        "try:\n"
        "    aws.AwsClients(aws.AwsSettings(region='eu-west-1'))\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )

    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )

    assert done.stdout.splitlines() == [
        "True",
        "WorkQueueConfigurationError The AWS transport needs boto3: install django-workqueue's "
        'aws extra (pip install "django-workqueue[aws] @ file:///path/to/django-workqueue") or '
        "boto3 itself.",
    ]


# -- publish deduplication through the Database ledger --------------------------------------


def test_a_deduplication_key_is_reserved_sent_and_confirmed_in_the_ledger(aws):
    subscription = provisioned(aws)
    topic = subscription.topic

    owner = publish(topic.name, {"n": 1}, deduplication_key="order-1", deduplication_ttl=600)
    again = publish(topic.name, {"n": 2}, deduplication_key="order-1")
    other = publish_many(topic, [{"payload": {"n": 3}, "deduplication_key": "order-2"}] * 2)

    assert (owner.status, again.status, again.message_id) == (
        "Accepted",
        "Duplicate",
        owner.message_id,
    )
    assert [r.status for r in other] == ["Accepted", "Duplicate"]
    assert other[1].message_id == other[0].message_id
    ledger = Deduplication.objects.get(topic=topic, deduplication_key="order-1")
    assert (str(ledger.message_id), ledger.status) == (owner.message_id, "Confirmed")
    holder = receiver(subscription)
    got = []
    while (found := holder.receive(10).deliveries) or not got:
        got += found
    assert sorted(d.decoded_payload()["n"] for d in got) == [1, 3]


def test_a_failed_send_releases_the_deduplication_key(aws):
    subscription = provisioned(aws)
    topic = subscription.topic
    settings = AwsSettings.parse(aws.configuration)
    sns = clients_for(settings).sns
    topic_arn = clients_for(settings).topic_arn(
        AwsNames.of(settings.prefix, topic.name, "", False).topic
    )
    sns.delete_topic(TopicArn=topic_arn)  # SNS now refuses the publish

    failed = publish(topic.name, {"n": 1}, deduplication_key="order-1")

    assert (failed.status, failed.error.code) == ("Rejected", "TransportUnavailable")
    assert not Deduplication.objects.filter(topic=topic, deduplication_key="order-1").exists()
    transport_for("AWS").provision(aws, dry_run=False)
    assert publish(topic.name, {"n": 1}, deduplication_key="order-1").status == "Accepted"


# -- message ids through the Database ledger -------------------------------------------------


def message_id_answers(topic: Topic) -> list[tuple[str, str | None, str | None]]:
    """Publish one sequence of chosen message ids to ``topic`` and describe each result as
    (status, which id it names, error code), ids named by their role so that two topics'
    answers compare equal (a rejection names no id)."""
    ids = {role: str(uuid.uuid4()) for role in ("one", "two", "three", "four")}
    roles = {v: k for k, v in ids.items()}
    results = [
        *publish_many(
            topic,
            [
                {
                    "message_id": ids["one"],
                    "payload": {"a": 1, "b": [1, 2]},
                    "attributes": {"x": "1"},
                },
                # The same message, its JSON in another key order: a Duplicate.
                {
                    "message_id": ids["one"],
                    "payload": {"b": [1, 2], "a": 1.0},
                    "attributes": {"x": "1"},
                },
                # Another message under the same id: a conflict.
                {"message_id": ids["one"], "payload": {"a": 2}, "attributes": {"x": "1"}},
            ],
        ),
        publish(topic.name, {"a": 1, "b": [1, 2]}, attributes={"x": "1"}, message_id=ids["one"]),
        publish(topic.name, {"a": 1, "b": [1, 2]}, message_id=ids["one"]),  # no attributes
        publish(
            topic.name,
            {"a": 1, "b": [1, 2]},
            attributes={"x": "1"},
            message_id=ids["one"],
            correlation_id="c-1",
        ),
        publish(topic, {"k": 1}, message_id=ids["two"], deduplication_key="order-1"),
        # The key's owner answers first, whatever the id.
        publish(topic, {"k": 2}, message_id=ids["three"], deduplication_key="order-1"),
        # A new key with a conflicting id: rejected, and the key is left free ...
        publish(topic, {"k": 3}, message_id=ids["two"], deduplication_key="order-2"),
        # ... for the next message that brings it.
        publish(topic, {"k": 4}, message_id=ids["four"], deduplication_key="order-2"),
        *publish_many(
            topic, [{"message_id": ids["two"], "payload": {"k": 1}, "deduplication_key": "order-3"}]
        ),
    ]
    return [
        (r.status, roles.get(r.message_id or "", r.message_id), r.error.code if r.error else None)
        for r in results
    ]


def test_chosen_message_ids_answer_duplicate_and_conflict_as_on_the_database_transport(aws):
    database_topic = SubscriptionFactory().topic
    aws_topic = provisioned(aws).topic

    expected = message_id_answers(database_topic)
    answered = message_id_answers(aws_topic)

    assert expected == [
        ("Accepted", "one", None),
        ("Duplicate", "one", None),
        ("Rejected", None, "MessageIDConflict"),
        ("Duplicate", "one", None),
        ("Rejected", None, "MessageIDConflict"),
        ("Rejected", None, "MessageIDConflict"),
        ("Accepted", "two", None),
        ("Duplicate", "two", None),
        ("Rejected", None, "MessageIDConflict"),
        ("Accepted", "four", None),
        ("Duplicate", "two", None),
    ]
    assert answered == expected


def test_a_chosen_message_id_is_held_for_the_topic_retention_and_a_generated_one_costs_nothing(
    aws,
):
    subscription = provisioned(aws)
    topic = subscription.topic
    chosen = str(uuid.uuid4())

    generated = publish_many(topic, [{"payload": {"n": 1}}, {"payload": {"n": 2}}])
    assert [r.status for r in generated] == ["Accepted", "Accepted"]
    assert not Deduplication.objects.filter(topic=topic).exists()

    assert publish(topic, {"n": 3}, message_id=chosen).status == "Accepted"
    held = Deduplication.objects.get(topic=topic)
    assert (held.deduplication_key, held.status) == (f" message-id:{chosen}", "Confirmed")
    window = (held.expires_at - timezone.now()).total_seconds()
    assert topic.retention_days * 86_400 - 60 < window <= topic.retention_days * 86_400
    # A publisher's key never takes the ledger's form: keys are stripped.
    same_text = publish(topic, {"n": 4}, deduplication_key=f" message-id:{chosen}")
    assert same_text.status == "Accepted"
    assert Deduplication.objects.filter(
        topic=topic, deduplication_key=f"message-id:{chosen}"
    ).exists()


def test_a_failed_send_releases_the_chosen_message_id(aws):
    subscription = provisioned(aws)
    topic = subscription.topic
    settings = AwsSettings.parse(aws.configuration)
    topic_arn = clients_for(settings).topic_arn(
        AwsNames.of(settings.prefix, topic.name, "", False).topic
    )
    clients_for(settings).sns.delete_topic(TopicArn=topic_arn)  # SNS now refuses the publish
    chosen = str(uuid.uuid4())

    failed = publish(topic.name, {"n": 1}, message_id=chosen)

    assert (failed.status, failed.error.code) == ("Rejected", "TransportUnavailable")
    assert not Deduplication.objects.filter(topic=topic).exists()
    transport_for("AWS").provision(aws, dry_run=False)
    # Not a conflict: nothing was sent under the id, so other content may take it.
    assert publish(topic.name, {"n": 2}, message_id=chosen).status == "Accepted"


def test_the_rest_api_publishes_to_an_aws_topic_with_message_ids_as_on_the_database(aws, client):
    subscription = provisioned(aws)
    Topic.objects.filter(pk=subscription.topic.pk).update(allow_external_publish=True)
    key = ApiKeyFactory(scopes=["workqueue:publish"])
    chosen = str(uuid.uuid4())
    body = {"messages": [{"messageId": chosen, "payload": {"n": 1}, "attributes": {"a": "1"}}]}

    first = rest_post(client, subscription.topic.name, body, key=key)
    again = rest_post(client, subscription.topic.name, body, key=key)
    body["messages"][0]["payload"] = {"n": 2}
    conflict = rest_post(client, subscription.topic.name, body, key=key)

    assert [r.status_code for r in (first, again, conflict)] == [202, 202, 202]
    assert [
        (r["status"], r["messageId"], (r.get("error") or {}).get("code"))
        for answer in (first, again, conflict)
        for r in answer.json()["results"]
    ] == [
        ("Accepted", chosen, None),
        ("Duplicate", chosen, None),
        ("Rejected", None, "MessageIDConflict"),
    ]
    delivered = receive_all(receiver(subscription), 1)
    assert [(d.message_id, d.decoded_payload(), d.attributes) for d in delivered] == [
        (chosen, {"n": 1}, {"a": "1"})
    ]
    assert receiver(subscription).receive(10).deliveries == []


# -- operator surfaces on AWS subscriptions --------------------------------------------------


def test_validate_bindings_and_health_report_aws_work_that_no_live_host_runs(aws, admin_client):
    waiting = provisioned(aws)
    idle = SubscriptionFactory(topic=TopicFactory(transport=aws))
    transport_for("AWS").provision(aws, dry_run=False)
    # Saved after provisioning: its queue does not exist, so its backlog cannot be read.
    unprovisioned = SubscriptionFactory(topic=idle.topic)
    assert [r.status for r in publish_many(waiting.topic, [{"payload": {"n": 1}}] * 2)] == [
        "Accepted",
        "Accepted",
    ]
    wait_until(lambda: transport_for("AWS").backlog(str(waiting.id)).claimable == 2)
    missing_queue = AwsNames.of(
        aws.configuration["prefix"], idle.topic.name, unprovisioned.name, False
    ).queue

    issues = {
        (i.subject, i.message)
        for i in operations.validate_bindings("aws-test")
        if "due" in i.message or "backlog" in i.message
    }

    assert issues == {
        (
            f"subscription {waiting.name}",
            "2 deliveries are due and no live host runs this subscription; they wait until one "
            f"does. Start a host that runs it (`manage.py workqueue_host -s {waiting.name}`, or "
            "'*' in WORKQUEUE['SUBSCRIPTIONS']), or pause the subscription.",
        ),
        (
            f"subscription {unprovisioned.name}",
            "Its backlog could not be read, so whether work waits for it is unknown: The SQS "
            f"queue {missing_queue!r} does not exist: run `manage.py workqueue provision`.",
        ),
    }
    health = admin_client.get("/work-queue/health").json()
    assert [(s["name"], s["state"], s["reason"]) for s in health["subscriptions"]] == [
        (waiting.name, "NotRunning", "No live host runs it; 2 deliveries are due.")
    ]


def test_validate_bindings_warns_until_the_aws_resources_are_provisioned(aws):
    subscription = SubscriptionFactory(topic=TopicFactory(transport=aws))

    def provisioning_issues() -> list[tuple[str, str, str]]:
        return [
            (i.severity, i.subject, i.message)
            for i in operations.validate_bindings("aws-test")
            if "provision" in i.message and i.subject.startswith("transport")
        ]

    ((severity, subject, message),) = provisioning_issues()
    assert (severity, subject) == ("Warning", "transport aws-test")
    names = AwsNames.of(
        aws.configuration["prefix"], subscription.topic.name, subscription.name, False
    )
    assert f"create sqs-queue {names.queue}" in message
    assert "manage.py workqueue provision --transport aws-test" in message

    transport_for("AWS").provision(aws, dry_run=False)
    assert provisioning_issues() == []


def test_only_those_who_may_change_transports_have_validate_bindings_call_aws(
    aws, client, monkeypatch
):
    """The provisioning dry run calls AWS with the server's credentials. The REST
    bindings/validate ran it for any reader; now a reader who may not change transports is
    told it was not checked, and it does not run (the backlog's queue counts still do)."""
    SubscriptionFactory(topic=TopicFactory(transport=aws))
    calls: list[str] = []
    provision = transport_for("AWS").provision

    def recording(self: Any, row: Any, *, dry_run: bool) -> Any:
        calls.append(row.name)
        return provision(row, dry_run=dry_run)

    monkeypatch.setattr(type(transport_for("AWS")), "provision", recording)
    reader = ApiKeyFactory(
        scopes=["workqueue:read"], owner=UserFactory(perms=["workqueue.view_delivery"])
    )
    editor = ApiKeyFactory(
        scopes=["workqueue:read"],
        owner=UserFactory(perms=["workqueue.view_delivery", "workqueue.change_transport"]),
    )

    def transport_issues(key: Any) -> list[str]:
        response = client.get("/work-queue/bindings/validate", headers={"X-API-Key": key.raw_key})
        assert response.status_code == 200, response.content
        return [
            i["message"] for i in response.json()["issues"] if i["subject"] == "transport aws-test"
        ]

    read_only = transport_issues(reader)
    assert calls == []
    assert ["not checked" in m and "workqueue.change_transport" in m for m in read_only] == [True]
    edited = transport_issues(editor)
    assert calls == ["aws-test"]
    assert any("do not match the topology" in m for m in edited), edited


def dashboard_cells(html: str, subscription_name: str) -> dict[str, str]:
    """The dashboard's cells for one subscription, by class, as text (links kept as href)."""
    row = re.search(
        rf'<tr data-subscription="{re.escape(subscription_name)}">(.*?)</tr>', html, re.S
    )
    assert row is not None, f"no dashboard row for {subscription_name}"
    cells = {}
    for css, inner in re.findall(r'<td class="num ([a-z-]+)"[^>]*>(.*?)</td>', row.group(1), re.S):
        link = re.search(r'href="([^"]+)"', inner)
        cells[css] = re.sub(r"<[^>]+>", "", inner).strip() + (
            f" -> {link.group(1)}" if link else ""
        )
    return cells


def test_the_dashboard_shows_aws_subscriptions_from_their_queue_counts(aws, admin_client):
    subscription = provisioned(aws)
    publish_many(subscription.topic, [{"payload": {"n": n}} for n in range(3)])
    holder = receiver(subscription)
    poisoned = receive_one(holder)
    assert holder.dead_letter(poisoned, "Poison", "bad input").settled
    receive_one(holder)  # held: in flight

    response = admin_client.get(reverse("admin:workqueue_dashboard"))

    assert response.status_code == 200
    assert dashboard_cells(response.content.decode(), subscription.name) == {
        "pending": "1",
        "in-flight": "1",
        # Its dead letters are in SQS, not in the Delivery table: the link lists them there.
        "dead-lettered": f"1 -> /work-queue/subscriptions/{subscription.name}/dead-letters",
        "blocked-keys": "—",
        "oldest-pending": "—",
        # SQS keeps no history of completions: not known, rather than 0.
        "completed": "—",
    }
    assert response.context["not_charted"] == [subscription.name]
    listed = admin_client.get(f"/work-queue/subscriptions/{subscription.name}/dead-letters")
    assert [i["deliveryId"] for i in listed.json()["items"]] == [poisoned.delivery_id]


def test_operator_actions_the_aws_transport_cannot_do_are_refused_clearly_on_every_surface(
    aws, admin_client
):
    subscription = provisioned(aws, fifo=True, partition_mode="Exclusive")
    base = f"/work-queue/subscriptions/{subscription.name}"

    for method, path, body in (
        ("get", f"{base}/partitions", None),
        ("post", f"{base}/pending/discard", {"reason": "cleanup"}),
    ):
        answer = getattr(admin_client, method)(
            path, *([] if body is None else [body]), content_type="application/json"
        )
        assert answer.status_code == 409, (path, answer.content)
        assert answer.json()["capability"] in {
            "supports_partition_listing",
            "supports_bulk_discard_pending",
        }

    url = reverse("admin:workqueue_subscription_changelist")
    form = {
        "action": "recover_dead_letters",
        "_selected_action": [subscription.pk],
        "operation": "discard_pending",
        "note": "cleanup",
    }
    counted = admin_client.post(url, {**form, "post": "count"})
    assert counted.status_code == 200
    ((name, said),) = counted.context["counts"]
    assert name == subscription.name
    assert said.startswith("not supported: ") and "supports_bulk_discard_pending" in said
    applied = admin_client.post(
        url, {**form, "post": "apply", "counted": counted.context["counted"]}, follow=True
    )
    assert applied.status_code == 200
    (message,) = applied.context["messages"]
    assert "supports_bulk_discard_pending" in str(message) and message.level_tag == "warning"


def test_the_database_scaler_query_is_refused_for_an_aws_subscription_naming_its_queue(aws):
    subscription = provisioned(aws)
    queue = AwsNames.of(
        aws.configuration["prefix"], subscription.topic.name, subscription.name, False
    ).queue

    # The query reads the queue tables, where an AWS subscription's messages never are: it
    # would always answer 0 and an autoscaler would never start a job.
    with pytest.raises(CommandError) as refused:
        call_command("workqueue", "scaler-query", "-s", subscription.name)

    said = str(refused.value)
    assert "aws-sqs-queue" in said and repr(queue) in said
    assert aws.configuration["region"] in said


def test_retiring_an_aws_subscription_counts_its_queue_and_never_drops_messages_silently(aws):
    subscription = provisioned(aws)
    publish(subscription.topic, {"n": 1})
    wait_until(lambda: transport_for("AWS").backlog(str(subscription.id)).claimable == 1)

    def retire(*args: str) -> str:
        out = io.StringIO()
        call_command("workqueue", "retire-subscription", subscription.name, *args, stdout=out)
        return out.getvalue()

    # A message waits in its SQS queue: refused, as on the Database transport.
    with pytest.raises(CommandError, match="1 Pending and 0 dead-lettered"):
        retire()
    # Discarding what waits would need the queue emptied by id: refused, naming the flag.
    with pytest.raises(CommandError, match="supports_bulk_discard_pending"):
        retire("--discard-pending")
    assert Subscription.objects.get(pk=subscription.pk).status == "Active"

    holder = receiver(subscription)
    assert holder.complete(receive_one(holder)).settled
    wait_until(
        lambda: transport_for("AWS").subscription_stats(str(subscription.id))["pending"] == 0
    )
    said = retire()

    assert not Subscription.objects.filter(pk=subscription.pk).exists()
    assert "Deleted subscription" in said
    # Provisioning never deletes: the operator is told what is left behind in AWS.
    assert "not deleted" in said and "AWS" in said


def workqueue_cli(*args: str) -> str:
    out = io.StringIO()
    call_command("workqueue", *args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def test_the_operator_cli_works_on_an_aws_subscription(aws):
    subscription = provisioned(aws, max_attempts=1)
    name = subscription.name
    publish_many(subscription.topic, [{"payload": {"n": n}} for n in range(3)])
    holder = receiver(subscription)
    dead = [receive_one(holder) for _ in range(3)]
    for delivery in dead:
        assert holder.dead_letter(delivery, "Poison", "ValueError: bad input").settled

    stats = json.loads(workqueue_cli("stats", "-s", name, "--json"))["subscriptions"][0]
    assert (stats["pending"], stats["dead_lettered"], stats["completed_last_hour"]) == (0, 3, None)
    assert "-" in workqueue_cli("stats", "-s", name).splitlines()[-1]
    listed = json.loads(workqueue_cli("dead-letters", "-s", name, "--json"))["items"]
    assert sorted(i["delivery_id"] for i in listed) == sorted(d.delivery_id for d in dead)
    assert {i["reason"] for i in listed} == {"Poison"}

    assert "Replayed" in workqueue_cli("replay", "-s", name, "--delivery", dead[0].delivery_id)
    discarded = workqueue_cli(
        "discard", "-s", name, "--delivery", dead[1].delivery_id, "--reason", "spam"
    )
    assert "Discarded" in discarded
    counted = workqueue_cli(
        "replay-dead-letters", "-s", name, "--error-contains", "bad input", "--dry-run"
    )
    assert "1 of 1" in counted
    workqueue_cli("replay-dead-letters", "-s", name, "--error-contains", "bad input")
    backlog = json.loads(workqueue_cli("backlog", "-s", name, "--json"))
    assert backlog["claimable"] == 2
    assert json.loads(workqueue_cli("dead-letters", "-s", name, "--json"))["items"] == []
    replayed = receive_all(holder, 2)
    assert sorted(d.delivery_id for d in replayed) == sorted(
        [dead[0].delivery_id, dead[2].delivery_id]
    )
    assert all(d.attempt == 1 and d.is_replay for d in replayed)
    metrics = workqueue_cli("metrics").splitlines()
    assert f'workqueue_in_flight_deliveries{{subscription="{name}"}} 2.0' in metrics
    assert f'workqueue_dead_lettered_deliveries{{subscription="{name}"}} 0.0' in metrics


def test_the_admin_shows_what_provisioning_would_change_without_creating_it(aws, admin_client):
    SubscriptionFactory(topic=TopicFactory(transport=aws, name="adm.orders"), name="adm.orders.a")
    prefix = aws.configuration["prefix"]
    url = reverse("admin:workqueue_transport_changelist")
    action = {"action": "show_provisioning", "_selected_action": [str(aws.pk)]}

    shown = admin_client.post(url, action, follow=True)

    said = [str(m) for m in shown.context["messages"]]
    assert f"aws-test: would create sns-topic {prefix}-adm--orders" in said
    assert f"aws-test: would create sqs-queue {prefix}-adm--orders--a" in " ".join(said)
    assert transport_for("AWS").provision(aws, dry_run=True)[0].action == "create"

    transport_for("AWS").provision(aws, dry_run=False)
    again = admin_client.post(url, action, follow=True)
    assert [str(m) for m in again.context["messages"]] == ["aws-test: no changes."]


@pytest.mark.parametrize("credentials", [True, False], ids=["unreachable", "no-credentials"])
def test_a_queue_lookup_that_cannot_reach_aws_is_reported_as_unavailable_not_raised_raw(
    monkeypatch, credentials
):
    # Mid-way through provisioning (or its dry run in validate-bindings) SQS stops answering,
    # or there are no credentials: botocore raises its own errors, which must reach callers as
    # the transport's TransportUnavailableError (a warning in validate-bindings), never raw.
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    if credentials:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    unreachable = AwsClients(AwsSettings(region="eu-west-1", endpoint_url="http://127.0.0.1:9"))

    with pytest.raises(TransportUnavailableError, match="get_queue_url"):
        _Provisioner(unreachable, dry_run=True).queue("wq-nowhere", False, {})


@pytest.fixture
def unreachable(monkeypatch) -> Transport:
    """An AWS Transport row whose endpoint nothing listens on (credentials set, so that
    botocore gets as far as trying to connect)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    return TransportFactory(
        name="aws-down",
        driver_class="AWS",
        configuration={"region": "eu-west-1", "endpoint_url": "http://127.0.0.1:9"},
    )


def test_a_publish_that_cannot_reach_aws_is_rejected_as_unavailable_not_raised(unreachable):
    """The topic's ARN is looked up at a process's first publish to it, outside the error
    handling of the send: that one publish raised where every later one answered Rejected."""
    topic = TopicFactory(transport=unreachable)

    single = publish(topic.name, {"n": 1})
    batch = publish_many(topic.name, [{"payload": 2}, {"payload": 3}])

    assert [(r.status, r.error.code) for r in (single, *batch)] == [
        ("Rejected", "TransportUnavailable")
    ] * 3
    assert single.error.retryable and "could not" in single.error.message


def test_a_reader_is_not_shown_what_aws_said_when_a_backlog_cannot_be_read(
    monkeypatch, client, caplog
):
    """Audit helper-94: validate-bindings quoted the transport's error when a subscription's
    backlog could not be read: the endpoint (with any credentials written into its URL) and,
    from AWS, the server's IAM identity and account, to any reader, a key limited to that one
    subscription included. Those who may change transports still read it; others are told the
    transport could not be reached, and the log has the rest."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    down = TransportFactory(
        name="aws-down",
        driver_class="AWS",
        configuration={"region": "eu-west-1", "endpoint_url": "http://user:hunter2@127.0.0.1:9"},
    )
    subscription = SubscriptionFactory(topic=TopicFactory(transport=down))
    reader = ApiKeyFactory(
        scopes=["workqueue:read"],
        owner=UserFactory(perms=["workqueue.view_delivery"]),
        subscriptions=[subscription.name],
    )
    editor = ApiKeyFactory(
        scopes=["workqueue:read"],
        owner=UserFactory(perms=["workqueue.view_delivery", "workqueue.change_transport"]),
    )

    def backlog_issue(key: Any) -> str:
        response = client.get("/work-queue/bindings/validate", headers={"X-API-Key": key.raw_key})
        assert response.status_code == 200, response.content
        [message] = [
            i["message"]
            for i in response.json()["issues"]
            if i["subject"] == f"subscription {subscription.name}"
            and "backlog could not be read" in i["message"]
        ]
        return message

    told = backlog_issue(reader)
    assert "hunter2" not in told and "127.0.0.1" not in told, told
    assert "the server's log says why" in told
    assert "127.0.0.1" in caplog.text  # the operators are told
    shown = backlog_issue(editor)
    assert "127.0.0.1" in shown
    # The endpoint's password is written nowhere (review helper-97: it was logged).
    assert "hunter2" not in shown and "hunter2" not in caplog.text


def test_a_profile_this_machine_lacks_is_named_as_a_configuration_mistake(monkeypatch):
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    settings = AwsSettings(region="eu-west-1", profile="no-such-profile")

    with pytest.raises(WorkQueueConfigurationError, match=r"'no-such-profile'.*set 'profile'"):
        AwsClients(settings)


def test_stats_that_cannot_be_read_exit_non_zero(unreachable):
    """The table came out with the subscription missing, its error on stderr, and exit 0:
    a script or monitor reading the exit code saw success."""
    subscription = SubscriptionFactory(topic=TopicFactory(transport=unreachable))
    err = io.StringIO()

    for json_too in ([], ["--json"]):
        with pytest.raises(CommandError, match=r"Stats of 1 subscription\(s\) could not be read"):
            call_command("workqueue", "stats", "-s", subscription.name, *json_too, stderr=err)


# -- failures part way, and limits moto does not check (audit helper-69) ---------------------


def test_a_receive_call_failing_part_way_through_a_claim_hands_over_what_it_received(
    aws, monkeypatch
):
    """An Exclusive claim makes up to ten ReceiveMessage calls; when a later one failed, the
    messages earlier calls had received were dropped: hidden for their lease with an attempt
    spent, and on a last attempt dead-lettered (LeaseExpired) without ever running."""
    subscription = provisioned(aws, fifo=True, partition_mode="Exclusive", max_attempts=1)
    publish_many(subscription.topic, [{"payload": n, "partition_key": f"k{n}"} for n in range(2)])
    holder = receiver(subscription)
    sqs = holder.binding.clients.sqs
    original = sqs.receive_message
    calls: list[int] = []

    def second_call_fails(**params: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise EndpointConnectionError(endpoint_url="http://sqs.invalid")
        return original(**params)

    monkeypatch.setattr(sqs, "receive_message", second_call_fails)
    claimed = holder.receive(10).deliveries

    assert len(calls) == 2
    assert len(claimed) == 1
    assert holder.complete(claimed[0]).settled


def test_a_retry_asking_past_twelve_hours_hides_the_message_as_long_as_sqs_allows(aws):
    """The delay was capped at exactly 12 hours from the retry; SQS counts its cap from the
    receive, refused it, and the message came back at the end of its lease."""
    subscription = provisioned(aws, lease_seconds=5)
    publish(subscription.topic.name, {"n": 1})
    holder = receiver(subscription)
    delivery = receive_one(holder)
    time.sleep(1.1)  # the handler ran a second
    asked: list[int] = []
    sqs = holder.binding.lease_sqs
    sqs.meta.events.register(
        "provide-client-params.sqs.ChangeMessageVisibility",
        lambda params, **_: asked.append(params["VisibilityTimeout"]),
        unique_id="asked",
    )
    try:
        settled = holder.retry(delivery, 86_400, "rate limited for a day")
    finally:
        sqs.meta.events.unregister(
            "provide-client-params.sqs.ChangeMessageVisibility", unique_id="asked"
        )

    assert settled.settled
    [visibility] = asked
    assert 43_200 - 30 <= visibility <= 43_200 - 11  # 12 h after the receive, less a margin


def test_a_retry_waits_out_its_backoff_delayed_not_in_flight_on_a_standard_queue(aws):
    """Audit helper-94: a retry hid the message for its backoff, and SQS counts a hidden
    message in flight: past 120,000 in flight a standard queue takes no receive (its long polls
    answer empty, with no error), so an outage whose failures waited out long backoffs hidden
    would stop fresh work, silently. A retry of up to 15 minutes now sends a delayed copy
    (its attempt spent) and deletes the received message."""
    subscription = provisioned(aws, lease_seconds=30)
    publish(subscription.topic.name, {"n": 1})
    holder = receiver(subscription)
    delivery = receive_one(holder)

    assert holder.retry(delivery, 2, "downstream away").settled

    counts = holder.binding.clients.sqs.get_queue_attributes(
        QueueUrl=holder.binding.queue_url,
        AttributeNames=[
            "ApproximateNumberOfMessagesNotVisible",
            "ApproximateNumberOfMessagesDelayed",
        ],
    )["Attributes"]
    assert counts == {
        "ApproximateNumberOfMessagesNotVisible": "0",
        "ApproximateNumberOfMessagesDelayed": "1",
    }
    assert holder.receive(10).deliveries == []  # not before its delay
    again = receive_one(holder)
    assert (again.delivery_id, again.attempt, again.decoded_payload()) == (
        delivery.delivery_id,
        2,
        {"n": 1},
    )


def test_a_heartbeat_near_twelve_hours_from_the_receive_renews_what_sqs_allows(aws):
    """Audit helper-92: each heartbeat asked SQS for a whole lease from now, past 12 hours from
    the receive, which SQS refuses: the refusal read as a lost lease, so a 12-hour lease was
    lost at its first heartbeat. A renewal now grants what is left, and says so."""
    subscription = provisioned(aws, lease_seconds=43_200)
    publish(subscription.topic.name, {"n": 1})
    holder = receiver(subscription)
    delivery = receive_one(holder)
    time.sleep(1.1)  # the handler ran a second

    extension = holder.extend_lease(delivery)

    assert extension.state == "Held", extension
    assert 43_200 - 30 <= extension.granted_seconds <= 43_200 - 11
    assert holder.complete(delivery).settled


@pytest.fixture
def rig() -> Iterator[ExecutionRig]:
    probe.reset()
    found = ExecutionRig(registry, get_user_model().objects.create_user("workqueue-system"))
    yield found
    found.close()


def test_a_lease_lost_on_aws_is_reported_as_lost_not_as_a_cancel_that_failed(aws, rig):
    """A refused settle was taken for a cancel that landed meanwhile and acknowledged: the AWS
    receiver has no cancels, so every lost lease was logged as an error and counted Failed."""
    subscription = provisioned(aws, handler_key="t.script", lease_seconds=5)
    publish(subscription.topic.name, {"then": "retry"})
    holder = receiver(subscription)
    delivery = receive_one(holder)
    holder._let_go(delivery)  # its lease ran out here (the receiver fences by its clock)

    result = rig.execution(subscription, holder, delivery).run()

    assert (result.kind, result.error) == ("LeaseLost", None)


@pytest.fixture
def slow_network(monkeypatch) -> Any:
    """Calls on the SQS operation the test names (``slow_network.operation``) first run
    ``slow_network.before(request)`` (count it, stall it, time it out), then go as usual."""
    from botocore.exceptions import ReadTimeoutError
    from botocore.httpsession import URLLib3Session

    rig = type("SlowNetwork", (), {"operation": "", "calls": 0})()
    rig.before = lambda request: None
    real = URLLib3Session.send

    def time_out_once(operation: str) -> None:
        """The first call of ``operation`` times out (as if the network dropped its answer)."""
        rig.operation = operation

        def first_times_out(request: Any) -> None:
            if rig.calls == 1:
                raise ReadTimeoutError(endpoint_url=request.url)

        rig.before = first_times_out

    rig.time_out_once = time_out_once

    def send(session: Any, request: Any) -> Any:
        target = request.headers.get("X-Amz-Target", b"")
        if rig.operation and target.endswith(rig.operation.encode()):
            rig.calls += 1
            rig.before(request)
        return real(session, request)

    monkeypatch.setattr(URLLib3Session, "send", send)
    return rig


def test_a_call_on_a_held_message_makes_one_attempt(aws, slow_network):
    """Audit helper-94: settles and heartbeats went through a client that retried up to three
    times over about a minute, past the lease checked before the call: a visibility change
    that landed after another consumer had received the message cut its lease short, and a
    third then received it too. One attempt now, its timeouts within LEASE_CALL_SECONDS."""
    from botocore.exceptions import ReadTimeoutError

    subscription = provisioned(aws, lease_seconds=30)
    publish(subscription.topic.name, {"n": 1})
    holder = receiver(subscription)
    delivery = receive_one(holder)
    slow_network.operation = "ChangeMessageVisibility"

    def timed_out(request: Any) -> None:
        raise ReadTimeoutError(endpoint_url=request.url)

    slow_network.before = timed_out

    with pytest.raises(TransportUnavailableError):
        holder.retry(delivery, 0)
    assert slow_network.calls == 1
    config = holder.binding.lease_sqs.meta.config
    assert config.connect_timeout + config.read_timeout <= 3.0


def test_no_call_on_a_held_message_starts_with_less_of_the_lease_left_than_it_may_take(
    aws, slow_network
):
    """A settle with less of the lease left than the call may take is a lost lease, and makes
    no call: a retry's visibility change could otherwise land after the message came back."""
    subscription = provisioned(aws, lease_seconds=30)  # a call may take up to 3 s
    publish(subscription.topic.name, {"n": 1})
    holder = receiver(subscription)
    delivery = receive_one(holder)
    slow_network.operation = "ChangeMessageVisibility"
    # As if the handler ran 28 s: its holder's clock says 1.5 s are left of the lease.
    holder._leases[delivery.lease_token] = time.monotonic() + 1.5 - 0.5
    assert holder._holds(delivery)

    assert holder.retry(delivery, 0).outcome == SettleOutcome.LEASE_LOST
    assert slow_network.calls == 0


def test_a_heartbeat_answered_after_the_lease_ran_out_does_not_bring_it_back(aws, slow_network):
    """Audit helper-94: a renewal whose answer came late (the network stalled past the lease)
    set the holder's lease anew: the message, received by another consumer meanwhile, had two
    holders, and the first one's completion deleted it under the second."""
    subscription = provisioned(aws, lease_seconds=5)
    publish(subscription.topic.name, {"n": 1})
    holder = receiver(subscription)
    delivery = receive_one(holder)
    slow_network.operation = "ChangeMessageVisibility"
    slow_network.before = lambda request: time.sleep(5)

    assert holder.extend_lease(delivery).state == "Lost"
    assert holder.complete(delivery).outcome == SettleOutcome.LEASE_LOST


def test_a_settle_that_fails_once_on_aws_is_made_again_while_the_lease_lasts(
    aws, rig, slow_network
):
    """Review helper-97: calls on a held message make one attempt, and the host retried only a
    database's transient errors: one SQS timeout on the DeleteMessage failed the settle, and
    the message ran again after its lease. The host makes it again, as for a lost connection."""
    subscription = provisioned(aws, handler_key="t.script", lease_seconds=30)
    publish(subscription.topic.name, {"then": "complete"})
    holder = receiver(subscription)
    delivery = receive_one(holder)
    slow_network.time_out_once("DeleteMessage")

    result = rig.execution(subscription, holder, delivery).run()

    assert (result.kind, result.status) == ("Settled", "Completed")
    assert slow_network.calls == 2
    assert holder.receive(10).deliveries == []


@pytest.mark.parametrize("settle", ["release", "dead_letter"])
def test_a_settle_made_again_after_its_delete_failed_sends_one_copy(aws, slow_network, settle):
    """Review helpers 97 and 99: a release (or retry) sends a copy, a dead letter a DLQ message,
    then deletes the received message; made again after the delete failed, each sent a second
    one: a standard queue kept both copies to run at once, the DLQ listed the dead letter
    twice. The receiver remembers what it sent for the message it holds."""
    subscription = provisioned(aws, lease_seconds=30)
    publish(subscription.topic.name, {"n": 1})
    holder = receiver(subscription)
    delivery = receive_one(holder)
    slow_network.time_out_once("DeleteMessage")
    make = (
        (lambda: holder.release(delivery))
        if settle == "release"
        else (lambda: holder.dead_letter(delivery, "Fatal", "no"))
    )

    with pytest.raises(TransientTransportError):
        make()
    assert make().settled

    if settle == "dead_letter":
        assert [i.delivery_id for i in operations.list_dead_letters(subscription.name).items] == [
            delivery.delivery_id
        ]
        return
    copies = receive_all(holder, 1)
    time.sleep(1.5)  # a second copy would be visible by now
    copies += holder.receive(10).deliveries
    assert [c.delivery_id for c in copies] == [delivery.delivery_id]


def test_a_settle_aws_refuses_is_not_made_again_until_the_lease_runs_out(aws, rig):
    """Review helper-99: every failure of a call on a held message was made again while the
    lease lasted, a refusal too (denied by IAM or KMS), holding one of a consumer's two settle
    threads for the whole lease. A refusal fails the settle at once; the message comes back at
    the end of its lease."""
    subscription = provisioned(aws, handler_key="t.script", lease_seconds=30)
    publish(subscription.topic.name, {"then": "complete"})
    holder = receiver(subscription)
    delivery = receive_one(holder)
    calls: list[int] = []

    def denied(**_: Any) -> Any:
        calls.append(1)
        error = {"Code": "AccessDenied", "Message": "not authorized to sqs:DeleteMessage"}
        return (
            type("Response", (), {"status_code": 403, "headers": {}})(),
            {"Error": error, "ResponseMetadata": {"HTTPStatusCode": 403}},
        )

    sqs = holder.binding.lease_sqs
    sqs.meta.events.register("before-call.sqs.DeleteMessage", denied, unique_id="denied")
    try:
        result = rig.execution(subscription, holder, delivery).run()
    finally:
        sqs.meta.events.unregister("before-call.sqs.DeleteMessage", unique_id="denied")

    assert result.kind == "Failed" and "AccessDenied" in result.error
    assert calls == [1]


def test_a_last_attempt_whose_lease_expired_is_dead_lettered_with_max_attempts(aws):
    # The receive that finds it counted too: the dead letter said 2 of max_attempts 1.
    subscription = provisioned(aws, max_attempts=1, lease_seconds=5)
    publish(subscription.topic.name, {"n": 1})
    holder = receiver(subscription)
    receive_one(holder)
    time.sleep(5.2)
    deadline = time.monotonic() + 10
    while not holder.receive(1).expired_dead_letters and time.monotonic() < deadline:
        pass

    [item] = operations.list_dead_letters(subscription.name).items
    assert (item.reason, item.attempts) == ("LeaseExpired", 1)


def test_a_dead_letters_attributes_carry_only_characters_sqs_accepts(aws):
    """SQS refuses a string attribute holding a character it refuses in a body (a traceback's
    terminal colours): the move to the DLQ failed, the message ran again."""
    subscription = provisioned(aws)
    publish(subscription.topic.name, {"n": 1})
    holder = receiver(subscription)
    delivery = receive_one(holder)
    sent, undo = _capture(holder.binding.lease_sqs, "sqs.SendMessage")  # a settle's client
    try:
        error = "CalledProcessError: \x1b[31mfailed\x1b[0m\x00"
        assert holder.dead_letter(delivery, "Fatal", error).settled
    finally:
        undo()

    [params] = sent
    values = {k: v["StringValue"] for k, v in params["MessageAttributes"].items()}
    assert values["wq_error"] == "CalledProcessError: \\x1b[31mfailed\\x1b[0m\\x00"
    [item] = operations.list_dead_letters(subscription.name).items
    assert item.last_error == values["wq_error"]


#: What SQS refuses in a body or an attribute (its documented character set's complement).
NOT_SQS_TEXT = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _capture(client: Any, operation: str) -> tuple[list[dict[str, Any]], Any]:
    """The parameters of each ``operation`` ("sqs.SendMessage") call ``client`` makes, and
    the undo."""
    sent: list[dict[str, Any]] = []
    event = f"provide-client-params.{operation}"
    client.meta.events.register(event, lambda params, **_: sent.append(params), unique_id="sent")
    return sent, lambda: client.meta.events.unregister(event, unique_id="sent")


def test_every_body_sent_to_aws_carries_only_characters_sqs_accepts(aws):
    """Audit helper-94: U+FFFE and U+FFFF in a payload (or a partition key, a correlation id)
    went into the SNS message raw. SQS refuses such a body, and SNS, having taken the publish,
    drops a message its subscription queue refuses: Accepted, then lost (moto does not refuse
    it, so the test reads what was sent). Bodies are escaped JSON now, read back unchanged,
    on every send: the publish, a release's copy, a dead letter and a replay."""
    subscription = provisioned(aws, lease_seconds=30)
    topic = subscription.topic
    payload = {"s": "a\uffffb", "t": "\ufffe", "c": "x\x01y"}
    sns = clients_for(AwsSettings.parse(aws.configuration)).sns
    published, undo = _capture(sns, "sns.Publish")
    try:
        result = publish(topic.name, payload, partition_key="k\uffff", correlation_id="c\ufffe")
    finally:
        undo()
    assert result.accepted
    holder = receiver(subscription)
    # A settle sends through the lease's client, a replay through the one-attempt one.
    settles, undo_settles = _capture(holder.binding.lease_sqs, "sqs.SendMessage")
    replays, undo = _capture(holder.binding.clients.sqs_once, "sqs.SendMessage")
    try:
        delivery = receive_one(holder)
        assert (delivery.decoded_payload(), delivery.partition_key, delivery.correlation_id) == (
            payload,
            "k\uffff",
            "c\ufffe",
        )
        assert holder.release(delivery).settled
        copy = receive_one(holder)
        assert copy.decoded_payload() == payload
        assert holder.dead_letter(copy, "Fatal", "no").settled
        assert operations.replay(subscription.name, copy.delivery_id).replayed
        assert receive_one(holder).decoded_payload() == payload
    finally:
        undo_settles()
        undo()

    sent = [*settles, *replays]  # the release's copy, the dead letter; the replay
    bodies = [published[0]["Message"], *(params["MessageBody"] for params in sent)]
    assert len(bodies) == 4  # the publish, the release, the dead letter, the replay
    assert [NOT_SQS_TEXT.findall(body) for body in bodies] == [[]] * 4


def test_an_attribute_sqs_would_refuse_is_rejected_before_anything_is_sent(aws):
    """Audit helper-94: an attribute value holding a control character (or U+FFFE, U+FFFF)
    went to SNS as it was; SQS refuses it, so SNS dropped the message after the publish was
    Accepted and its deduplication key confirmed, which then answered every re-publish
    Duplicate. Such a value cannot be escaped (SNS filter policies match it as written): the
    message is Rejected, naming the attribute, and its key stays free. The batch's other
    messages go."""
    topic = provisioned(aws).topic
    sns = clients_for(AwsSettings.parse(aws.configuration)).sns
    sent, undo = _capture(sns, "sns.PublishBatch")
    try:
        results = publish_many(
            topic,
            [
                {"payload": {"n": 1}, "attributes": {"kind": "a\x01b"}, "deduplication_key": "d"},
                {"payload": {"n": 2}, "attributes": {"kind": "tab\tline\nok"}},
                {"payload": {"n": 3}, "attributes": {"other": "z\ufffe"}},
                {"payload": {"n": 4}},
            ],
        )
    finally:
        undo()

    assert [(r.status, r.error and r.error.code) for r in results] == [
        ("Rejected", "InvalidAttributes"),
        ("Accepted", None),
        ("Rejected", "InvalidAttributes"),
        ("Accepted", None),
    ]
    assert "Attribute 'kind' holds '\\x01' (at position 1)" in results[0].error.message
    assert "'other'" in results[2].error.message
    assert not Deduplication.objects.filter(topic=topic).exists()
    [batch] = sent
    assert [json.loads(e["Message"])["payload"] for e in batch["PublishBatchRequestEntries"]] == [
        {"n": 2},
        {"n": 4},
    ]


def test_an_external_publisher_is_not_told_what_aws_said(aws, client, caplog):
    """AWS's refusal (the server's IAM identity, its endpoint, the SNS topic's name) went to
    an API key's publisher in the answer's message."""
    topic = TopicFactory(transport=aws, allow_external_publish=True)
    SubscriptionFactory(topic=topic)
    sns = clients_for(AwsSettings.parse(aws.configuration)).sns
    identity = "arn:aws:iam::123456789012:user/wq-prod-deployer"

    def refused(**_: Any) -> Any:
        error = {"Code": "AuthorizationError", "Message": f"User: {identity} is not authorized"}
        return (
            type("Response", (), {"status_code": 403, "headers": {}})(),
            {"Error": error, "ResponseMetadata": {"HTTPStatusCode": 403}},
        )

    sns.meta.events.register("before-call.sns.ListTopics", refused, unique_id="refused")
    clients_for(AwsSettings.parse(aws.configuration))._topic_arns.clear()
    key = ApiKeyFactory(scopes=["workqueue:publish"])
    try:
        answer = rest_post(client, topic.name, {"messages": [{"payload": {"n": 1}}]}, key=key)
    finally:
        sns.meta.events.unregister("before-call.sns.ListTopics", unique_id="refused")

    assert identity not in answer.content.decode()
    assert answer.json()["results"][0]["error"]["code"] == "TransportUnavailable"
    assert identity in caplog.text  # the operators are told


@pytest.mark.parametrize("operation", ["sns.Publish", "sns.PublishBatch"])
def test_a_publish_sns_refuses_says_what_aws_said(aws, client, caplog, operation):
    """Audit helper-92: once the topic's ARN was known, SNS refusing the send (denied,
    throttled, the topic deleted) was answered "the database stayed busy", and the operators'
    log said nothing. A publisher in this process now reads what AWS said; an API key's
    publisher does not, and the log says it."""
    topic = provisioned(aws).topic
    topic.allow_external_publish = True
    topic.save()
    assert publish(topic.name, {"warm": 1}).accepted  # the topic's ARN is known now
    sns = clients_for(AwsSettings.parse(aws.configuration)).sns
    messages = [{"payload": {"n": n}} for n in range(1 if operation == "sns.Publish" else 2)]
    undo = _refuse(sns, operation)
    try:
        inside = publish_many(topic.name, messages)
        key = ApiKeyFactory(scopes=["workqueue:publish"])
        outside = rest_post(client, topic.name, {"messages": messages}, key=key).json()["results"]
    finally:
        undo()

    assert {(r.status, r.error.code) for r in inside} == {("Rejected", "TransportUnavailable")}
    assert all(f"not authorized to {operation}" in r.error.message for r in inside), inside
    assert all(f"not authorized to {operation}" not in str(r) for r in outside), outside
    assert f"not authorized to {operation}" in caplog.text
    # Told once for the call, not once a message (review helper-93).
    aws_lines = [r.getMessage() for r in caplog.records if r.name == "workqueue.transports.aws"]
    assert sum(f"not authorized to {operation}" in line for line in aws_lines) == 1


def _refuse(client: Any, operation: str) -> Any:
    """Make ``client`` answer ``operation`` ("sns.ListTopics") as AWS does a caller without
    the IAM permission (403 AuthorizationError); returns the undo."""
    event = f"before-call.{operation}"

    def refused(**_: Any) -> Any:
        error = {"Code": "AuthorizationError", "Message": f"not authorized to {operation}"}
        return (
            type("Response", (), {"status_code": 403, "headers": {}})(),
            {"Error": error, "ResponseMetadata": {"HTTPStatusCode": 403}},
        )

    client.meta.events.register(event, refused, unique_id=operation)
    return lambda: client.meta.events.unregister(event, unique_id=operation)


def test_a_provisioning_read_aws_refuses_is_reported_not_raised_raw(aws):
    """Listing a topic's SNS subscriptions was the one provisioning call outside the error
    handling: botocore's ClientError came out of validate-bindings and `provision`."""
    provisioned(aws)
    sns = clients_for(AwsSettings.parse(aws.configuration)).sns
    undo = _refuse(sns, "sns.ListSubscriptionsByTopic")
    try:
        issues = operations.validate_bindings(aws.name)
        with pytest.raises(CommandError, match="list_subscriptions_by_topic"):
            call_command("workqueue", "provision", "--dry-run")
    finally:
        undo()

    assert any("list_subscriptions_by_topic" in issue.message for issue in issues), issues


@pytest.mark.parametrize(
    "key", ["customer 42", "kunde-müller", "k" * 200], ids=["space", "accent", "200-characters"]
)
def test_any_partition_key_makes_a_message_group_id_sns_and_sqs_take(aws, key):
    """SNS and SQS FIFO take 1 to 128 printable ASCII characters as MessageGroupId; the key
    was sent as it was (moto does not check; AWS refuses), so such a key could not be
    published, released, dead-lettered or replayed."""
    subscription = provisioned(aws, fifo=True, partition_mode="Exclusive")
    sns = clients_for(AwsSettings.parse(aws.configuration)).sns
    groups: list[str] = []
    sns.meta.events.register(
        "provide-client-params.sns.Publish",
        lambda params, **_: groups.append(params["MessageGroupId"]),
        unique_id="groups",
    )
    try:
        published = [publish(subscription.topic, {"n": n}, partition_key=key) for n in range(2)]
    finally:
        sns.meta.events.unregister("provide-client-params.sns.Publish", unique_id="groups")

    assert [p.status for p in published] == ["Accepted"] * 2
    assert len(set(groups)) == 1 and re.fullmatch(r"[!-~]{1,128}", groups[0]), groups
    holder = receiver(subscription)
    first = receive_one(holder)
    assert (first.partition_key, holder.receive(10).deliveries) == (key, [])  # one at a time


def test_a_message_written_to_the_queue_by_hand_does_not_fail_the_claim_it_is_in(aws):
    # A non-numeric attempts_before raised ValueError out of receive, and the claim's other
    # messages were dropped with it.
    subscription = provisioned(aws)
    publish(subscription.topic.name, {"n": 1})
    holder = receiver(subscription)
    holder.binding.clients.sqs.send_message(
        QueueUrl=holder.binding.queue_url,
        MessageBody=json.dumps({"payload": {"n": 2}, "attempts_before": "many"}),
    )

    claimed: list[Any] = []
    deadline = time.monotonic() + 10
    while len(claimed) < 2 and time.monotonic() < deadline:
        claimed += holder.receive(10).deliveries

    assert sorted((d.decoded_payload()["n"], d.attempt) for d in claimed) == [(1, 1), (2, 1)]


def an_expired_last_attempt_then_a_fresh_message(lease_seconds: int, aws: Transport) -> Any:
    """A subscription (max_attempts 1) whose queue holds a message received on its last
    attempt, its holder gone and its lease over, and then a fresh one."""
    subscription = provisioned(aws, max_attempts=1, lease_seconds=lease_seconds)
    publish(subscription.topic.name, {"n": "expired"})
    receive_one(receiver(subscription))  # its holder dies with it: the lease runs out
    time.sleep(lease_seconds + 0.5)
    publish(subscription.topic.name, {"n": "fresh"})
    return subscription


def claim_something(taker: AwsReceiver) -> list[Any]:
    """The deliveries of the first claim that hands any over (within 10 s)."""
    claimed: list[Any] = []
    deadline = time.monotonic() + 10
    while not claimed and time.monotonic() < deadline:
        claimed = taker.receive(10).deliveries
    return claimed


def test_a_slow_move_of_an_expired_last_attempt_leaves_the_rest_of_its_claim_its_leases(
    aws, slow_network
):
    """helper-123: a claim dead-lettered each message it received on its last attempt's expired
    lease (a send and a delete) before handing the rest over; on a slow SQS the fresh ones'
    leases ran out meanwhile: handed over lost, their attempt spent without running, a last
    one then dead-lettered LeaseExpired having never run. The fresh ones go first now, and the
    move is made at the start of the next claim (with a send this slow the move itself cannot
    end within its lease: SQS's redrive or a later claim moves it)."""
    subscription = an_expired_last_attempt_then_a_fresh_message(5, aws)
    slow_network.operation = "SendMessage"
    slow_network.before = lambda request: time.sleep(6)
    taker = receiver(subscription)

    claimed = claim_something(taker)

    [fresh] = claimed
    assert fresh.decoded_payload() == {"n": "fresh"}
    assert taker.complete(fresh).settled  # its lease was whole when it was handed over


def test_an_expired_last_attempt_received_with_fresh_work_is_dead_lettered_beside_it(aws):
    """Moved on a thread of its own while the fresh message is handed over, within the lease
    their receive gave both (helper-126: moved by the next claim, it was lost when that claim
    came later than the lease, and SQS's redrive moved it as MaxReceiveCountExceeded); the
    move is reported by the next claim."""
    subscription = an_expired_last_attempt_then_a_fresh_message(5, aws)
    taker = receiver(subscription)
    assert [d.decoded_payload() for d in claim_something(taker)] == [{"n": "fresh"}]

    wait_until(lambda: operations.list_dead_letters(subscription.name).items, timeout=10)

    [item] = operations.list_dead_letters(subscription.name).items
    assert json.loads(item.payload_json) == {"n": "expired"} and item.reason == "LeaseExpired"
    assert [e.reason for e in taker.receive(10).expired_dead_letters] == ["LeaseExpired"]


@pytest.fixture
def lost_answers(monkeypatch) -> Any:
    """Calls of the operation the test names (``lost_answers.operation``) reach AWS, which acts
    on them, and then their answer is lost: the client sees a read timeout."""
    from botocore.exceptions import ReadTimeoutError
    from botocore.httpsession import URLLib3Session

    rig = type("LostAnswers", (), {"operation": "", "calls": 0})()
    real = URLLib3Session.send

    def send(session: Any, request: Any) -> Any:
        answer = real(session, request)
        target = request.headers.get("X-Amz-Target", b"")  # SQS's JSON protocol
        body = request.body or b""  # SNS's query protocol
        body = body.encode() if isinstance(body, str) else body
        operation = rig.operation.encode()
        if operation and (target.endswith(operation) or b"Action=" + operation + b"&" in body):
            rig.calls += 1
            raise ReadTimeoutError(endpoint_url=request.url)
        return answer

    monkeypatch.setattr(URLLib3Session, "send", send)
    return rig


def test_two_replays_of_one_dead_letter_by_id_queue_it_once(aws, monkeypatch):
    """Review helper-168: a replay by id acted on what its scan of the DLQ found without
    asking whether the scan still hid it (the bulk path asks). A scan slower than its hiding
    (a DLQ of a thousand, a slow SQS) let another operator's replay of the same id find it
    visible and replay it, then replayed it too with its lapsed receipt handle: two copies
    for one dead letter. Its hiding is cut to 4 s here, and the answer of the scan's read that
    finds it is held up 5 s (a scan stops at the dead letter it looks for: the read after it
    can no longer be the slow one)."""
    import threading

    from botocore.httpsession import URLLib3Session

    from workqueue.transports import aws as aws_transport

    monkeypatch.setattr(aws_transport, "DEAD_LETTER_SCAN_VISIBILITY", 4)
    subscription = provisioned(aws, max_attempts=1, lease_seconds=30)
    publish(subscription.topic.name, {"n": 1})
    holder = receiver(subscription)
    assert holder.dead_letter(receive_one(holder), "Poison", "bad").settled
    [item] = operations.list_dead_letters(subscription.name).items
    dlq = holder.binding.dead_letter_queue_url.rsplit("/", 1)[-1].encode()
    real = URLLib3Session.send
    slow_thread: list[int] = []
    reads = {"n": 0}

    def send(session: Any, request: Any) -> Any:
        target = request.headers.get("X-Amz-Target", b"")
        body = request.body or b""
        body = body.encode() if isinstance(body, str) else body
        answer = real(session, request)
        if (
            threading.get_ident() in slow_thread
            and target.endswith(b"ReceiveMessage")
            and dlq in body
        ):
            reads["n"] += 1
            if reads["n"] == 1:
                time.sleep(5)  # the scan's first answer, on a slow SQS: its hiding lapses
        return answer

    monkeypatch.setattr(URLLib3Session, "send", send)
    outcome: dict[str, Any] = {}

    def first_operator() -> None:
        slow_thread.append(threading.get_ident())
        try:
            outcome["first"] = operations.replay(subscription.name, item.delivery_id).replayed
        finally:
            connection.close()

    first = threading.Thread(target=first_operator)
    first.start()
    time.sleep(4.5)  # the first scan's hiding has lapsed; its read still stalls
    outcome["second"] = operations.replay(subscription.name, item.delivery_id).replayed
    first.join()
    monkeypatch.undo()

    copies = arrivals(receiver(subscription), complete=True)
    assert len(copies) == 1, (outcome, [c.delivery_id for c in copies])
    assert sorted(outcome.values()) == [False, True]  # one replayed it; the other found none


def test_a_key_whose_reservation_a_slow_publish_many_outlived_is_not_published_twice(
    aws, monkeypatch
):
    """Review helper-168: publish_many reserved every message's key, then sent ten to a
    PublishBatch; batches of a slow SNS (each call up to 5 s to connect and 21 s to read)
    could outlast the reservations' 120 s. A later message's key lapsed before its batch was
    sent, another publisher took it and was Accepted, and the first sent its message too: two
    messages under one key inside its window. Each batch now reserves its keys as it is sent.
    The 120 s are stood in for: when the first batch leaves, the reservations taken so far
    are made to lapse, and the other publisher publishes the eleventh message's key."""
    import threading

    from botocore.httpsession import URLLib3Session

    subscription = provisioned(aws, lease_seconds=30)
    topic = subscription.topic.name
    items = [{"payload": {"n": n}, "deduplication_key": f"k{n}"} for n in range(11)]
    real_send = URLLib3Session.send
    other: list[Any] = []

    def send(session: Any, request: Any) -> Any:
        body = request.body or b""
        body = body.encode() if isinstance(body, str) else body
        if b"Action=PublishBatch&" in body and not other:
            with connection.cursor() as cursor:  # 120 s of a slow SNS later
                cursor.execute(
                    "UPDATE workqueue_deduplication SET expires_at = now() - interval '1 second'"
                    " WHERE status = 'Reserved'"
                )

            def competitor_publishes() -> None:
                try:
                    other.append(publish(topic, {"n": "other"}, deduplication_key="k10"))
                finally:
                    connection.close()

            competitor = threading.Thread(target=competitor_publishes)
            competitor.start()
            competitor.join()
        return real_send(session, request)

    monkeypatch.setattr(URLLib3Session, "send", send)
    results = publish_many(topic, items)
    monkeypatch.undo()

    assert other[0].status == "Accepted"
    assert results[10].status == "Duplicate"  # the competitor's message holds the key
    assert [r.status for r in results[:10]] == ["Accepted"] * 10
    keyed = [
        d.decoded_payload()
        for d in arrivals(receiver(subscription), complete=True)
        if d.decoded_payload()["n"] in (10, "other")
    ]
    assert keyed == [{"n": "other"}]


def test_a_replay_whose_first_send_could_not_connect_is_made_again(aws, monkeypatch):
    """Review helper-169: with one attempt for a replay's send (a lost answer must not queue
    copies), a send that could not even connect, which cannot have arrived, failed the replay
    where botocore would have tried again."""
    from botocore.httpsession import URLLib3Session

    subscription = provisioned(aws, max_attempts=1, lease_seconds=30)
    publish(subscription.topic.name, {"n": 1})
    holder = receiver(subscription)
    assert holder.dead_letter(receive_one(holder), "Poison", "bad").settled
    [item] = operations.list_dead_letters(subscription.name).items
    real_send = URLLib3Session.send
    refused = {"sends": 0}

    def send(session: Any, request: Any) -> Any:
        if (
            request.headers.get("X-Amz-Target", b"").endswith(b"SendMessage")
            and not refused["sends"]
        ):
            refused["sends"] += 1
            raise EndpointConnectionError(endpoint_url=request.url)
        return real_send(session, request)

    monkeypatch.setattr(URLLib3Session, "send", send)
    replayed = operations.replay(subscription.name, item.delivery_id).replayed
    monkeypatch.undo()

    assert (replayed, refused["sends"]) == (True, 1)
    assert len(arrivals(receiver(subscription), complete=True)) == 1


def test_a_replay_whose_send_goes_unanswered_queues_one_copy_at_most(aws, lost_answers):
    """Review helper-168: a replay's SendMessage went through the default client, so an answer
    lost on its way back had each of botocore's attempts reach SQS: one replay queued four
    copies (and, failed, left the dead letter to be replayed again), as the settles' sends did
    before helper-123."""
    subscription = provisioned(aws, max_attempts=1, lease_seconds=30)
    publish(subscription.topic.name, {"n": 1})
    holder = receiver(subscription)
    assert holder.dead_letter(receive_one(holder), "Poison", "bad").settled
    [item] = operations.list_dead_letters(subscription.name).items

    lost_answers.operation = "SendMessage"
    with pytest.raises(TransientTransportError):  # it cannot know whether its send arrived
        operations.replay(subscription.name, item.delivery_id)
    lost_answers.operation = ""

    copies = arrivals(receiver(subscription), complete=True)
    assert (lost_answers.calls, len(copies)) == (1, 1)


@pytest.mark.parametrize("settle", ["release", "retry", "dead_letter"])
def test_a_settle_whose_send_goes_unanswered_sends_it_once(aws, lost_answers, settle):
    """helper-123: a settle's send (a release's or retry's copy, a dead letter) went through
    the default client, which made it again when the answer was lost; each that reached SQS
    was kept (a standard queue has no deduplication id), so one release ran four times and
    the DLQ listed a dead letter twice. One attempt now: a lost answer costs one copy at most
    (at least once: the settle cannot know it arrived, so it does not delete the original)."""
    subscription = provisioned(aws, lease_seconds=30)
    publish(subscription.topic.name, {"n": 1})
    holder = receiver(subscription)
    delivery = receive_one(holder)
    lost_answers.operation = "SendMessage"

    try:
        if settle == "release":
            holder.release(delivery)
        elif settle == "retry":
            holder.retry(delivery, 1)
        else:
            holder.dead_letter(delivery, "Fatal", "no")
    except TransientTransportError:
        assert settle == "dead_letter"  # left to the host to make again

    assert lost_answers.calls == 1


def test_a_batch_of_completions_whose_second_chunk_fails_keeps_the_first_chunks_completed(
    aws, slow_network
):
    """helper-123: twelve completions are two DeleteMessageBatch calls; the second failing
    raised for all twelve, and the first ten, already deleted and let go, answered LeaseLost
    when completed again. Each chunk's failure is its own now."""
    from botocore.exceptions import ReadTimeoutError

    subscription = provisioned(aws, lease_seconds=30)
    publish_many(subscription.topic.name, [{"payload": {"n": n}} for n in range(12)])
    holder = receiver(subscription)
    held: list[Any] = []
    deadline = time.monotonic() + 10
    while len(held) < 12 and time.monotonic() < deadline:
        held += holder.receive(10).deliveries
    assert len(held) == 12
    slow_network.operation = "DeleteMessageBatch"

    def second_call_times_out(request: Any) -> None:
        if slow_network.calls == 2:
            raise ReadTimeoutError(endpoint_url=request.url)

    slow_network.before = second_call_times_out

    results = holder.complete_many(held)

    done = [d for d in held if isinstance(results[d.delivery_id], SettleResult)]
    failed = [d for d in held if isinstance(results[d.delivery_id], TransientTransportError)]
    assert len(done) == 10 and len(failed) == 2
    assert {results[d.delivery_id].outcome for d in done} == {SettleOutcome.SETTLED}
    # The failed ones are still held: completed again, they are Completed.
    assert all(holder.complete(d).settled for d in failed)
    assert holder.receive(10).deliveries == []


def test_a_keyed_publish_whose_answer_is_lost_is_sent_once_and_keeps_its_key(aws, lost_answers):
    """helper-123: a Publish whose answer was lost may have arrived; botocore's retries sent it
    again (each arrival a message: a standard topic has no deduplication id), and the final
    failure released the key, so that the publisher's re-publish went out too: five messages
    under one key. One attempt now, and the key stays reserved until it lapses."""
    subscription = provisioned(aws)
    lost_answers.operation = "Publish"

    first = publish(subscription.topic.name, {"n": 1}, deduplication_key="order-42")

    assert lost_answers.calls == 1
    assert first.error.code == "TransportUnavailable"
    assert "may have reached SNS" in first.error.message
    lost_answers.operation = ""
    again = publish(subscription.topic.name, {"n": 1}, deduplication_key="order-42")
    assert again.error.code == "DeduplicationPending"
    assert [d.decoded_payload() for d in arrivals(receiver(subscription))] == [{"n": 1}]


def test_a_fifo_publish_reusing_a_generated_id_with_other_content_is_not_dropped(aws):
    """helper-123: on a FIFO topic the SNS deduplication id was the message id, and the ledger
    records only ids a publisher chose, so a publish naming an id generated for an earlier
    message, with other content, was Accepted and then dropped by SNS. Same id and content is
    still one message (a re-send)."""
    subscription = provisioned(aws, fifo=True, partition_mode="Exclusive")
    topic = subscription.topic.name
    first = publish(topic, {"order": 1}, partition_key="k")
    reused = publish(topic, {"order": 2}, partition_key="k", message_id=first.message_id)
    resent = publish(topic, {"order": 2}, partition_key="k", message_id=first.message_id)
    assert (reused.status, resent.status) == ("Accepted", "Duplicate")

    # Each completed as it comes: a FIFO group hands out its next message after.
    assert [d.decoded_payload() for d in arrivals(receiver(subscription), complete=True)] == [
        {"order": 1},
        {"order": 2},
    ]


def test_a_bulk_replay_reads_the_dead_letter_queue_once_a_batch(aws):
    """helper-123 (read, then measured here): each dead letter of a bulk replay or discard was
    looked up by a scan of the whole DLQ of its own, so a batch of N read the DLQ N + 1 times,
    each scan ending on a 1 s empty poll (1,000 dead letters: tens of minutes). A batch changes
    the dead letters its own scan holds now."""
    subscription = provisioned(aws, max_attempts=1, lease_seconds=30)
    publish_many(subscription.topic, [{"payload": {"n": n}} for n in range(25)])
    holder = receiver(subscription)
    dead = receive_all(holder, 25)
    for delivery in dead:
        assert holder.dead_letter(delivery, "Poison", "bad input").settled
    reads, undo = _capture(holder.binding.clients.sqs, "sqs.ReceiveMessage")
    try:
        outcome = operations.resolve_dead_letters(
            subscription.name, "replay", operations.DeadLetterSelection()
        )
    finally:
        undo()

    assert (outcome.matched, outcome.examined, outcome.batches) == (25, 25, 1)
    dead_letter_queue = holder.binding.dead_letter_queue_url
    assert [r["QueueUrl"] for r in reads].count(dead_letter_queue) <= 5
    replayed = receive_all(holder, 25)
    assert sorted(d.delivery_id for d in replayed) == sorted(d.delivery_id for d in dead)
    assert operations.list_dead_letters(subscription.name).items == []


@pytest.mark.parametrize("key", [None, "order-7"])
def test_the_same_message_published_again_after_a_lost_answer_waits_for_the_reservation(
    aws, lost_answers, key
):
    """helper-126: a publisher that chose its message id publishes the same message again
    after a lost answer, as idempotent publishers do; the procedures hand a live reservation to
    its own owner, so the kept reservation was taken over and the message sent twice."""
    subscription = provisioned(aws)
    chosen = str(uuid.uuid4())
    options = {"message_id": chosen, "deduplication_key": key}
    lost_answers.operation = "Publish"
    assert publish(subscription.topic.name, {"n": 1}, **options).error.code == (
        "TransportUnavailable"
    )
    lost_answers.operation = ""

    again = publish(subscription.topic.name, {"n": 1}, **options)

    assert again.error.code == "DeduplicationPending"
    assert [d.message_id for d in arrivals(receiver(subscription))] == [chosen]


def test_a_keyed_publish_that_never_reached_sns_frees_its_key_after_its_tries(aws, monkeypatch):
    """helper-126: a connection never made cannot have delivered anything: tried again (as
    botocore would), then the key is released at once, not held as if it might be out."""
    from botocore.exceptions import EndpointConnectionError
    from botocore.httpsession import URLLib3Session

    subscription = provisioned(aws)
    real = URLLib3Session.send
    tries = []

    def unreachable(session: Any, request: Any) -> Any:
        body = request.body or b""
        if b"Action=Publish&" in (body.encode() if isinstance(body, str) else body):
            tries.append(1)
            raise EndpointConnectionError(endpoint_url=request.url)
        return real(session, request)

    monkeypatch.setattr(URLLib3Session, "send", unreachable)
    failed = publish(subscription.topic.name, {"n": 1}, deduplication_key="order-8")
    monkeypatch.undo()

    assert failed.error.code == "TransportUnavailable"
    assert "may have reached SNS" not in failed.error.message
    assert len(tries) == 3
    assert publish(subscription.topic.name, {"n": 1}, deduplication_key="order-8").accepted


def held_with_time_for_one_call(aws: Transport) -> tuple[Subscription, AwsReceiver, Any]:
    """A delivery held so late in its 10 s lease (a call may take 1 s) that one call's time is
    left, not two; its subscription and receiver."""
    subscription = provisioned(aws, lease_seconds=10)
    publish(subscription.topic.name, {"n": 1})
    holder = receiver(subscription)
    delivery = receive_one(holder)
    time.sleep(8.3)
    return subscription, holder, delivery


def test_a_dead_letter_without_the_time_for_its_send_and_delete_sends_nothing(aws, slow_network):
    """helper-126: only the delete was held to the lease, so a move begun late (now likelier,
    made beside a claim) sent its dead letter and then could not delete the message, which
    SQS's redrive later moved again: listed twice. Not begun without time for both calls."""
    subscription, holder, delivery = held_with_time_for_one_call(aws)
    slow_network.operation = "SendMessage"
    slow_network.before = lambda request: time.sleep(0.9)

    settled = holder.dead_letter(delivery, "Fatal", "late")

    assert settled.outcome == SettleOutcome.LEASE_LOST
    assert slow_network.calls == 0
    assert operations.list_dead_letters(subscription.name).items == []


def test_a_publish_that_took_a_reservation_over_confirms_it_when_the_first_answer_is_lost(aws):
    """helper-127: two publishes of one message (its key and chosen id); the second takes the
    first's reservation over and is sent; the first's answer is lost after that, and handing
    its reservation to the uncertain owner released the second's: the key then lapsed as if
    nothing had been sent. The second's confirmation takes it back."""
    from workqueue.transports.ledger import PublishLedger

    topic = provisioned(aws).topic
    chosen = str(uuid.uuid4())
    message = {
        "message_id": chosen,
        "deduplication_key": "order-9",
        "deduplication_ttl_seconds": 600,
        "partition_key": None,
        "attributes": None,
        "payload": {"n": 1},
        "payload_ref": None,
        "correlation_id": None,
    }
    first = PublishLedger(topic, frozenset({chosen}))
    second = PublishLedger(topic, frozenset({chosen}))
    assert first.admit(0, message) is None
    assert second.admit(0, message) is None  # the same message: the reservations are its own

    first.settle(0, message, sent=None)
    second.settle(0, message, sent=True)

    held = Deduplication.objects.filter(topic=topic).order_by("deduplication_key")
    assert [(d.status, str(d.message_id)) for d in held] == [
        ("Confirmed", str(content_fingerprint(topic.id, message))),
        ("Confirmed", chosen),
    ]


def test_a_receiver_closed_while_moving_dead_letters_lets_the_moves_end_and_logs_them(aws, caplog):
    """helper-127: a move made beside a claim was a daemon thread nobody waited for: a stop
    could cut it between its send and its delete (the dead letter then listed twice), and a
    move no claim reported afterwards went unsaid."""
    subscription = an_expired_last_attempt_then_a_fresh_message(10, aws)
    taker = receiver(subscription)
    assert [d.decoded_payload() for d in claim_something(taker)] == [{"n": "fresh"}]

    with caplog.at_level(logging.WARNING, logger="workqueue"):
        taker.close()

    [item] = operations.list_dead_letters(subscription.name).items
    assert item.reason == "LeaseExpired"
    assert any("as its consumer stopped" in r.getMessage() for r in caplog.records)


def test_a_release_without_time_for_its_copy_makes_the_message_visible_instead(aws, slow_network):
    """helper-127: with time for one call but not two, a release answered LeaseLost and left
    the message hidden to the end of its lease; it falls back to making it visible, as when
    its send fails."""
    subscription, holder, delivery = held_with_time_for_one_call(aws)
    slow_network.operation = "SendMessage"

    assert holder.release(delivery).settled

    assert slow_network.calls == 0
    assert receive_one(receiver(subscription), timeout=1.5).delivery_id == delivery.delivery_id


@pytest.mark.parametrize(
    ("failure", "arrived"),
    [
        ("EndpointConnectionError", False),
        ("ConnectTimeoutError", False),
        ("ReadTimeoutError", True),
        ("SSLError", True),  # urllib3 raises it while reading an answer too
    ],
)
def test_only_a_failure_before_the_request_left_cannot_have_arrived(failure, arrived):
    import botocore.exceptions

    from workqueue.transports.aws import _unavailable

    error = getattr(botocore.exceptions, failure)(endpoint_url="https://sns", error="x")

    assert _unavailable("AWS could not be reached", error).may_have_arrived is arrived


# -- review helper-141 -----------------------------------------------------------------------


def test_every_dead_letter_of_a_key_on_a_fifo_queue_is_listed_and_replayable_by_id(aws):
    """helper-141: a dead letter went to the FIFO dead-letter queue in its partition key's
    message group, and SQS FIFO hands out nothing more of a group while some of it is
    received, so a read of the DLQ (which receives what it lists) saw one answer's ten dead
    letters of a key: 10 of 13 were listed, and a replay by id of the others said "not a dead
    letter" while they waited, unseen, for SQS's 14 days."""
    subscription = provisioned(aws, fifo=True, partition_mode="Exclusive", max_attempts=1)
    publish_many(
        subscription.topic, [{"payload": {"n": n}, "partition_key": "k"} for n in range(13)]
    )
    holder = receiver(subscription)
    dead = []
    for _ in range(13):
        delivery = receive_one(holder)
        assert holder.dead_letter(delivery, "Poison", "bad input").settled
        dead.append(delivery.delivery_id)

    listed = operations.list_dead_letters(subscription.name).items
    assert sorted(i.delivery_id for i in listed) == sorted(dead)
    assert {i.message_partition_key for i in listed} == {"k"}
    for delivery_id in dead:
        assert operations.replay(subscription.name, delivery_id).replayed
    # Replayed under the key's group again: still one at a time, in the order replayed.
    replayed = [receive_one(holder).delivery_id]
    assert receiver(subscription).receive(10).deliveries == []
    assert replayed == dead[:1]


def _seed_dead_letters(holder: AwsReceiver, ids: list[str], reason: str) -> None:
    """Dead letters written straight to the DLQ as the receiver writes them, in that order."""
    for start in range(0, len(ids), 10):
        holder.binding.clients.sqs.send_message_batch(
            QueueUrl=holder.binding.dead_letter_queue_url,
            Entries=[
                {
                    "Id": str(i),
                    "MessageBody": json.dumps({"message_id": str(uuid.uuid4()), "payload": {}}),
                    "MessageAttributes": {
                        "wq_reason": {"DataType": "String", "StringValue": reason},
                        "wq_delivery_id": {"DataType": "String", "StringValue": delivery_id},
                    },
                }
                for i, delivery_id in enumerate(ids[start : start + 10])
            ],
        )


@pytest.mark.parametrize("action", ["replay", "discard"])
def test_a_bulk_operation_on_more_dead_letters_than_one_read_sees_changes_them_all(
    aws, monkeypatch, action
):
    """helper-141: a bulk replay walked the dead letters by id after the last batch's, but a
    read of the DLQ sees 1,000 of them, chosen by SQS, whose ids fall anywhere: the next
    batch's read skipped every id below the cursor that the first read had not seen, and the
    operation ended reporting success (an outage's 5,000 dead letters: about 1,000 replayed,
    the rest left to SQS's 14 days). Here a read sees 10 (as 1,000), SQS hands out the highest
    ids first (as random ids do, some time), and 5 dead letters of another reason stay."""
    import workqueue.transports.aws as aws_module

    subscription = provisioned(aws, max_attempts=1)
    holder = receiver(subscription)
    _seed_dead_letters(holder, [f"other-{n}" for n in range(5)], "Other")
    _seed_dead_letters(holder, [f"d-{n:04d}" for n in reversed(range(30))], "Poison")
    monkeypatch.setattr(aws_module, "DEAD_LETTER_SCAN_LIMIT", 10)

    counted = operations.resolve_dead_letters(
        subscription.name,
        action,
        operations.DeadLetterSelection(reason="Poison"),
        dry_run=True,
        note="outage",
        batch_size=10,
    )
    outcome = operations.resolve_dead_letters(
        subscription.name,
        action,
        operations.DeadLetterSelection(reason="Poison"),
        note="outage",
        batch_size=10,
    )

    assert counted.matched <= 10  # a dry run changes nothing: one walk, what its reads see
    assert outcome.matched == 30
    monkeypatch.setattr(aws_module, "DEAD_LETTER_SCAN_LIMIT", 1000)
    left = operations.list_dead_letters(subscription.name).items
    assert sorted(i.delivery_id for i in left) == [f"other-{n}" for n in range(5)]
    if action == "replay":
        assert len(receive_all(holder, 30)) == 30


def test_a_heartbeat_landing_after_a_retry_does_not_cut_its_backoff_short(aws, slow_network):
    """helper-141: a heartbeat and a settle of one delivery went to SQS independently (the
    host renews on a thread of its own), so a renewal sent just before the handler failed, and
    slow on the way, landed after the retry's visibility change and set the message's
    visibility back to the lease: a retry asking for a 1,000 s backoff ran again 5 s later.
    Calls on one receipt handle now go one at a time, and a call that waited finds the settle
    made (a lost lease) or the renewal made (the settle then hides it for its backoff)."""
    import threading

    subscription = provisioned(aws, lease_seconds=5)
    publish(subscription.topic.name, {"n": 1})
    holder = receiver(subscription)
    delivery = receive_one(holder)
    slow_network.operation = "ChangeMessageVisibility"

    def the_renewal_is_slow(request: Any) -> None:
        if slow_network.calls == 1:
            time.sleep(1.5)

    slow_network.before = the_renewal_is_slow
    renewal = threading.Thread(target=holder.extend_lease, args=(delivery,))
    renewal.start()
    time.sleep(0.3)
    assert holder.retry(delivery, 1000).settled
    renewal.join()
    started = time.monotonic()

    other = receiver(subscription)
    while time.monotonic() < started + 7:
        assert other.receive(10).deliveries == [], "the retry ran before its backoff"


def test_a_replay_or_discard_on_aws_records_who_acted_and_why(aws, caplog):
    """helper-141: the Database transport writes who replayed or discarded a dead letter, and
    the note, on the delivery (``resolved_by``, ``resolution_note``; the REST API adds the
    admin's history of the delivery). On AWS the actor and note were dropped: a dead letter
    leaves the DLQ with the operation, and there is no delivery row, so a discard (which
    deletes it for good) left no trace of who did it or why, through any door."""
    subscription = provisioned(aws, max_attempts=1)
    publish_many(subscription.topic, [{"payload": {"n": n}} for n in range(4)])
    holder = receiver(subscription)
    dead = receive_all(holder, 4)
    for delivery in dead:
        assert holder.dead_letter(delivery, "Poison", "bad input").settled
    alice = Actor(user=UserFactory(username="alice", is_superuser=True), label="API key wq_1a2b")
    caplog.set_level(logging.INFO, logger="workqueue.transports.aws")

    operations.replay(subscription.name, dead[0].delivery_id, note="fixed\nupstream", actor=alice)
    operations.discard(subscription.name, dead[1].delivery_id, reason="spam", actor=alice)
    operations.resolve_dead_letters(
        subscription.name, "discard", operations.DeadLetterSelection(), note="outage"
    )

    lines = [r.getMessage() for r in caplog.records if r.name == "workqueue.transports.aws"]
    assert lines == [
        f"Dead letter {dead[0].delivery_id} of {subscription.name} replayed by "
        "'alice via API key wq_1a2b' (note: 'fixed\\nupstream')",
        f"Dead letter {dead[1].delivery_id} of {subscription.name} discarded by "
        "'alice via API key wq_1a2b' (note: 'spam')",
        f"2 dead letters (a bulk batch) of {subscription.name} discarded by 'cli' (note: 'outage')",
    ]


def _answer(client: Any, operation: str, code: str, status: int = 403) -> Any:
    """Make ``client`` answer ``operation`` ("sqs.ReceiveMessage") with AWS's error ``code``;
    returns the undo."""
    event = f"before-call.{operation}"

    def refused(**_: Any) -> Any:
        error = {"Code": code, "Message": f"as AWS answers {code}"}
        return (
            type("Response", (), {"status_code": status, "headers": {}})(),
            {"Error": error, "ResponseMetadata": {"HTTPStatusCode": status}},
        )

    client.meta.events.register(event, refused, unique_id=f"{operation}-{code}")
    return lambda: client.meta.events.unregister(event, unique_id=f"{operation}-{code}")


@pytest.mark.parametrize(
    ("code", "fix"),
    [
        ("InvalidClientTokenId", "Fix the credentials"),
        ("ExpiredToken", "Fix the credentials"),
        ("AccessDenied", "IAM policy"),
        ("AWS.SimpleQueueService.NonExistentQueue", "manage.py workqueue provision"),
    ],
)
def test_a_refusal_of_a_misconfigured_transport_names_the_fix(aws, code, fix):
    """helper-141: a host whose credentials AWS refused, or whose queue was deleted after it
    started, logged only AWS's words ("The security token included in the request is
    invalid", "The specified queue does not exist"), claim after claim, never what to change."""
    subscription = provisioned(aws)
    holder = receiver(subscription)
    holder.receive(1)  # the queue's URL is known: only the receive is refused
    undo = _answer(holder.binding.clients.sqs, "sqs.ReceiveMessage", code)
    try:
        with pytest.raises(TransportUnavailableError) as refused:
            holder.receive(1)
    finally:
        undo()

    assert fix in str(refused.value)


def test_missing_credentials_are_named_as_such_not_as_aws_out_of_reach(monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    nowhere = AwsClients(AwsSettings(region="eu-west-1", endpoint_url="http://127.0.0.1:9"))

    with pytest.raises(TransportUnavailableError, match="Fix the credentials"):
        _Provisioner(nowhere, dry_run=True).queue("wq-nowhere", False, {})


def test_a_message_written_to_the_dead_letter_queue_by_hand_does_not_stop_the_operators(aws):
    """helper-141: anyone who may send to the DLQ could stop every operator read of it: a
    message whose envelope named a numeric delivery id made the listing's sort fail (a
    TypeError), one with a non-numeric attempts attribute raised ValueError, and a date
    without its zone failed the bulk operations' time window. The listing, replay and discard
    of every dead letter (the bad one included, in bulk) all failed with them."""
    subscription = provisioned(aws, max_attempts=1)
    publish(subscription.topic.name, {"n": 1})
    holder = receiver(subscription)
    dead = receive_one(holder)
    assert holder.dead_letter(dead, "Poison", "bad input").settled
    sqs = holder.binding.clients.sqs
    sqs.send_message(
        QueueUrl=holder.binding.dead_letter_queue_url,
        MessageBody=json.dumps(
            {
                "delivery_id": 5,
                "message_id": 7,
                "partition_key": 3,
                "attributes": [1],
                "correlation_id": {},
                "published_at": "2020-01-01",
                "payload": 1,
            }
        ),
        MessageAttributes={
            "wq_attempts": {"DataType": "String", "StringValue": "many"},
            "wq_dead_lettered_at": {"DataType": "String", "StringValue": "2020-01-01T00:00:00"},
        },
    )

    listed = operations.list_dead_letters(subscription.name).items
    assert sorted(i.delivery_id for i in listed) == sorted(["5", dead.delivery_id])
    assert all(i.dead_lettered_at.tzinfo is not None for i in listed)
    shown = json.loads(workqueue_cli("dead-letters", "-s", subscription.name, "--json"))["items"]
    assert sorted(i["delivery_id"] for i in shown) == sorted(["5", dead.delivery_id])
    outcome = operations.resolve_dead_letters(
        subscription.name,
        "discard",
        operations.DeadLetterSelection(dead_lettered_from=timezone.now() - dt.timedelta(days=1)),
        note="cleanup",
    )
    assert outcome.matched == 1
    outcome = operations.resolve_dead_letters(
        subscription.name, "discard", operations.DeadLetterSelection(), note="cleanup"
    )
    assert outcome.matched == 1
    assert operations.list_dead_letters(subscription.name).items == []


def test_a_message_written_to_the_queue_by_hand_with_numeric_ids_can_be_dead_lettered(aws):
    """helper-141: the receiver took a delivery's id from the body as it came, so a message
    written to the queue by hand with a number there reached the handler with an int id, and
    its dead letter's move raised TypeError (the id is an attribute, which must be text): the
    settle failed, and the message ran again until SQS's redrive took it."""
    subscription = provisioned(aws, max_attempts=3)
    holder = receiver(subscription)
    holder.binding.clients.sqs.send_message(
        QueueUrl=holder.binding.queue_url,
        MessageBody=json.dumps({"delivery_id": 5, "message_id": 7, "payload": {"n": 1}}),
    )
    delivery = receive_one(holder)

    assert (delivery.delivery_id, delivery.message_id) == ("5", "7")
    assert holder.dead_letter(delivery, "Poison", "bad input").settled
    [item] = operations.list_dead_letters(subscription.name).items
    assert (item.delivery_id, item.message_id, item.reason) == ("5", "7", "Poison")


# -- a receive whose answer was lost -------------------------------------------------------


class LosesReceiveAnswers:
    """Makes ReceiveMessage calls of ``client`` reach SQS and then fail as a dropped
    connection does (the server hid what it answered, the caller never read it): the first
    ``lost`` tries, or every try while ``losing`` is set. Records the ReceiveRequestAttemptId
    each try carried."""

    def __init__(self, client: Any, lost: int = 0) -> None:
        self.client = client
        self.lost = lost
        self.losing = False
        self.attempt_ids: list[str | None] = []

    def __enter__(self) -> LosesReceiveAnswers:
        self.client.meta.events.register(
            "before-send.sqs.ReceiveMessage", self._send, unique_id="loses-receive-answers"
        )
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.meta.events.unregister(
            "before-send.sqs.ReceiveMessage", unique_id="loses-receive-answers"
        )

    def _send(self, request: Any, **_: Any) -> None:
        from botocore.exceptions import ConnectionClosedError
        from botocore.httpsession import URLLib3Session

        self.attempt_ids.append(json.loads(request.body).get("ReceiveRequestAttemptId"))
        if self.losing or self.lost:
            self.lost = max(0, self.lost - 1)
            URLLib3Session().send(request)  # answered, then the answer is lost
            raise ConnectionClosedError(endpoint_url=request.url)


@contextmanager
def every_try_lost(holder: AwsReceiver) -> Iterator[LosesReceiveAnswers]:
    """A receive of ``holder`` whose every try (botocore's retries too) lost its answer; the
    block then runs with answers arriving again."""
    with LosesReceiveAnswers(holder.binding.clients.sqs) as network:
        network.losing = True
        with pytest.raises(TransientTransportError):
            holder.receive(10)
        network.losing = False
        yield network


def test_a_fifo_receive_whose_answer_was_lost_is_asked_again_with_its_attempt_id(aws):
    # SQS FIFO answers a ReceiveMessage sent again with the same ReceiveRequestAttemptId with
    # the messages (and receipt handles) the lost answer held; asked again without it, those
    # stay hidden for a lease, and their group's later messages behind them. moto does not
    # keep attempt ids, so what is proven here is what SQS is asked.
    subscription = provisioned(aws, fifo=True, partition_mode="Exclusive")
    holder = receiver(subscription)

    with LosesReceiveAnswers(holder.binding.clients.sqs, lost=1) as network:
        holder.receive(10)  # botocore makes the call again after the dropped connection

    assert len(network.attempt_ids) == 2
    assert network.attempt_ids[0] and network.attempt_ids[0] == network.attempt_ids[1]


def test_a_fifo_receive_that_failed_is_the_next_claims_receive_with_its_attempt_id(aws):
    subscription = provisioned(aws, fifo=True)
    holder = receiver(subscription)

    with every_try_lost(holder) as network:
        holder.receive(10)
        holder.receive(10)

    first, *retries, next_claim, after_it = network.attempt_ids
    assert first and retries and set(retries) == {first} and next_claim == first
    assert after_it and after_it != first  # answered: the next receive is a new one


@pytest.mark.parametrize("lease_after", [30, 300], ids=["same lease", "lease changed"])
def test_a_fifo_receive_that_failed_is_sent_again_by_the_receiver_a_re_plan_put_in_its_place(
    aws, lease_after
):
    """A re-plan rebuilding the consumer (the host carries the old receiver over) dropped the
    failed receive's attempt id with the old receiver: what it hid waited out its lease. Not
    when the re-plan changed the lease (30 s raised to 300 s at 3 a.m.): what SQS hid for the
    old lease must not be taken for the new one (review helper-159)."""
    subscription = provisioned(aws, fifo=True, lease_seconds=30)
    holder = receiver(subscription)
    with every_try_lost(holder) as network:
        Subscription.objects.filter(pk=subscription.pk).update(lease_seconds=lease_after)
        successor = receiver(Subscription.objects.get(pk=subscription.pk))
        successor.carry_over_from(holder)
        successor.receive(10)

    first, *_, successors = network.attempt_ids
    assert successor.binding.lease_seconds == lease_after
    assert first and successors and (successors == first) is (lease_after == 30)


def test_a_receive_made_again_with_an_earlier_attempt_id_counts_its_lease_from_that_attempt(aws):
    # What SQS answers an attempt id made again are the messages its first try hid, their
    # visibility counted from that try: a lease counted from the repeated call would outlast
    # SQS's, and two holders could run one message.
    subscription = provisioned(aws, fifo=True, lease_seconds=30)
    holder = receiver(subscription)
    with every_try_lost(holder):
        pass
    failed_at = time.monotonic()
    publish(subscription.topic, {"n": 1}, partition_key="k")

    delivery = receive_one(holder)

    assert holder._received_at[delivery.lease_token] < failed_at
