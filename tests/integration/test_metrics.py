"""Prometheus metrics: the runtime's counters and histograms move with real deliveries and
publishes; the queue's gauges match what the database holds; the REST endpoint is guarded like the
other read endpoints (and a limited key sees only its subscriptions); the CLI prints the same
text; a host process serves them on an internal port; the shipped dashboard and alert rules use
only metrics that exist.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import threading
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, transaction
from django.utils import timezone
from prometheus_client import generate_latest as metrics_text_bytes
from prometheus_client.parser import text_string_to_metric_families

from tests.factories import ApiKeyFactory, SubscriptionFactory
from tests.support.api import call, reader
from tests.support.handlers import probe
from tests.support.hosts import one, status_of, sub
from tests.support.processes import hello
from tests.support.queue import dead_letter, pending
from tests.support.roles import acting_as_granted_role
from tests.support.waiting import wait_until
from workqueue import metrics, publish, publish_or_raise, transport
from workqueue.driver import get_driver
from workqueue.exceptions import PublishRejectedError, TransientDriverError
from workqueue.models import HostRecord, Message
from workqueue.operators import operations
from workqueue.transport import Receiver
from workqueue.transports.database import DatabaseTransport

pytestmark = pytest.mark.usefixtures("queue_db")

DOCS = Path(__file__).resolve().parents[2] / "docs"


def metrics_text(registry: Any) -> str:
    return metrics_text_bytes(registry).decode()


def process_value(name: str, **labels: str) -> float:
    return metrics.PROCESS.get_sample_value(name, labels) or 0.0


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def gauge(text: str, name: str, subscription: str) -> float | None:
    return samples(text).get((name, (("subscription", subscription),)))


# -- this process's counters ----------------------------------------------------------------------


def test_the_runtime_counts_each_outcome_and_times_handlers_and_claims(make_host):
    s = sub(max_attempts=1)
    name = s.name
    before = {
        outcome: process_value("workqueue_deliveries_total", subscription=name, outcome=outcome)
        for outcome in ("completed", "dead_lettered")
    }
    handled = process_value("workqueue_handler_duration_seconds_count", subscription=name)
    host = make_host(one(s))
    host.start()

    done = publish(s.topic.name, {"then": "complete"}).message_id
    dead = publish(s.topic.name, {"then": "crash"}).message_id  # last attempt: dead letter
    wait_until(lambda: status_of(done) == "Completed" and status_of(dead) == "DeadLettered")
    probe.wait_for(2)

    def counted(outcome: str) -> float:
        return (
            process_value("workqueue_deliveries_total", subscription=name, outcome=outcome)
            - before[outcome]
        )

    wait_until(lambda: counted("completed") == 1 and counted("dead_lettered") == 1)
    assert (
        process_value("workqueue_handler_duration_seconds_count", subscription=name) - handled == 2
    )
    assert process_value("workqueue_claim_duration_seconds_count", subscription=name) >= 1
    assert process_value("workqueue_settle_batch_size_count") >= 1


def test_publishes_are_counted_by_topic_status_and_error_code_with_unknown_topics_folded():
    s = SubscriptionFactory()
    topic = s.topic.name

    def count(status: str, code: str = "", label: str = topic) -> float:
        return process_value(
            "workqueue_published_messages_total", topic=label, status=status, error_code=code
        )

    before = (count("Accepted"), count("Duplicate"), count("Rejected", "InvalidPartitionKey"))
    unknown_before = count("Rejected", "TopicNotFound", metrics.UNKNOWN_TOPIC)

    publish(topic, {}, deduplication_key="once")
    publish(topic, {}, deduplication_key="once")
    publish(topic, {}, partition_key="x" * 201)
    publish("no-such-topic-a", {})
    publish("no-such-topic-b", {})

    after = (count("Accepted"), count("Duplicate"), count("Rejected", "InvalidPartitionKey"))
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1, 1]
    assert count("Rejected", "TopicNotFound", metrics.UNKNOWN_TOPIC) - unknown_before == 2
    assert count("Rejected", "TopicNotFound", "no-such-topic-a") == 0  # no label per caller text


def test_an_enlisted_publish_is_counted_once_its_transaction_commits_and_never_if_rolled_back():
    """Review helper-166: a publish in the caller's transaction was counted Accepted at once,
    so one the transaction then rolled back was counted for a message never stored: publish
    rates, and alerts built on them, overstated what was published."""
    topic = SubscriptionFactory().topic.name

    def accepted() -> float:
        return process_value(
            "workqueue_published_messages_total", topic=topic, status="Accepted", error_code=""
        )

    before = accepted()
    with pytest.raises(RuntimeError), transaction.atomic():
        assert publish(topic, {"n": 1}, enlist=True).accepted
        raise RuntimeError("the caller's transaction rolls back")
    assert not Message.objects.filter(topic__name=topic).exists()
    assert accepted() == before

    with transaction.atomic():
        assert publish(topic, {"n": 2}, enlist=True).accepted
        assert accepted() == before  # not yet: the transaction may still roll back
    assert accepted() == before + 1

    # A rejection was answered whatever became of the transaction (review helper-169).
    def rejected() -> float:
        return process_value(
            "workqueue_published_messages_total",
            topic=topic,
            status="Rejected",
            error_code="InvalidPartitionKey",
        )

    refused = rejected()
    with pytest.raises(PublishRejectedError), transaction.atomic():
        publish_or_raise(topic, {"n": 3}, partition_key="x" * 201, enlist=True)
    assert rejected() == refused + 1


# -- the queue's gauges, through each door --------------------------------------------------------


@pytest.fixture
def queue_state() -> Any:
    """Two subscriptions: ``busy`` with 2 pending, 1 in flight and 1 dead letter; ``quiet``."""
    busy = SubscriptionFactory(partition_mode="Ordered")
    quiet = SubscriptionFactory()
    dead_letter(busy, partition_key="k1")  # the head of k1: its key is blocked
    pending(busy)
    publish(busy.topic.name, {"n": 2}, partition_key="k1")  # waits behind the dead letter
    publish(busy.topic.name, {"n": 3}, partition_key="k2")
    assert Receiver(busy.id).receive(1).deliveries  # k2's delivery goes in flight
    return busy, quiet


def test_gauges_read_what_the_queue_holds(client, queue_state):
    busy, quiet = queue_state

    response = call(client, "get", "/metrics", key=reader())

    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=0.0.4")
    text = response.content.decode()
    expected = {
        "workqueue_pending_deliveries": 2,
        "workqueue_in_flight_deliveries": 1,
        "workqueue_dead_lettered_deliveries": 1,
        "workqueue_blocked_keys": 1,
        "workqueue_due_deliveries": 1,  # the keyless one; k1 is blocked, k2 is in flight
    }
    for name, value in expected.items():
        assert gauge(text, name, busy.name) == value, name
        assert gauge(text, name, quiet.name) == 0, name
    assert gauge(text, "workqueue_oldest_pending_age_seconds", busy.name) >= 0
    assert "workqueue_live_hosts" in text


def test_no_metric_carries_a_label_prometheus_sets_itself(client, queue_state):
    """Review helper-166: the hosts' gauge labelled each host ``instance``, which Prometheus
    sets on every scraped series itself, so by default it renamed ours ``exported_instance``
    and a query by ``instance`` read the scrape target, not the host."""
    now = timezone.now()
    HostRecord.objects.create(
        instance_id="vm:1:abc", hostname="vm", pid=1, started_at=now, last_seen_at=now
    )

    text = call(client, "get", "/metrics", key=reader()).content.decode()
    text += metrics_text(metrics.PROCESS)

    labels = {
        (family.name, label)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        for label in sample.labels
    }
    assert ("workqueue_host_last_seen_seconds", "host") in labels
    assert not {(name, label) for name, label in labels if label in ("instance", "job")}


def test_the_endpoint_is_refused_without_credentials_or_the_read_scope(client):
    assert call(client, "get", "/metrics").status_code == 401
    publisher = ApiKeyFactory(scopes=["workqueue:publish"])
    assert call(client, "get", "/metrics", key=publisher).status_code == 403


def test_a_key_limited_to_one_subscription_sees_only_its_gauges_and_no_hosts(client, queue_state):
    busy, quiet = queue_state

    text = call(client, "get", "/metrics", key=reader(subscriptions=[busy.name])).content.decode()

    assert gauge(text, "workqueue_pending_deliveries", busy.name) == 2
    assert gauge(text, "workqueue_pending_deliveries", quiet.name) is None
    assert "workqueue_host_last_seen_seconds" not in text
    assert "workqueue_live_hosts" not in text
    assert "workqueue_db_" not in text  # database-wide sizes and sessions


def test_a_key_limited_to_one_subscription_sees_no_other_in_this_process_s_counters(
    client, queue_state
):
    """This web process's own counters name every topic it published to and every
    subscription whose handlers it ran; a key limited to one subscription read them all."""
    busy, quiet = queue_state
    publish(quiet.topic.name, {"n": 1})
    metrics.labelled(metrics.DELIVERIES, quiet.name, "completed").inc()
    metrics.labelled(metrics.DELIVERIES, busy.name, "completed").inc()

    text = call(client, "get", "/metrics", key=reader(subscriptions=[busy.name])).content.decode()

    assert quiet.name not in text
    assert quiet.topic.name not in text
    assert "workqueue_published_messages" not in text
    assert f'workqueue_deliveries_total{{outcome="completed",subscription="{busy.name}"}}' in text
    assert "workqueue_settle_batch_size" in text  # naming no subscription: kept


def test_each_count_stops_at_the_cap_and_says_so_so_a_scrape_stays_cheap(settings):
    settings.WORKQUEUE = {**settings.WORKQUEUE, "METRICS_COUNT_CAP": 3}
    small, large = SubscriptionFactory(), SubscriptionFactory(partition_mode="Ordered")
    for _ in range(2):
        publish(small.topic.name, {})
    for n in range(5):
        publish(large.topic.name, {}, partition_key=f"k{n}")

    text = metrics.render().decode()

    assert gauge(text, "workqueue_pending_deliveries", small.name) == 2
    assert gauge(text, "workqueue_counts_capped", small.name) == 0
    assert gauge(text, "workqueue_pending_deliveries", large.name) == 3  # 5, counted to 3
    assert gauge(text, "workqueue_counts_capped", large.name) == 1
    assert gauge(text, "workqueue_due_deliveries", large.name) == 5  # its own cap is 1000


def test_the_oldest_waiting_age_is_found_whatever_the_priorities_and_keys(settings):
    subscription = SubscriptionFactory(partition_mode="Exclusive")
    publish(subscription.topic.name, {}, priority=-7)  # keyless, low priority: the oldest
    get_driver().shift_time(600, subscription_id=str(subscription.id))
    publish(subscription.topic.name, {}, priority=9)
    publish(subscription.topic.name, {}, partition_key="k", priority=3)

    age = gauge(
        metrics.render().decode(), "workqueue_oldest_pending_age_seconds", subscription.name
    )

    assert 600 <= age < 660


def metrics_as_a_host_role(pg_conn: Any, capsys: Any, revoked: str | None = None) -> str:
    """The exposition ``workqueue metrics`` prints when run as a role given grant-runtime (less
    EXECUTE on the procedure ``revoked``), as a host's metrics port runs."""
    with acting_as_granted_role(pg_conn, "wq_host", "grant-runtime", [revoked] if revoked else []):
        call_command("workqueue", "metrics")
    return capsys.readouterr().out


