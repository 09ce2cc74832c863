"""Prometheus metrics: what this process did (counters and histograms the runtime and publishing
update) and what the queue holds cluster-wide (gauges read from the database at scrape time).

Exposed by ``GET /work-queue/metrics`` (read permission; the gauges a limited API key sees are
its own subscriptions'), by ``manage.py workqueue metrics`` and, unauthenticated for an internal
scrape, by ``manage.py workqueue_host --metrics-port PORT`` and ``workqueue_sweep --metrics-port
PORT``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from django.db import Error as DjangoDatabaseError
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from workqueue.exceptions import LockTimeoutError, WorkQueueError
from workqueue.operators.permissions import CLI, Actor

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: This process's own counters and histograms; never the cluster gauges (they are read per scrape).
PROCESS = CollectorRegistry(auto_describe=True)

DELIVERIES = Counter(
    "workqueue_deliveries",
    "Deliveries this process finished, by outcome: completed, retried, dead_lettered, "
    "released (handed back at shutdown), discarded (a cancel acknowledged), lease_lost, "
    "settle_failed.",
    ["subscription", "outcome"],
    registry=PROCESS,
)
HANDLER_SECONDS = Histogram(
    "workqueue_handler_duration_seconds",
    "How long handlers ran, from start to return.",
    ["subscription"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
    registry=PROCESS,
)
CLAIM_SECONDS = Histogram(
    "workqueue_claim_duration_seconds",
    "Round trip of one claim (wq_claim) to the database.",
    ["subscription"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
    registry=PROCESS,
)
SETTLE_BATCH = Histogram(
    "workqueue_settle_batch_size",
    "Deliveries completed together in one batched completion call.",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 500),
    registry=PROCESS,
)
PUBLISHED = Counter(
    "workqueue_published_messages",
    "Messages this process published, by topic, status (Accepted, Duplicate, Rejected) and "
    "error code (empty unless Rejected).",
    ["topic", "status", "error_code"],
    registry=PROCESS,
)
SWEEPER_ROWS = Counter(
    "workqueue_sweeper_rows",
    "Rows this process's sweeper passes changed, by step: expired_leases, terminal_deliveries, "
    "orphan_messages, expired_deduplications, task_results, host_records.",
    ["step"],
    registry=PROCESS,
)
SWEEPER_PASSES = Counter(
    "workqueue_sweeper_passes",
    "Sweeper passes this process ran, by result: caught_up; behind (a step stopped at the "
    "pass's limit with rows left, so another pass follows soon); failed (a step or the pass "
    "raised; counted so even when another step was behind); skipped (another sweeper held the "
    "lock).",
    ["result"],
    registry=PROCESS,
)
# Every result's series exists from the start at 0: Prometheus's increase() cannot see a
# series' first step from nothing, so a process's first failed pass would go unnoticed.
for _result in ("caught_up", "behind", "failed", "skipped"):
    SWEEPER_PASSES.labels(_result)


UNKNOWN_TOPIC = "(unknown)"


@functools.lru_cache(maxsize=4096)
def labelled(metric: Any, *values: str) -> Any:
    """``metric.labels(*values)``, remembered: the per-delivery metrics (deliveries, handler
    and claim durations) would otherwise validate and look up their labels on every delivery,
    a few microseconds each under the registry's lock. Bounded, since label values here are
    subscription names and outcomes."""
    return metric.labels(*values)


def count_published(topic: str, results: Iterable[Any]) -> None:
    # Counted per outcome first: a batch is mostly one outcome, so a hundred results cost one
    # labelled increment rather than a hundred.
    outcomes: dict[tuple[str, str], int] = {}
    for result in results:
        outcome = (result.status, result.error.code if result.error is not None else "")
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    for (status, code), count in outcomes.items():
        # A name no topic has is the caller's text: keep it out of the labels, whose number
        # must stay bounded whatever callers send.
        label = UNKNOWN_TOPIC if code == "TopicNotFound" else topic.strip().lower()
        labelled(PUBLISHED, label, status, code).inc(count)


def read_failed_gauge(failed: bool) -> GaugeMetricFamily:
    """``workqueue_gauges_read_failed``: whether this scrape went without the queue's gauges."""
    gauge = GaugeMetricFamily(
        "workqueue_gauges_read_failed",
        "1 when this scrape could not read the queue's gauges from the database at all (it "
        "is away, or a read waits on a lock; the error is logged): the gauges above are "
        "missing, this process's own counters are not.",
    )
    gauge.add_metric([], 1 if failed else 0)
    return gauge


