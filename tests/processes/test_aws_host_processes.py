"""Hosts on the AWS transport, against moto's standalone server through real boto3 HTTP calls:
a host in this process and ``workqueue_host`` processes run handlers for an SQS-backed
subscription, a kill -9 mid-handler gives the message back after its visibility timeout, and
a fatal error dead-letters with its reason kept for the operators."""

from __future__ import annotations

import pytest

from tests.factories import SubscriptionFactory, TopicFactory, TransportFactory
from tests.support.handlers import probe
from tests.support.hosts import one, states
from tests.support.processes import read_events
from tests.support.waiting import wait_until
from workqueue import publish
from workqueue.models import Subscription, Transport
from workqueue.operators import operations
from workqueue.transports import transport_for

pytestmark = [pytest.mark.processes, pytest.mark.usefixtures("queue_db")]


@pytest.fixture
def aws(aws_endpoint) -> Transport:
    return TransportFactory(
        name="aws-host", driver_class="AWS", configuration=aws_endpoint.configuration()
    )


def provisioned(aws: Transport, **fields: object) -> Subscription:
    subscription = SubscriptionFactory(topic=TopicFactory(transport=aws), **fields)
    transport_for("AWS").provision(aws, dry_run=False)
    return subscription


def queue_is_empty(subscription: Subscription) -> bool:
    [stats] = operations.subscription_stats(subscription.name).subscriptions
    return stats.pending == 0 and stats.in_flight == 0


def test_a_host_runs_an_aws_subscription_and_completion_deletes_the_message(aws, make_host):
    subscription = provisioned(aws, handler_key="t.script")
    host = make_host(one(subscription))
    host.start()
    wait_until(lambda: states(host)[subscription.name][0] == "Running")

    message = publish(subscription.topic.name, {"then": "complete"}).message_id

    [run] = probe.wait_for(1, timeout=20)
    assert (run.message_id, run.attempt) == (message, 1)
    wait_until(lambda: queue_is_empty(subscription), timeout=20)


def test_a_fatal_error_dead_letters_with_its_reason_and_error_kept(aws, make_host):
    subscription = provisioned(aws, handler_key="t.script")
    host = make_host(one(subscription))
    host.start()

    message = publish(subscription.topic.name, {"then": "fatal", "message": "bad input"}).message_id

    probe.wait_for(1, timeout=20)
    wait_until(lambda: operations.list_dead_letters(subscription.name).items, timeout=20)
    [item] = operations.list_dead_letters(subscription.name).items
    assert (item.message_id, item.reason, item.attempts) == (message, "bad input", 1)
    assert "bad input" in item.last_error


def test_a_host_process_runs_an_aws_subscription_end_to_end(aws, aws_endpoint, processes):
    subscription = provisioned(aws, handler_key="tests.record")
    host = processes.host(subscription.name, **aws_endpoint.environment())

    message = publish(subscription.topic.name, {"ordinal": 1}).message_id

    wait_until(lambda: any(e["event"] == "end" for e in read_events(processes.events)), 30)
    runs = [
        (e["event"], e["pid"], e["attempt"], e["message"]) for e in read_events(processes.events)
    ]
    assert runs == [("start", host.pid, 1, message), ("end", host.pid, 1, message)]
    wait_until(lambda: queue_is_empty(subscription), timeout=20)


def test_kill_9_mid_handler_gives_the_message_back_after_its_visibility_timeout(
    aws, aws_endpoint, processes
):
    subscription = provisioned(aws, handler_key="tests.record", lease_seconds=5, max_attempts=3)
    environment = aws_endpoint.environment()
    first = processes.host(subscription.name, **environment)
    message = publish(subscription.topic.name, {"sleepFirstAttemptMs": 60_000}).message_id
    wait_until(lambda: any(e["event"] == "start" for e in read_events(processes.events)), 30)

    first.popen.kill()
    first.wait(timeout=10)
    second = processes.host(subscription.name, **environment)

    # No sweeper and no clock shift: SQS makes the message visible again when the dead host's
    # 5 s visibility timeout runs out, and the second host receives it as attempt 2.
    wait_until(lambda: any(e["event"] == "end" for e in read_events(processes.events)), 40)
    runs = [
        (e["event"], e["pid"], e["attempt"], e["message"]) for e in read_events(processes.events)
    ]
    assert runs == [
        ("start", first.pid, 1, message),
        ("start", second.pid, 2, message),
        ("end", second.pid, 2, message),
    ]
    wait_until(lambda: queue_is_empty(subscription), timeout=20)


def test_work_once_takes_its_budget_from_the_queue_and_exits_0(aws, aws_endpoint, processes):
    subscription = provisioned(aws, handler_key="tests.record")
    for ordinal in range(3):
        publish(subscription.topic.name, {"ordinal": ordinal})

    done = processes.run(
        "workqueue_work",
        "-s",
        subscription.name,
        "--once",
        "--max",
        "2",
        "--idle-exit-ms",
        "2000",
        **aws_endpoint.environment(),
    )

    assert done.returncode == 0, done.stderr
    assert "processed=2" in done.stdout
    ends = [e for e in read_events(processes.events) if e["event"] == "end"]
    assert len(ends) == 2
    [stats] = operations.subscription_stats(subscription.name).subscriptions
    assert (stats.pending, stats.in_flight) == (1, 0)