def test_gauges_that_cannot_be_read_are_reported_not_left_out(queue_state, capsys, pg_conn):
    """A subscription whose gauges failed (here: a role that may not call the gauge procedure;
    also a transport that is away) vanished from the scrape with no trace: the alerts watching
    its dead letters resolved."""
    busy, _quiet = queue_state

    text = metrics_as_a_host_role(pg_conn, capsys, revoked="wq_queue_gauges")

    assert gauge(text, "workqueue_gauges_unavailable", busy.name) == 1
    assert gauge(text, "workqueue_dead_lettered_deliveries", busy.name) is None


def test_a_hosts_runtime_role_serves_the_gauges(queue_state, capsys, pg_conn):
    """A host's metrics port runs as its runtime role, which could not call the operator's
    gauge procedures: every host scrape lacked the gauges the alerts watch."""
    busy, _quiet = queue_state

    text = metrics_as_a_host_role(pg_conn, capsys)

    assert gauge(text, "workqueue_dead_lettered_deliveries", busy.name) == 1
    assert gauge(text, "workqueue_gauges_unavailable", busy.name) is None


def test_the_cli_prints_the_same_exposition(queue_state, capsys):
    busy, _quiet = queue_state

    call_command("workqueue", "metrics")

    text = capsys.readouterr().out
    assert gauge(text, "workqueue_dead_lettered_deliveries", busy.name) == 1