class QueueCollector(Collector):
    """Cluster-wide gauges, read from the database when scraped: one capped gauges call and
    one capped backlog call per subscription, the live host records and the database's
    health views."""

    def __init__(self, actor: Actor = CLI, *, close_connections: bool = False) -> None:
        self.actor = actor
        # The host's scrape server runs each scrape on a thread of its own: close what the
        # scrape opened there, as a request would. (A view must leave its request's alone.)
        self.close_connections = close_connections
        self.read_failed = False  # whether the last collect could not read the database

    def collect(self) -> Iterator[Metric]:
        try:
            try:
                yield from self._collect()
            except (DjangoDatabaseError, WorkQueueError) as exc:
                # Raised, it failed the whole scrape (a 500), this process's counters with it,
                # while the database was away: when they matter most.
                logger.warning("Metrics: the queue's gauges could not be read: %s", exc)
                self.read_failed = True
            else:
                self.read_failed = False
            yield read_failed_gauge(self.read_failed)
        finally:
            if self.close_connections:
                from workqueue.driver import close_all_thread_connections

                close_all_thread_connections()  # the thread ends with this scrape

    def _collect(self) -> Iterator[Metric]:
        from workqueue.models import HostRecord
        from workqueue.models.hosts import database_now
        from workqueue.operators import operations

        labels = ["subscription"]
        gauges = {
            "pending": GaugeMetricFamily(
                "workqueue_pending_deliveries",
                "Deliveries waiting (due or not), counted up to METRICS_COUNT_CAP.",
                labels=labels,
            ),
            "due": GaugeMetricFamily(
                "workqueue_due_deliveries",
                "Deliveries a claim could take now (one per free key on partitioned "
                "subscriptions), counted up to 1000.",
                labels=labels,
            ),
            "in_flight": GaugeMetricFamily(
                "workqueue_in_flight_deliveries", "Deliveries held under a lease.", labels=labels
            ),
            "dead_lettered": GaugeMetricFamily(
                "workqueue_dead_lettered_deliveries",
                "Dead letters waiting for an operator.",
                labels=labels,
            ),
            "blocked_keys": GaugeMetricFamily(
                "workqueue_blocked_keys",
                "Ordered keys held back by a dead-lettered head (0 for other modes).",
                labels=labels,
            ),
            "oldest": GaugeMetricFamily(
                "workqueue_oldest_pending_age_seconds",
                "Age of the oldest waiting delivery (0 when none waits; no sample when its "
                "transport cannot tell, as SQS cannot).",
                labels=labels,
            ),
        }
        capped = GaugeMetricFamily(
            "workqueue_counts_capped",
            "1 when one of the subscription's counts above stopped at METRICS_COUNT_CAP (the "
            "real number is larger: `workqueue stats` counts it all).",
            labels=labels,
        )
        report = operations.queue_gauges(actor=self.actor)
        for counts in report.gauges:
            name = [counts.subscription_name]
            gauges["pending"].add_metric(name, counts.pending)
            gauges["due"].add_metric(name, counts.due)
            gauges["in_flight"].add_metric(name, counts.in_flight)
            gauges["dead_lettered"].add_metric(name, counts.dead_lettered)
            gauges["blocked_keys"].add_metric(name, counts.blocked_keys or 0)
            age = counts.oldest_pending_age_seconds
            if age is not None or counts.pending == 0:
                # None with work waiting: the transport cannot tell (SQS), and 0 would say
                # that nothing has waited (review helper-142). The series is left out.
                gauges["oldest"].add_metric(name, age or 0)
            capped.add_metric(name, int(counts.capped))
        gauges["capped"] = capped
        unavailable = GaugeMetricFamily(
            "workqueue_gauges_unavailable",
            "1 when the subscription's gauges above could not be read this scrape (its "
            "transport is away, the role may not call the procedure, or a queue table was "
            "locked for more than 2 s; the error is logged).",
            labels=labels,
        )
        for subscription_name in report.unavailable:
            unavailable.add_metric([subscription_name], 1)
        gauges["unavailable"] = unavailable
        yield from gauges.values()
        now = database_now()
        live_hosts = list(HostRecord.objects.live(now))
        yield _running_hosts(live_hosts, self.actor)
        yield from _handler_runs(live_hosts, now, self.actor)
        if self.actor.subscriptions:
            return  # host identities are for unrestricted readers only
        seen = GaugeMetricFamily(
            "workqueue_host_last_seen_seconds",
            "Seconds since each live host last recorded its health, by host id.",
            # Not "instance": Prometheus sets that on every series it scrapes and renames a
            # target's own to exported_instance (review helper-166).
            labels=["host"],
        )
        for record in live_hosts:
            seen.add_metric(
                [record.instance_id], max((now - record.last_seen_at).total_seconds(), 0.0)
            )
        yield seen
        live = GaugeMetricFamily("workqueue_live_hosts", "Hosts that reported recently.")
        live.add_metric([], len(seen.samples))
        yield live
        # Not after the gauges above found the tables locked: the sizes would wait as long again.
        yield from _database_gauges(read_sizes=not report.locked)


