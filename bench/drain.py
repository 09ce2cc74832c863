"""Drain and pickup benchmark for one host process.

Usage (against the embedded PostgreSQL, or DATABASE_URL):
    PYTHONPATH=. .venv/bin/python bench/drain.py --messages 10000 --concurrency 1 8 32
    PYTHONPATH=. .venv/bin/python bench/drain.py --pickup 300
    PYTHONPATH=. .venv/bin/python bench/drain.py --concurrency --pickup-publisher process
    PYTHONPATH=. .venv/bin/python bench/drain.py --partition-mode Exclusive --keys 100 --pickup 0
    PYTHONPATH=. .venv/bin/python bench/drain.py --priorities 5 --pickup 0
    PYTHONPATH=. .venv/bin/python bench/drain.py --messages 10000 --fanout 10 --pickup 0
    PYTHONPATH=. .venv/bin/python bench/drain.py --messages 20000 --backlog 1000000 --pickup 0
    PYTHONPATH=. .venv/bin/python bench/drain.py --messages 20000 --burst --pickup 0

Drain: publish N no-op messages first (keyless, or spread over --keys partition keys), then time
a host (in this process) from start until it has completed them all. Pickup: with the host idle
and listening, publish one message at a time and measure from the publish call's return
(committed) to the handler starting. The publisher is this process (whose publishes wake its
host in-process), or with --pickup-publisher process a child process, so that only the
database's notification wakes the host, as it does a host on another machine. With
--priorities P the backlog's messages take P
different priorities in turn (-2, -1, 0, 1, 2 for 5), so claims visit several priority levels.

Fan-out (--fanout K): one topic with K subscriptions, each run by the host at --concurrency;
N/K messages are published, so the host drains the same N deliveries in total as with one
subscription, and the rate reported is deliveries per second over all K.

Deep backlog (--backlog B): B pending deliveries are seeded with set-based SQL (as the tables'
owner, which a benchmark may be; nothing else writes the queue tables directly), and the rate
reported is that of the first N of them. Before the drain, --publish-sample messages are
published one at a time onto the backlog and that rate is reported too; run it with --backlog 0
(or --backlog N) for the shallow figure to compare with.

Burst (--burst): the host starts on the emptied queue (vacuumed and analyzed: statistics that
say "empty", as on a new deployment or after a quiet night), settles a few single publishes so
that it has made and kept its plans, and then the --messages are published in batches while it
runs; the rate runs from the first batch to the last delivery handled. Plans kept from the
empty tables must still serve the full ones.

Each drain also reports CPU time per delivery, which a busy machine disturbs far less than the
wall-clock rate: this process's (host threads, psycopg included) and, when PostgreSQL runs on
this machine, that of the host's own backends (from /proc; the WAL writer and other server
processes are not counted).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass

from bench.django_setup import prepare_database, start_django

start_django()

from django.db import connection  # noqa: E402

from bench.percentiles import percentile  # noqa: E402
from bench.proc_cpu import backend_cpu_seconds  # noqa: E402
from workqueue import BaseWorkHandler, Outcome, metrics, publish, publish_many  # noqa: E402
from workqueue.conf import get_settings  # noqa: E402
from workqueue.driver import get_driver  # noqa: E402
from workqueue.driver.base import QUEUE_TABLES  # noqa: E402
from workqueue.models import Subscription, Topic, Transport  # noqa: E402
from workqueue.runtime.handlers import HandlerRegistry  # noqa: E402
from workqueue.runtime.host import Host, HostConfig  # noqa: E402
from workqueue.runtime.process import start_up_objects_frozen  # noqa: E402


class Ledger:
    """When the no-op handler started each call, and a wake-up once ``target`` calls were made
    (one wake-up per run, not one per delivery, so the benchmark itself costs the host little)."""

    def __init__(self) -> None:
        self.started: list[float] = []
        self._calls = itertools.count(1)
        self._target = 0
        self.reached = threading.Event()

    def expect(self, target: int) -> None:
        self.started = []
        self._calls = itertools.count(1)
        self._target = target
        self.reached.clear()

    def record(self) -> None:
        # No lock: list.append and a count's next() are each atomic under the GIL, and a lock
        # taken by every handler thread made the benchmark's own handler a point of contention
        # (a fifth of the host's GIL time at concurrency 32, by py-spy).
        self.started.append(time.perf_counter())
        if next(self._calls) == self._target:
            self.reached.set()


LEDGER = Ledger()


class NoopHandler(BaseWorkHandler):
    def handle(self, message, context):
        LEDGER.record()
        return Outcome.complete()


def make_subscriptions(
    tag: str, partition_mode: str = "None", count: int = 1
) -> list[Subscription]:
    """``count`` subscriptions of one new topic (``bench.TAG``)."""
    topic = Topic.objects.create(
        name=f"bench.{tag}", transport=Transport.objects.get(name="Database")
    )
    return [
        Subscription.objects.create(
            topic=topic,
            name=f"bench.{tag}-sub" if count == 1 else f"bench.{tag}-sub{n}",
            handler_key="bench",
            partition_mode=partition_mode,
        )
        for n in range(count)
    ]


def remove(topic_id: str) -> None:
    get_driver().remove_topic(str(topic_id))


def host_for(
    subscriptions: list[Subscription], concurrency: int, prefetch: int | None = None
) -> Host:
    registry = HandlerRegistry()
    registry.register("bench", NoopHandler)
    config = HostConfig.from_settings(
        get_settings(),
        [s.name for s in subscriptions],
        concurrency=concurrency,
        sweeper_interval_ms=0,
        reconcile_interval_ms=0,
    )
    if prefetch is not None:
        config.subscriptions = [{"name": "*", "prefetch": prefetch}]
    return Host(config, registry=registry)


def seed_backlog(subscription: Subscription, count: int, keys: int) -> None:
    """``count`` Pending deliveries with their messages, in batches of 100,000 rows, as the
    publish procedures would have left them (time-ordered ids, visible in publish order, in the
    past)."""
    key = "'k' || (g %% %(keys)s)" if keys else "NULL"
    with connection.cursor() as cursor:
        for offset in range(0, count, 100_000):
            cursor.execute(
                f"""
                WITH m AS (
                    INSERT INTO workqueue_message (id, publish_ordinal, topic_id, partition_key,
                                                   payload, published_at)
                    SELECT wq_new_id(), nextval('wq_publish_ordinal_seq'), %(topic)s,
                           {key}, jsonb_build_object('n', g), now()
                      FROM generate_series(%(first)s, %(last)s) g
                    RETURNING id, publish_ordinal, partition_key
                )
                INSERT INTO workqueue_delivery (id, message_id, subscription_id, partition_key,
                                                order_key, visible_at)
                SELECT wq_new_id(), m.id, %(sub)s, m.partition_key, m.publish_ordinal,
                       now() - interval '1 hour' + m.publish_ordinal * interval '1 microsecond'
                  FROM m
                """,
                {
                    "topic": subscription.topic_id,
                    "sub": subscription.id,
                    "first": offset,
                    "last": min(offset + 100_000, count) - 1,
                    "keys": keys,
                },
            )


def host_backends_cpu_seconds(publisher_pid: int) -> float | None:
    """CPU of this process's queue connections other than the publisher's (the host's claims,
    settles and listener, all opened when the host started), or None when the server is not
    local."""
    rows = get_driver().execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s AND pid <> %s",
        [f"workqueue:{os.getpid()}", publisher_pid],
    )
    seconds = [backend_cpu_seconds(pid) for (pid,) in rows]
    return None if not seconds or None in seconds else sum(seconds)


def publish_one_at_a_time(topic: str, count: int) -> float:
    """Messages per second for ``count`` single publishes (each its own transaction)."""
    began = time.perf_counter()
    for n in range(count):
        publish(topic, {"sample": n})
    return count / (time.perf_counter() - began)


def maintain_queue_tables(command: str) -> None:
    with connection.cursor() as cursor:
        for table in QUEUE_TABLES:
            cursor.execute(f"{command} {table}")


@dataclass(frozen=True)
class DrainRun:
    rate: float  # deliveries per second
    cpu_us: float  # this process's CPU time per delivery, in microseconds
    db_cpu_us: float | None  # the host's PostgreSQL backends' CPU per delivery
    publish_rate: float | None = None  # single publishes per second onto the backlog


def drain(
    messages: int,
    concurrency: int,
    partition_mode: str,
    keys: int,
    steady: bool,
    priorities: int,
    fanout: int = 1,
    backlog: int = 0,
    publish_sample: int = 0,
    prefetch: int | None = None,
    burst: bool = False,
) -> DrainRun:
    """Time one host draining ``messages`` deliveries.

    With ``steady``, each run starts from vacuumed tables (autovacuum lags behind a benchmark's
    bursts, and dead rows left by earlier runs halved later ones) and the backlog is analyzed
    before the drain, as autovacuum would have done in a live queue: otherwise a drain right
    after a vacuum of the emptied tables is planned from statistics that say "empty".
    """
    subscriptions = make_subscriptions(
        f"drain-{uuid.uuid4().hex[:6]}", partition_mode, count=fanout
    )
    topic = subscriptions[0].topic
    try:
        if burst:
            return drain_burst(subscriptions, messages, concurrency, prefetch)
        if steady:
            maintain_queue_tables("VACUUM")
        if backlog:
            seed_backlog(subscriptions[0], backlog, keys)
        else:
            for offset in range(0, messages // fanout, 500):
                publish_many(
                    topic.name,
                    [
                        {
                            "payload": {"n": n},
                            "partition_key": f"k{n % keys}" if keys else None,
                            "priority": n % priorities - priorities // 2,
                        }
                        for n in range(offset, min(offset + 500, messages // fanout))
                    ],
                )
        if steady:
            maintain_queue_tables("ANALYZE")
        publish_rate = publish_one_at_a_time(topic.name, publish_sample) if publish_sample else None
        measured = messages // fanout * fanout if not backlog else messages
        LEDGER.expect(measured)
        [(publisher_pid,)] = get_driver().execute("SELECT pg_backend_pid()", [])
        with start_up_objects_frozen():  # as the host commands run a host
            host = host_for(subscriptions, concurrency, prefetch)
            cpu = os.times()
            began = time.perf_counter()
            host.start()
            LEDGER.reached.wait()
            elapsed = time.perf_counter() - began
            cpu_after = os.times()
            db_cpu = host_backends_cpu_seconds(publisher_pid)
            host.shutdown()  # waits for the last completions to be settled
        completed = sum(s.deliveries.filter(status="Completed").count() for s in subscriptions)
        assert completed >= measured, f"{measured - completed} deliveries not completed"
        cpu_seconds = (cpu_after.user - cpu.user) + (cpu_after.system - cpu.system)
        return DrainRun(
            measured / elapsed,
            cpu_seconds / measured * 1e6,
            db_cpu / measured * 1e6 if db_cpu is not None else None,
            publish_rate,
        )
    finally:
        remove(topic.id)


#: Single publishes the host settles before a burst, past the five calls after which PostgreSQL
#: keeps a generic plan for each statement of a procedure.
BURST_WARMUP = 20


def drain_burst(
    subscriptions: list[Subscription], messages: int, concurrency: int, prefetch: int | None
) -> DrainRun:
    """``messages`` published in batches of 500 onto a host that started on empty tables."""
    topic = subscriptions[0].topic
    maintain_queue_tables("VACUUM")
    maintain_queue_tables("ANALYZE")
    [(publisher_pid,)] = get_driver().execute("SELECT pg_backend_pid()", [])
    with start_up_objects_frozen():  # as the host commands run a host
        host = host_for(subscriptions, concurrency, prefetch)
        host.start()
        try:
            LEDGER.expect(BURST_WARMUP)
            for n in range(BURST_WARMUP):
                publish(topic.name, {"warm-up": n})
            LEDGER.reached.wait()
            time.sleep(0.5)  # the warm-up's completions settle
            db_cpu_before = host_backends_cpu_seconds(publisher_pid)
            LEDGER.expect(messages)
            cpu = os.times()
            began = time.perf_counter()
            for offset in range(0, messages, 500):
                publish_many(
                    topic.name,
                    [{"payload": {"n": n}} for n in range(offset, min(offset + 500, messages))],
                )
            LEDGER.reached.wait()
            elapsed = time.perf_counter() - began
            cpu_after = os.times()
            db_cpu_after = host_backends_cpu_seconds(publisher_pid)
        finally:
            host.shutdown()
    cpu_seconds = (cpu_after.user - cpu.user) + (cpu_after.system - cpu.system)
    db_cpu = None if db_cpu_before is None or db_cpu_after is None else db_cpu_after - db_cpu_before
    return DrainRun(
        messages / elapsed,
        cpu_seconds / messages * 1e6,  # publishing included: it runs in this process too
        db_cpu / messages * 1e6 if db_cpu is not None else None,
    )


@dataclass(frozen=True)
class PickupRun:
    latencies_ms: list[float]
    claims: float  # claims the host made per pickup (each a round trip; a claim that got a
    # delivery also a commit)
    db_cpu_us: float | None  # the host's PostgreSQL backends' CPU per pickup


def claims_made(subscription: str) -> float:
    """Claims a subscription's consumer in this process has made so far (every claim that
    reached the database is timed in the claim-duration histogram)."""
    value = metrics.PROCESS.get_sample_value(
        "workqueue_claim_duration_seconds_count", {"subscription": subscription}
    )
    return value or 0.0


def pickup(samples: int, publisher: str = "this") -> PickupRun:
    subscriptions = make_subscriptions(f"pickup-{uuid.uuid4().hex[:6]}")
    topic = subscriptions[0].topic
    [(publisher_pid,)] = get_driver().execute("SELECT pg_backend_pid()", [])
    with start_up_objects_frozen():  # as the host commands run a host
        host = host_for(subscriptions, 8)
        host.start()
        latencies = []
        child = None
        try:
            if publisher == "process":
                child = subprocess.Popen(
                    [sys.executable, __file__, "--publish-on-request", topic.name],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            time.sleep(1.0)  # let the listener connect and the loop go idle
            claims_before = claims_made(subscriptions[0].name)
            db_cpu_before = host_backends_cpu_seconds(publisher_pid)
            for _ in range(samples):
                LEDGER.expect(1)
                if child is None:
                    publish(topic.name, {"t": 1})
                    returned = time.perf_counter()
                else:
                    child.stdin.write("publish\n")
                    child.stdin.flush()
                    # perf_counter is CLOCK_MONOTONIC, the same clock in every process here.
                    returned = float(child.stdout.readline())
                if not LEDGER.reached.wait(timeout=30):
                    raise RuntimeError("a published message was not picked up within 30 s")
                latencies.append((LEDGER.started[0] - returned) * 1000)
                time.sleep(0.02)
            claims = (claims_made(subscriptions[0].name) - claims_before) / samples
            db_cpu_after = host_backends_cpu_seconds(publisher_pid)
        finally:
            if child is not None:
                child.stdin.close()
                child.wait(timeout=30)
            host.shutdown()
            remove(topic.id)
    db_cpu = (
        None
        if db_cpu_before is None or db_cpu_after is None
        else (db_cpu_after - db_cpu_before) / samples * 1e6
    )
    return PickupRun(latencies, claims, db_cpu)


def publish_on_request(topic: str) -> int:
    """The other process of ``--pickup-publisher process``: publish one message to ``topic``
    for each line read, and write when each publish returned."""
    for _line in sys.stdin:
        assert publish(topic, {"t": 1}).accepted
        print(time.perf_counter(), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 32])
    parser.add_argument("--pickup", type=int, default=300, help="pickup samples (0: skip)")
    parser.add_argument(
        "--pickup-publisher",
        choices=["this", "process"],
        default="this",
        help="publish the pickup samples from this process, or from another one (then only "
        "the database's notification wakes the host)",
    )
    parser.add_argument("--publish-on-request", metavar="TOPIC", help=argparse.SUPPRESS)
    parser.add_argument(
        "--partition-mode", choices=["None", "Exclusive", "Ordered"], default="None"
    )
    parser.add_argument(
        "--keys", type=int, default=0, help="spread messages over this many partition keys"
    )
    parser.add_argument(
        "--priorities",
        type=int,
        default=1,
        help="spread messages over this many priorities around 0 (1: all priority 0)",
    )
    parser.add_argument(
        "--fanout",
        type=int,
        default=1,
        help="subscriptions on the topic, each run at --concurrency; --messages stays the "
        "number of deliveries drained in total",
    )
    parser.add_argument(
        "--backlog",
        type=int,
        default=0,
        help="seed this many pending deliveries with SQL and time the first --messages of "
        "them (0: publish --messages instead)",
    )
    parser.add_argument(
        "--publish-sample",
        type=int,
        default=0,
        help="before each drain, publish this many messages one at a time onto the backlog "
        "and report that rate",
    )
    parser.add_argument(
        "--prefetch",
        type=int,
        nargs="*",
        default=[None],
        help="run each drain with each of these prefetch settings (deliveries claimed ahead "
        "past the concurrency while handlers are quick; 0: none); default: the settings' own",
    )
    parser.add_argument(
        "--burst",
        action="store_true",
        help="start the host on the emptied queue, then publish --messages while it runs",
    )
    parser.add_argument(
        "--as-is",
        dest="steady",
        action="store_false",
        help="skip the VACUUM before and the ANALYZE after publishing each backlog (they need "
        "the tables' owner or a superuser)",
    )
    args = parser.parse_args()
    prepare_database()
    if args.publish_on_request:
        return publish_on_request(args.publish_on_request)
    if args.fanout < 1:
        parser.error("--fanout must be 1 or more")
    if args.backlog and (args.fanout > 1 or args.priorities > 1):
        parser.error("--backlog seeds one subscription at priority 0: drop --fanout/--priorities")
    if args.burst and (args.backlog or args.fanout > 1 or args.keys or not args.steady):
        parser.error("--burst publishes to one keyless subscription: drop the other options")
    if args.backlog and args.backlog < args.messages:
        parser.error("--backlog must hold at least --messages deliveries")
    print(f"database: {get_driver().vendor_label}, durability defaults")
    for concurrency, prefetch in itertools.product(args.concurrency, args.prefetch):
        run = drain(
            args.messages,
            concurrency,
            args.partition_mode,
            args.keys,
            args.steady,
            max(args.priorities, 1),
            fanout=args.fanout,
            backlog=args.backlog,
            publish_sample=args.publish_sample,
            prefetch=prefetch,
            burst=args.burst,
        )
        shape = f", {args.partition_mode} over {args.keys} keys" if args.keys else ""
        if prefetch is not None:
            shape += f", prefetch {prefetch}"
        if args.priorities > 1:
            shape += f", {args.priorities} priorities"
        if args.fanout > 1:
            shape += f", {args.messages // args.fanout} messages x {args.fanout} subscriptions"
        if args.backlog:
            shape += f", the first of a {args.backlog:,} backlog"
        if args.burst:
            shape += ", published onto a host started on empty tables"
        if run.publish_rate is not None:
            print(
                f"publish {args.publish_sample} one at a time onto a "
                f"{args.backlog or args.messages:,} backlog: {run.publish_rate:,.0f}/s"
            )
        db_cpu = f", PostgreSQL {run.db_cpu_us:,.0f} us" if run.db_cpu_us is not None else ""
        print(
            f"drain {args.messages} no-op messages{shape}, concurrency {concurrency}: "
            f"{run.rate:,.0f}/s (host CPU {run.cpu_us:,.0f} us per delivery{db_cpu})"
        )
    if args.pickup:
        run = pickup(args.pickup, args.pickup_publisher)
        lat = run.latencies_ms
        source = " from another process" if args.pickup_publisher == "process" else ""
        db_cpu = f", PostgreSQL {run.db_cpu_us:,.0f} us" if run.db_cpu_us is not None else ""
        print(
            f"idle pickup over {len(lat)} publishes{source}: p50 {statistics.median(lat):.2f} ms, "
            f"p95 {percentile(lat, 0.95):.2f} ms, p99 {percentile(lat, 0.99):.2f} ms "
            f"({run.claims:.2f} claims per pickup{db_cpu})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