def test_scrapes_of_a_metrics_port_leave_no_database_sessions_behind():
    """Each scrape runs on a thread of its own, and its Django connection (younger than
    CONN_MAX_AGE, 60 s here) was left open when the thread ended: a session per scrape,
    about 240 an hour per host at a 15 s interval, until max_connections."""
    SubscriptionFactory()
    server = metrics.serve(0)
    port = server.server_address[1]
    before = _other_sessions()
    try:
        for _ in range(10):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20).read()
    finally:
        server.shutdown()
        server.server_close()

    wait_until(lambda: _other_sessions() <= before, timeout=10)


def _other_sessions() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND backend_type = 'client backend'"
        )
        return cursor.fetchone()[0]


@pytest.mark.processes
def test_a_host_process_serves_metrics_on_its_internal_port(processes):
    s = hello()
    host = processes.start("workqueue_host", "-s", s.name, "--metrics-port", "0")
    host.wait_for_line("Metrics: http://127.0.0.1:")
    url = next(line for line in host.lines if line.startswith("Metrics: ")).split()[1]
    message = publish(s.topic.name, {}).message_id
    wait_until(lambda: status_of(message) == "Completed")

    def scrape() -> str:
        with urllib.request.urlopen(url, timeout=10) as response:  # loopback only
            return response.read().decode()

    text = wait_until(
        lambda: (t := scrape())
        and samples(t).get(
            ("workqueue_deliveries_total", (("outcome", "completed"), ("subscription", s.name)))
        )
        and t
    )
    assert gauge(text, "workqueue_pending_deliveries", s.name) == 0
    assert samples(text)[("workqueue_live_hosts", ())] >= 1