def _running_hosts(live_hosts: list[Any], actor: Actor) -> Metric:
    """How many live hosts run (are claiming for) each subscription meant to run on them:
    Active, consumed by work-queue hosts, its topic and transport Active. With the due and
    in-flight gauges it says what ``/health`` calls NotRunning (work waits that nothing will
    take), which the live host count alone cannot say while other subscriptions' hosts live
    (review helper-142). None for a subscription waiting on purpose (Paused, Disabled), so an
    alert on it cannot fire for those."""
    from workqueue.models import Subscription

    running: dict[str, int] = {}
    for record in live_hosts:
        entries = record.subscription_entries()
        for name in {entry["name"] for entry in entries if entry["state"] == "Running"}:
            running[name] = running.get(name, 0) + 1
    meant_to_run = Subscription.objects.filter(
        status="Active",
        host_type="Worker",
        topic__status="Active",
        topic__transport__status="Active",
    )
    if actor.subscriptions:
        meant_to_run = meant_to_run.filter(name__in=actor.subscriptions)
    family = GaugeMetricFamily(
        "workqueue_running_hosts",
        "Live hosts running the subscription (claiming for it); only subscriptions meant to "
        "run on hosts (Active, with an Active topic and transport) have one.",
        labels=["subscription"],
    )
    for name in meant_to_run.order_by("name").values_list("name", flat=True):
        family.add_metric([name], running.get(name, 0))
    return family


def _handler_runs(live_hosts: list[Any], now: Any, actor: Actor) -> Iterator[Metric]:
    """The oldest handler run and the runs past their threshold, per subscription, as the live
    hosts recorded them (only the host that runs a handler knows when it started; see
    runtime.handler_runs). A series for every subscription a live host lists, 0 when none of
    its handlers runs. A host records its stuck runs as soon as they change, and the ages
    every 10 s: each age is its host's figure plus the time since that report."""
    oldest: dict[str, float] = {}
    stuck: dict[str, int] = {}
    for record in live_hosts:
        since_report = max((now - record.last_seen_at).total_seconds(), 0.0)
        for entry in record.subscription_entries():
            name = entry["name"]
            if actor.subscriptions and name.strip().lower() not in actor.subscriptions:
                continue
            age = entry["oldest_run_seconds"]
            age = 0.0 if age is None else age + since_report
            oldest[name] = max(oldest.get(name, 0.0), age)
            stuck[name] = stuck.get(name, 0) + entry["stuck_count"]
    ages = GaugeMetricFamily(
        "workqueue_oldest_handler_run_age_seconds",
        "How long the oldest handler of the subscription running on a live host has run (0 "
        "when none runs).",
        labels=["subscription"],
    )
    counts = GaugeMetricFamily(
        "workqueue_stuck_handler_runs",
        "Handler runs on live hosts past their threshold (the subscription's "
        "max_processing_seconds, else HANDLER_RUN_WARNING_SECONDS); GET /work-queue/health "
        "names their deliveries.",
        labels=["subscription"],
    )
    for name in sorted(oldest):
        ages.add_metric([name], oldest[name])
        counts.add_metric([name], stuck[name])
    yield ages
    yield counts


