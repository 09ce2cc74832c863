"""Handlers that run on and on (hung on a socket, a lock, an endless loop) while their lease is
renewed: the host that runs them says how old each subscription's oldest run is, names the runs
past their threshold (the subscription's ``max_processing_seconds``, else
``HANDLER_RUN_WARNING_SECONDS``) by delivery id and handler key, logs each one once at WARNING,
and the metrics show the age and the count. Before, such a run read as plain Running, and only
the aging backlog's alert caught it, indirectly.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.api import call, reader
from tests.support.handlers import registry
from tests.support.hosts import one, status_of, sub
from tests.support.waiting import wait_until
from workqueue import metrics, publish
from workqueue.conf import get_settings
from workqueue.models import HostRecord
from workqueue.runtime.context import WorkContext, WorkMessage
from workqueue.runtime.handlers import BaseWorkHandler
from workqueue.runtime.host import Host, HostConfig
from workqueue.runtime.outcome import Outcome

pytestmark = pytest.mark.usefixtures("queue_db")

BLOCKING = "t.blocking"


class Gate:
    """Where ``t.blocking`` handlers wait until the test lets each one go, by message id."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._started: dict[str, WorkContext] = {}  # message id -> its run's context
        self._releases: dict[str, threading.Event] = {}

    def arrive(self, message_id: str, context: WorkContext) -> threading.Event:
        with self._lock:
            self._started[message_id] = context
            self._lock.notify_all()
            return self._releases.setdefault(message_id, threading.Event())

    def wait_started(self, message_id: str) -> str:
        """The delivery id of ``message_id``'s run, once its handler has started."""
        return self.context_of(message_id).delivery_id

    def context_of(self, message_id: str) -> WorkContext:
        """The context of ``message_id``'s run, once its handler has started."""
        with self._lock:
            assert self._lock.wait_for(lambda: message_id in self._started, timeout=10)
            return self._started[message_id]

    def release(self, message_id: str) -> None:
        with self._lock:
            self._releases.setdefault(message_id, threading.Event()).set()

    def release_all(self) -> None:
        with self._lock:
            for event in self._releases.values():
                event.set()
            self._started.clear()
            self._releases.clear()


gate = Gate()


class BlockingHandler(BaseWorkHandler):
    """Blocks until the test releases it, deaf to its abort signal as a hung handler is."""

    def handle(self, message: WorkMessage, context: WorkContext) -> Outcome:
        gate.arrive(message.message_id, context).wait(30)
        return Outcome.complete()


registry.register(BLOCKING, BlockingHandler)


@pytest.fixture
def blocked(make_host: Any) -> Iterator[Gate]:
    """The gate, every handler let go before the hosts shut down (``make_host``'s teardown
    runs after this one's), so none outlives its test."""
    yield gate
    gate.release_all()


def entry(host: Host, name: str) -> dict[str, Any]:
    (found,) = [s for s in host.health()["subscriptions"] if s["name"] == name]
    return found


def recorded(host: Host, name: str) -> dict[str, Any]:
    record = HostRecord.objects.get(instance_id=host.instance_id)
    (found,) = [s for s in record.subscriptions if s["name"] == name]
    return found


def gauge(text: str, name: str, subscription: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == {"subscription": subscription}:
                return sample.value
    return None


def stuck_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "action", None) == "handler_run_stuck"]


def test_a_blocked_handler_past_the_threshold_is_named_with_its_age_and_the_younger_one_is_not(
    make_host, blocked, caplog
):
    caplog.set_level(logging.WARNING, logger="workqueue.runtime.handler_runs")
    s = sub(handler_key=BLOCKING, heartbeat_mode="Auto", lease_seconds=5)
    host = make_host(one(s, concurrency=2), handler_run_warning_seconds=1)
    host.start()
    old = publish(s.topic.name, {}).message_id
    old_delivery = blocked.wait_started(old)
    assert entry(host, s.name)["stuck_runs"] == []  # just started: under the threshold

    (stuck,) = wait_until(lambda: entry(host, s.name)["stuck_runs"])
    assert stuck["delivery_id"] == old_delivery
    young = publish(s.topic.name, {}).message_id
    young_delivery = blocked.wait_started(young)

    report = entry(host, s.name)
    assert report["state"] == "Running"
    assert [r["delivery_id"] for r in report["stuck_runs"]] == [old_delivery]
    assert young_delivery not in str(report["stuck_runs"])
    (run,) = report["stuck_runs"]
    assert run["handler_key"] == BLOCKING and run["threshold_seconds"] == 1
    assert run["seconds"] >= 1 and report["oldest_run_seconds"] >= run["seconds"]
    assert report["stuck_count"] == 1 and report["in_flight"] == 2
    # The Auto heartbeat holds its lease meanwhile: nothing else says it is stuck.
    assert status_of(old) == "InFlight"
    # Other processes read it from the host's record, written when a run turns stuck (not
    # only every 10 s).
    wait_until(lambda: recorded(host, s.name)["stuck_runs"])
    assert recorded(host, s.name)["stuck_runs"][0]["delivery_id"] == old_delivery

    # One WARNING for the run, however many passes see it stuck.
    wait_until(lambda: stuck_lines(caplog))
    host.supervise()
    host.supervise()
    (line,) = stuck_lines(caplog)
    text = line.getMessage()
    assert old_delivery in text and s.name in text and BLOCKING in text
    assert "workqueue discard" in text  # what the operator can do about it

    blocked.release(old)
    wait_until(lambda: status_of(old) == "Completed")
    wait_until(lambda: not entry(host, s.name)["stuck_runs"])
    assert entry(host, s.name)["stuck_count"] == 0
    wait_until(lambda: not recorded(host, s.name)["stuck_runs"])