@pytest.mark.processes
def test_a_standalone_sweeper_serves_its_pass_counters(processes):
    # Without it a deployment that sweeps with workqueue_sweep alone had no series for the
    # sweeper alerts to read, and they stayed silent whatever the sweeper did.
    sweeper = processes.start("workqueue_sweep", "--metrics-port", "0")
    sweeper.wait_for_line("Metrics: http://127.0.0.1:")
    url = next(line for line in sweeper.lines if line.startswith("Metrics: ")).split()[1]
    sweeper.wait_for_line("expired=")  # its first pass, at once

    with urllib.request.urlopen(url, timeout=10) as response:  # loopback only
        text = response.read().decode()

    passes = samples(text)
    assert passes[("workqueue_sweeper_passes_total", (("result", "caught_up"),))] >= 1
    assert passes[("workqueue_sweeper_passes_total", (("result", "failed"),))] == 0


def test_a_once_sweep_refuses_a_metrics_port():
    with pytest.raises(CommandError, match="--once run ends before a scrape"):
        call_command("workqueue_sweep", "--once", "--metrics-port", "0")


@pytest.mark.processes
def test_a_metrics_port_already_taken_fails_the_host_before_it_claims(processes):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = processes.run("workqueue_host", "--metrics-port", str(port), timeout=30)

    assert done.returncode != 0
    assert "Choose another --metrics-port" in done.stderr