def _database_gauges(*, read_sizes: bool = True) -> Iterator[Metric]:
    """The DBA's view: queue table sizes against their rows (unless not ``read_sizes``), and
    the vacuum horizon. Database-wide (sized by every subscription's traffic), so unrestricted
    readers only."""
    from workqueue import transport

    try:
        table_sizes = transport.queue_table_sizes() if read_sizes else []
    except LockTimeoutError as exc:
        # A lock on a table the gauges do not read (VACUUM FULL of the message table): the
        # gauges stand, and the horizon and notification queue below, which read no queue
        # table; only the sizes are left out (reviews helper-189, helper-191).
        logger.warning("Metrics: the queue tables' sizes could not be read: %s", exc)
        table_sizes = []

    table = ["table"]
    sizes = {
        "table_bytes": GaugeMetricFamily(
            "workqueue_db_table_bytes",
            "Disk space of each queue table (indexes apart).",
            labels=table,
        ),
        "index_bytes": GaugeMetricFamily(
            "workqueue_db_index_bytes", "Disk space of each queue table's indexes.", labels=table
        ),
        "live_rows": GaugeMetricFamily(
            "workqueue_db_live_rows",
            "Live rows of each queue table, from the database's statistics (a little behind).",
            labels=table,
        ),
        "dead_rows": GaugeMetricFamily(
            "workqueue_db_dead_rows",
            "Dead row versions waiting for vacuum in each queue table (PostgreSQL only).",
            labels=table,
        ),
    }
    for size in table_sizes:
        sizes["table_bytes"].add_metric([size.name], size.table_bytes)
        sizes["index_bytes"].add_metric([size.name], size.index_bytes)
        sizes["live_rows"].add_metric([size.name], size.live_rows)
        if size.dead_rows is not None:
            sizes["dead_rows"].add_metric([size.name], size.dead_rows)
    yield from sizes.values()
    horizon = transport.vacuum_horizon()
    seconds = GaugeMetricFamily(
        "workqueue_db_vacuum_horizon_age_seconds",
        "How long the oldest transaction, snapshot or prepared transaction that keeps vacuum "
        "from cleaning the queue tables has been held (0 when none; a replication slot has no "
        "start time and shows in the _transactions gauge only).",
    )
    seconds.add_metric([], horizon.age_seconds)
    yield seconds
    if horizon.age_transactions is not None:
        transactions = GaugeMetricFamily(
            "workqueue_db_vacuum_horizon_age_transactions",
            "Age of the vacuum horizon in transaction ids (PostgreSQL's age(xmin)).",
        )
        transactions.add_metric([], horizon.age_transactions)
        yield transactions
    visible = GaugeMetricFamily(
        "workqueue_db_vacuum_horizon_sees_every_session",
        "1 when this login sees every session (pg_monitor / VIEW SERVER STATE); 0 when a "
        "session of another login could hold the horizon unseen.",
    )
    visible.add_metric([], int(horizon.sees_every_session))
    yield visible
    usage = transport.notification_queue_usage()
    if usage is not None:
        queue = GaugeMetricFamily(
            "workqueue_db_notification_queue_usage",
            "How full the server's notification queue is, from 0 to 1 (every publish fails at "
            "1); it stays near 0 unless a listening session stops reading (PostgreSQL only).",
        )
        queue.add_metric([], usage)
        yield queue