def test_a_subscriptions_max_processing_seconds_is_its_threshold_over_the_setting(
    make_host, blocked
):
    s = sub(handler_key=BLOCKING, max_processing_seconds=1)
    host = make_host(one(s), handler_run_warning_seconds=3600)
    host.start()
    delivery = blocked.wait_started(publish(s.topic.name, {}).message_id)

    (run,) = wait_until(lambda: entry(host, s.name)["stuck_runs"])

    assert (run["delivery_id"], run["threshold_seconds"]) == (delivery, 1)


def test_a_manual_heartbeat_handler_that_lost_its_lease_is_still_named_while_it_runs(
    make_host, blocked
):
    """Its lease runs out (it never beats), another host may run the delivery, but its thread
    still runs here, holding a slot: what the host reports is the run, not the lease."""
    s = sub(handler_key=BLOCKING, heartbeat_mode="Manual", lease_seconds=5)
    host = make_host(one(s), handler_run_warning_seconds=1)
    host.start()
    message = publish(s.topic.name, {}).message_id
    context = blocked.context_of(message)

    wait_until(lambda: context.signal.reason == "LeaseLost", timeout=10)

    (run,) = entry(host, s.name)["stuck_runs"]
    assert run["delivery_id"] == context.delivery_id and run["seconds"] >= 5


def test_a_subscription_with_no_handler_running_has_no_oldest_run(make_host):
    s = sub()
    host = make_host(one(s))
    host.start()

    report = entry(host, s.name)

    assert (report["oldest_run_seconds"], report["stuck_runs"], report["stuck_count"]) == (
        None,
        [],
        0,
    )


def test_the_gauges_show_the_oldest_runs_age_and_the_stuck_runs_until_it_returns(
    make_host, blocked
):
    s = sub(handler_key=BLOCKING)
    host = make_host(one(s), handler_run_warning_seconds=1)
    host.start()
    message = publish(s.topic.name, {}).message_id
    blocked.wait_started(message)
    wait_until(lambda: recorded(host, s.name)["stuck_runs"])

    text = metrics.render().decode()

    assert gauge(text, "workqueue_oldest_handler_run_age_seconds", s.name) >= 1
    assert gauge(text, "workqueue_stuck_handler_runs", s.name) == 1

    blocked.release(message)
    wait_until(lambda: status_of(message) == "Completed")
    wait_until(lambda: not recorded(host, s.name)["stuck_runs"])
    host.record_health()  # the periodic report, without waiting 10 s for it
    text = metrics.render().decode()
    assert gauge(text, "workqueue_stuck_handler_runs", s.name) == 0
    assert gauge(text, "workqueue_oldest_handler_run_age_seconds", s.name) == 0


def test_health_names_the_stuck_run_and_reads_degraded(make_host, blocked, client):
    s = sub(handler_key=BLOCKING)
    host = make_host(one(s), handler_run_warning_seconds=1)
    host.start()
    delivery = blocked.wait_started(publish(s.topic.name, {}).message_id)
    wait_until(lambda: recorded(host, s.name)["stuck_runs"])

    body = call(client, "get", "/health", key=reader()).json()

    assert body["status"] == "degraded"
    (listed,) = body["hosts"][0]["subscriptions"]
    (summary,) = body["subscriptions"]
    for seen in (listed, summary):
        assert seen["stuckCount"] == 1 and seen["oldestRunSeconds"] >= 1
        (run,) = seen["stuckRuns"]
        assert (run["deliveryId"], run["handlerKey"]) == (delivery, BLOCKING)
        assert run["seconds"] >= 1 and run["thresholdSeconds"] == 1


def test_the_threshold_setting_reaches_the_hosts(settings):
    assert HostConfig.from_settings(get_settings()).handler_run_warning_seconds == 1800
    settings.WORKQUEUE = {**getattr(settings, "WORKQUEUE", {}), "HANDLER_RUN_WARNING_SECONDS": 120}
    assert HostConfig.from_settings(get_settings()).handler_run_warning_seconds == 120


def test_an_alert_rule_fires_on_stuck_runs():
    from tests.integration.test_metrics import DOCS

    rules = yaml.safe_load((DOCS / "prometheus-alerts.yaml").read_text())["groups"][0]["rules"]
    (rule,) = [r for r in rules if r["alert"] == "WorkQueueHandlerRunStuck"]
    assert "workqueue_stuck_handler_runs" in rule["expr"]
    assert "workqueue discard" in rule["annotations"]["description"]