# -- the shipped dashboard and alert rules --------------------------------------------------------


#: The series a family of each type exposes, whether or not a labelled child was used yet (an
#: unused labelled counter has no samples to read the names from).
SERIES_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}


def exposed_names() -> set[str]:
    names = set()
    for family in metrics.PROCESS.collect():
        names.add(family.name)
        names |= {family.name + suffix for suffix in SERIES_SUFFIXES.get(family.type, ())}
    for family in metrics.QueueCollector().collect():
        names.add(family.name)
    return names


METRIC = re.compile(r"\bworkqueue_[a-z_]+\b")


def test_the_grafana_dashboard_uses_only_metrics_that_exist():
    dashboard = json.loads((DOCS / "grafana-dashboard.json").read_text())
    expressions = [
        target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])
    ]
    used = {name for expr in expressions for name in METRIC.findall(expr)}

    assert expressions and used
    assert used <= exposed_names(), used - exposed_names()
    # Every host and web process serves the same cluster-wide gauges (read from the
    # database): summed over scrape targets, one pending delivery showed as three.
    summed = [
        expr for expr in expressions if "sum" in expr and set(METRIC.findall(expr)) & CLUSTER_WIDE
    ]
    assert summed == []


#: Gauges every process serving metrics reads from the database: the same value on each target.
CLUSTER_WIDE = {
    "workqueue_pending_deliveries",
    "workqueue_due_deliveries",
    "workqueue_in_flight_deliveries",
    "workqueue_dead_lettered_deliveries",
    "workqueue_blocked_keys",
    "workqueue_oldest_pending_age_seconds",
    "workqueue_counts_capped",
    "workqueue_live_hosts",
    "workqueue_running_hosts",
}


def test_the_alert_rules_parse_and_use_only_metrics_that_exist():
    rules = yaml.safe_load((DOCS / "prometheus-alerts.yaml").read_text())
    alerts = [rule for group in rules["groups"] for rule in group["rules"]]
    used = {name for rule in alerts for name in METRIC.findall(rule["expr"])}

    assert all({"alert", "expr", "labels", "annotations"} <= set(rule) for rule in alerts)
    assert used <= exposed_names(), used - exposed_names()


def test_the_metrics_port_serves_the_process_counters_while_the_database_is_away():
    """A database error while reading the gauges failed the whole scrape (500): this process's
    own counters (claims and settles failing, sweeper passes failing) vanished with it, when
    they matter most."""
    metrics.SWEEPER_PASSES.labels("failed").inc()
    server = metrics.serve(0)
    port = server.server_address[1]
    settings = connection.settings_dict
    saved = dict(settings)

    def scrape() -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
            text = answer.read().decode()
        return {
            s.name: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name in ("workqueue_gauges_read_failed", "workqueue_sweeper_passes_total")
            and s.labels.get("result", "failed") == "failed"
        }

    try:
        healthy = scrape()
        settings.update(HOST="127.0.0.1", PORT="1")  # the database is away: refused
        get_driver().close_all()
        away = scrape()
    finally:
        settings.clear()
        settings.update(saved)
        get_driver().close_all()
        server.shutdown()
        server.server_close()

    assert healthy["workqueue_gauges_read_failed"] == 0
    assert away["workqueue_gauges_read_failed"] == 1
    assert away["workqueue_sweeper_passes_total"] >= 1