def render(actor: Actor = CLI) -> bytes:
    """The exposition text: this process's metrics and the queue's gauges."""
    return generate_latest(_combined(QueueCollector(actor)))


def render_once() -> tuple[bytes, bool]:
    """The exposition text for a one-shot printout, and whether the queue's gauges could be
    read: the caller fails when not, since a script reading its exit status would otherwise
    take a database that is away for a queue that is fine (review helper-142)."""
    cluster = QueueCollector()
    return generate_latest(_combined(cluster)), not cluster.read_failed


class _ProcessMetricsOf:
    """This process's metrics as a reader limited to named subscriptions may see them: the
    series of those subscriptions and those naming none, never a series naming a topic (what
    this process published, and where) or another subscription."""

    def __init__(self, subscriptions: frozenset[str]) -> None:
        self.subscriptions = subscriptions

    def collect(self) -> Iterator[Metric]:
        for family in PROCESS.collect():
            family.samples = [s for s in family.samples if self._visible(s.labels)]
            if family.samples:
                yield family

    def _visible(self, labels: dict[str, str]) -> bool:
        if "topic" in labels:
            return False
        subscription = labels.get("subscription")
        return subscription is None or subscription in self.subscriptions


def serve(port: int, address: str = "127.0.0.1") -> Any:
    """Serve this process's metrics and the queue's gauges over HTTP without authentication
    (an internal scrape port: bind it where only Prometheus reaches). Returns the server."""
    server, _thread = start_http_server(
        port,
        addr=address,
        registry=_combined(_OneReadAtATime(QueueCollector(close_connections=True))),
    )
    return server


#: How long a scrape of the port waits for another scrape's read of the gauges (a read takes
#: milliseconds) before it answers without them.
GAUGES_READ_WAIT_SECONDS = 2.0


class _OneReadAtATime(Collector):
    """The queue's gauges for an unauthenticated port: one scrape reads the database at a
    time, and a scrape that waited for it serves the read that began after it arrived (as
    fresh as its own would be), or, once it has waited GAUGES_READ_WAIT_SECONDS, none. The
    server answers each request on a thread of its own, so whoever reached the port opened a
    database session per scrape sent at once, up to ``max_connections`` (review
    helper-142)."""

    def __init__(self, cluster: QueueCollector) -> None:
        self.actor = cluster.actor
        self._cluster = cluster
        self._lock = threading.Lock()
        self._began = float("-inf")  # monotonic: when the last read began
        self._families: list[Metric] = []

    def collect(self) -> Iterator[Metric]:
        arrived = time.monotonic()
        if not self._lock.acquire(timeout=GAUGES_READ_WAIT_SECONDS):
            # The read under way has waited this long (a queue table locked by VACUUM FULL or
            # a migrate's ALTER TABLE: each of its reads waits 2 s at most, and there are a
            # few): answer with this process's counters now. Waiting on, every scrape sent
            # meanwhile held a server thread for as long as the read took, and while reads had
            # no lock timeout, the port answered nothing as long as the lock was held (review
            # helper-185).
            logger.warning(
                "Metrics: the queue's gauges are still being read after %.0f s (a queue table "
                "locked?); answering without them",
                GAUGES_READ_WAIT_SECONDS,
            )
            return iter([read_failed_gauge(True)])
        try:
            if self._began < arrived:
                began = time.monotonic()
                # Kept only once read: after a read that raised, the next scrape reads again.
                self._families = list(self._cluster.collect())
                self._began = began
            return iter(self._families)
        finally:
            self._lock.release()


def _combined(cluster: QueueCollector | _OneReadAtATime) -> CollectorRegistry:
    registry = CollectorRegistry()
    limited = cluster.actor.subscriptions
    # A registry is a collector of its metrics.
    registry.register(_ProcessMetricsOf(limited) if limited else PROCESS)
    registry.register(cluster)
    return registry