def test_each_outcome_has_its_own_label():
    """Only completed and dead_lettered were ever read: a hand-back counted as a retry went
    unseen (helper-104)."""
    from workqueue.runtime.executor import ExecutionResult

    settled = ExecutionResult.SETTLED
    assert ExecutionResult(settled, "Pending", released=True).outcome_label == "released"
    assert ExecutionResult(settled, "Pending").outcome_label == "retried"
    assert ExecutionResult(settled, "Discarded").outcome_label == "discarded"
    assert ExecutionResult(ExecutionResult.LEASE_LOST).outcome_label == "lease_lost"
    assert ExecutionResult(ExecutionResult.FAILED).outcome_label == "settle_failed"


def test_a_retry_and_a_hand_back_at_shutdown_are_counted_apart(make_host):
    s = sub(max_attempts=5)

    def counted(outcome: str) -> float:
        return process_value("workqueue_deliveries_total", subscription=s.name, outcome=outcome)

    before = {outcome: counted(outcome) for outcome in ("retried", "released")}
    host = make_host(one(s), shutdown_drain_ms=300)
    host.start()
    retried = publish(s.topic.name, {"then": "retry", "delay": 3600}).message_id
    wait_until(lambda: counted("retried") - before["retried"] == 1)
    publish(s.topic.name, {"sleepMs": 30_000, "thenOnAbort": "retry"})
    probe.wait_for(2)
    host.shutdown()

    assert counted("released") - before["released"] == 1
    assert counted("retried") - before["retried"] == 1
    assert status_of(retried) == "Pending"


def test_concurrent_scrapes_of_a_metrics_port_read_the_database_one_at_a_time(monkeypatch):
    """Review helper-142: the port is unauthenticated, and each scrape read the database on a
    session of its own thread: whoever reached the port (a pod network, with
    ``--metrics-address 0.0.0.0``) opened as many sessions as it sent scrapes at once, up to
    max_connections, starving the hosts and the web. Scrapes now read one at a time, and
    those that waited serve the read that ran meanwhile."""
    SubscriptionFactory()
    reading = 0
    most = 0
    reads = 0
    lock = threading.Lock()
    real = transport.queue_table_sizes

    def slow_sizes() -> Any:
        nonlocal reading, most, reads
        with lock:
            reading += 1
            reads += 1
            most = max(most, reading)
        try:
            time.sleep(0.3)  # a scrape on a loaded server, its session open meanwhile
            return real()
        finally:
            with lock:
                reading -= 1

    monkeypatch.setattr(transport, "queue_table_sizes", slow_sizes)
    server = metrics.serve(0)
    port = server.server_address[1]

    def scrape(_: int) -> str:
        url = f"http://127.0.0.1:{port}/metrics"
        return urllib.request.urlopen(url, timeout=60).read().decode()

    try:
        with ThreadPoolExecutor(20) as pool:
            texts = list(pool.map(scrape, range(20)))
    finally:
        server.shutdown()
        server.server_close()

    assert most == 1
    assert reads < 20  # the waiting scrapes shared a read
    assert all("workqueue_pending_deliveries" in text for text in texts)
    assert all("workqueue_gauges_read_failed 0.0" in text for text in texts)


def test_scrapes_while_a_read_is_held_up_answer_with_the_process_counters(monkeypatch):
    """Review helper-185: a lock on workqueue_delivery (a migrate's index build, VACUUM FULL,
    REINDEX) held the gauges' read, with no timeout, and every later scrape waited for it:
    the unauthenticated port answered nothing, not even this process's counters, and each
    scrape sent meanwhile kept a server thread for as long as the lock was held (10 scrapes,
    10 threads). A scrape now waits a moment for the read under way, then answers without the
    gauges, saying so. (Since 0061 a read waits 2 s at most for each lock, as
    ``test_reads_while_tables_are_locked.py`` shows; a read held up that long here is one
    slowed some other way, a database slow to answer.)"""
    monkeypatch.setattr(metrics, "GAUGES_READ_WAIT_SECONDS", 0.5)
    SubscriptionFactory()
    held_up = threading.Event()
    read = operations.queue_gauges

    def slow_read(**kwargs: Any) -> Any:
        held_up.wait(30)
        return read(**kwargs)

    monkeypatch.setattr(operations, "queue_gauges", slow_read)
    server = metrics.serve(0)
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    stuck: list[str] = []
    first = threading.Thread(
        target=lambda: stuck.append(urllib.request.urlopen(url, timeout=60).read().decode())
    )
    try:
        first.start()  # its read of the gauges is held up
        time.sleep(0.3)
        threads_before = threading.active_count()
        texts = [urllib.request.urlopen(url, timeout=5).read().decode() for _ in range(5)]
        time.sleep(0.3)  # the server's threads for those scrapes end
        threads_after = threading.active_count()
        held_up.set()
        first.join(30)
    finally:
        held_up.set()
        server.shutdown()
        server.server_close()

    for text in texts:
        assert "workqueue_gauges_read_failed 1.0" in text
        assert "workqueue_sweeper_passes_total" in text  # this process's own counters
        assert "workqueue_pending_deliveries" not in text
    assert threads_after <= threads_before, "scrapes answered left their threads waiting"
    assert "workqueue_pending_deliveries" in stuck[0]  # read once it went on


def test_a_scrape_while_a_queue_table_is_locked_answers_within_seconds_with_no_gauges(
    client, pg_conn, caplog
):
    """Review helpers 185 and 186: the gauges' read had no timeout of its own. While a queue
    table was locked (VACUUM FULL, a migrate's ALTER TABLE), ``GET /work-queue/metrics`` held
    its web worker and a database session for as long as the lock was held, as did the
    metrics port's reading thread. Each read now waits 2 s at most for a lock, then the
    scrape answers: every subscription's gauges unavailable, read once, not per subscription."""
    subscriptions = [SubscriptionFactory() for _ in range(3)]
    key = reader()

    def scrape() -> Any:
        try:
            return call(client, "get", "/metrics", key=key)
        finally:
            get_driver().close()  # this thread's connections
            connection.close()

    pool = ThreadPoolExecutor(1)
    try:
        with pg_conn.transaction():
            pg_conn.execute("LOCK TABLE workqueue_delivery IN ACCESS EXCLUSIVE MODE")
            began = time.monotonic()
            answer = pool.submit(scrape)
            futures_wait([answer], timeout=15)
            took = time.monotonic() - began
            answered_while_locked = answer.done()
    finally:
        pool.shutdown()  # once the lock is let go
    assert answered_while_locked, f"still waiting for the lock after {took:.0f} s"
    response = answer.result()
    assert response.status_code == 200
    text = response.content.decode()
    for subscription in subscriptions:
        assert gauge(text, "workqueue_gauges_unavailable", subscription.name) == 1
    waited = [r for r in caplog.records if r.getMessage().startswith("Could not read the gauges")]
    assert len(waited) == 1, "each subscription's read waited for the lock in turn"


def _live_host(instance_id: str, entries: list[tuple[str, str]]) -> None:
    now = timezone.now()
    HostRecord.objects.create(
        instance_id=instance_id,
        hostname=instance_id.split(":")[0],
        pid=1,
        started_at=now - dt.timedelta(minutes=5),
        last_seen_at=now,
        subscriptions=[
            {"name": name, "state": state, "reason": "", "in_flight": 0, "concurrency": 2}
            for name, state in entries
        ],
        handler_keys=[],
    )


def test_a_subscription_no_live_host_runs_shows_in_the_gauges_while_other_hosts_live(client):
    """Review helper-142: /health turned degraded (NotRunning) for due work no live host runs,
    but the metrics said only how many hosts were live, so WorkQueueDueWorkWithNothingRunning
    could fire only once every host was gone. A deploy whose hosts all lost a handler
    (HandlerNotRegistered) or the ``-s`` of a subscription left its work waiting unalerted, up
    to WorkQueueBacklogAging's warning 25 minutes later. ``workqueue_running_hosts`` counts the
    live hosts running each subscription meant to run (not a Paused one), and the alert joins
    on it."""
    stranded = SubscriptionFactory(handler_key="shop.charge")
    served = SubscriptionFactory()
    paused = SubscriptionFactory(status="Paused")
    for subscription in (stranded, served, paused):
        pending(subscription)
    _live_host("web-1:1:a", [(served.name, "Running"), (stranded.name, "HandlerNotRegistered")])
    _live_host("web-2:2:b", [(served.name, "Running")])

    text = call(client, "get", "/metrics", key=reader()).content.decode()
    limited = call(client, "get", "/metrics", key=reader(subscriptions=[stranded.name]))

    assert gauge(text, "workqueue_running_hosts", stranded.name) == 0
    assert gauge(text, "workqueue_running_hosts", served.name) == 2
    assert gauge(text, "workqueue_running_hosts", paused.name) is None  # waits on purpose
    assert gauge(text, "workqueue_due_deliveries", stranded.name) == 1
    # A key limited to the subscription reads it too (a count: no host is named).
    limited_text = limited.content.decode()
    assert gauge(limited_text, "workqueue_running_hosts", stranded.name) == 0
    assert gauge(limited_text, "workqueue_running_hosts", served.name) is None
    assert "web-1" not in limited_text
    alerts = yaml.safe_load((DOCS / "prometheus-alerts.yaml").read_text())
    (rule,) = [
        rule
        for group in alerts["groups"]
        for rule in group["rules"]
        if rule["alert"] == "WorkQueueDueWorkWithNothingRunning"
    ]
    assert "on (subscription)" in rule["expr"] and "workqueue_running_hosts" in rule["expr"]


def test_the_cli_fails_when_it_could_not_read_the_gauges(monkeypatch, capsys):
    """Review helper-142: with the database away, ``workqueue metrics`` printed the process's
    own counters (nothing, in a one-shot process) and ``workqueue_gauges_read_failed 1``, and
    exited 0: a cron check or script that runs it read "fine". It still prints what it has,
    then fails."""
    SubscriptionFactory()

    def away(**_: Any) -> Any:
        raise TransientDriverError("connection refused")

    monkeypatch.setattr(operations, "queue_gauges", away)

    with pytest.raises(CommandError, match="could not be read"):
        call_command("workqueue", "metrics")

    assert samples(capsys.readouterr().out)[("workqueue_gauges_read_failed", ())] == 1


def test_an_age_the_transport_does_not_know_is_left_out_not_shown_as_zero(monkeypatch):
    """Review helper-142: SQS does not say how old a queue's oldest message is (stats show
    null, the CLI "-"), but the gauge wrote 0 for it: a dashboard read "nothing has waited"
    beside thousands pending, and no age alert could ever fire. The series is left out when
    work waits and its age is unknown; 0 still means that nothing waits."""
    waiting, idle = SubscriptionFactory(), SubscriptionFactory()
    counts = {waiting.id: 4200, idle.id: 0}

    def as_sqs_counts(self: Any, subscription_id: str, cap: int) -> dict[str, Any]:
        pending = counts[uuid.UUID(subscription_id)]
        return {
            "pending": pending,
            "in_flight": 0,
            "dead_lettered": 0,
            "blocked_keys": None,
            "oldest_pending_age_seconds": None,
        }

    monkeypatch.setattr(DatabaseTransport, "queue_gauges", as_sqs_counts)

    text = metrics.render().decode()

    assert gauge(text, "workqueue_pending_deliveries", waiting.name) == 4200
    assert gauge(text, "workqueue_oldest_pending_age_seconds", waiting.name) is None
    assert gauge(text, "workqueue_oldest_pending_age_seconds", idle.name) == 0
