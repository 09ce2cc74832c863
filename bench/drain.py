"""Drain and pickup benchmark for one host process on one subscription.

Usage (against the embedded PostgreSQL, or DATABASE_URL):
    PYTHONPATH=. .venv/bin/python bench/drain.py --messages 10000 --concurrency 1 8 32
    PYTHONPATH=. .venv/bin/python bench/drain.py --pickup 300
    PYTHONPATH=. .venv/bin/python bench/drain.py --partition-mode Exclusive --keys 100 --pickup 0
    PYTHONPATH=. .venv/bin/python bench/drain.py --priorities 5 --pickup 0

Drain: publish N no-op messages first (keyless, or spread over --keys partition keys), then time
a host (in this process) from start until it has completed them all. Pickup: with the host idle
and listening, publish one message at a time and measure from the publish call's return
(committed) to the handler starting. With --priorities P the backlog's messages take P
different priorities in turn (-2, -1, 0, 1, 2 for 5), so claims visit several priority levels.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import threading
import time
import uuid

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
# The project's settings fail closed. A benchmark runs them with DEBUG off (DEBUG would keep
# every query in memory), so it opts in to the embedded PostgreSQL when DATABASE_URL is unset
# and signs nothing that outlives the run.
os.environ.setdefault("WORKQUEUE_LOCALDB", "1")
os.environ.setdefault("DJANGO_SECRET_KEY", secrets.token_urlsafe(50))

import django

django.setup()

from django.contrib.auth import get_user_model  # noqa: E402
from django.db import connection  # noqa: E402

from workqueue import BaseWorkHandler, Outcome, publish, publish_many  # noqa: E402
from workqueue.conf import get_settings  # noqa: E402
from workqueue.driver import get_driver  # noqa: E402
from workqueue.driver.base import QUEUE_TABLES  # noqa: E402
from workqueue.models import Subscription, Topic, Transport  # noqa: E402
from workqueue.runtime.handlers import HandlerRegistry  # noqa: E402
from workqueue.runtime.host import Host, HostConfig  # noqa: E402

started: list[float] = []
done = threading.Semaphore(0)


class NoopHandler(BaseWorkHandler):
    def handle(self, message, context):
        started.append(time.perf_counter())
        done.release()
        return Outcome.complete()


def make_subscription(tag: str, partition_mode: str = "None") -> Subscription:
    topic = Topic.objects.create(
        name=f"bench.{tag}", transport=Transport.objects.get(name="Database")
    )
    return Subscription.objects.create(
        topic=topic, name=f"bench.{tag}-sub", handler_key="bench", partition_mode=partition_mode
    )


def remove(subscription: Subscription) -> None:
    get_driver().remove_topic(str(subscription.topic_id))


def host_for(subscription: Subscription, concurrency: int) -> Host:
    registry = HandlerRegistry()
    registry.register("bench", NoopHandler)
    config = HostConfig.from_settings(
        get_settings(),
        [subscription.name],
        concurrency=concurrency,
        sweeper_interval_ms=0,
        reconcile_interval_ms=0,
    )
    return Host(config, registry=registry)


def maintain_queue_tables(command: str) -> None:
    with connection.cursor() as cursor:
        for table in QUEUE_TABLES:
            cursor.execute(f"{command} {table}")


def drain(
    messages: int, concurrency: int, partition_mode: str, keys: int, steady: bool, priorities: int
) -> float:
    """Messages per second for one host draining a published backlog.

    With ``steady``, each run starts from vacuumed tables (autovacuum lags behind a benchmark's
    bursts, and dead rows left by earlier runs halved later ones) and the backlog is analyzed
    before the drain, as autovacuum would have done in a live queue: otherwise a drain right
    after a vacuum of the emptied tables is planned from statistics that say "empty".
    """
    subscription = make_subscription(f"drain-{uuid.uuid4().hex[:6]}", partition_mode)
    try:
        if steady:
            maintain_queue_tables("VACUUM")
        for offset in range(0, messages, 500):
            publish_many(
                subscription.topic.name,
                [
                    {
                        "payload": {"n": n},
                        "partition_key": f"k{n % keys}" if keys else None,
                        "priority": n % priorities - priorities // 2,
                    }
                    for n in range(offset, min(offset + 500, messages))
                ],
            )
        if steady:
            maintain_queue_tables("ANALYZE")
        started.clear()
        host = host_for(subscription, concurrency)
        began = time.perf_counter()
        host.start()
        for _ in range(messages):
            done.acquire()
        host.shutdown()  # waits for the last completions to be settled
        elapsed = time.perf_counter() - began
        remaining = subscription.deliveries.exclude(status="Completed").count()
        assert remaining == 0, f"{remaining} deliveries not completed"
        return messages / elapsed
    finally:
        remove(subscription)


def pickup(samples: int) -> list[float]:
    subscription = make_subscription(f"pickup-{uuid.uuid4().hex[:6]}")
    host = host_for(subscription, 8)
    host.start()
    latencies = []
    try:
        time.sleep(1.0)  # let the listener connect and the loop go idle
        for _ in range(samples):
            started.clear()
            publish(subscription.topic.name, {"t": 1})
            returned = time.perf_counter()
            done.acquire()
            latencies.append((started[0] - returned) * 1000)
            time.sleep(0.02)
    finally:
        host.shutdown()
        remove(subscription)
    return latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 32])
    parser.add_argument("--pickup", type=int, default=300, help="pickup samples (0: skip)")
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
        "--as-is",
        dest="steady",
        action="store_false",
        help="skip the VACUUM before and the ANALYZE after publishing each backlog (they need "
        "the tables' owner or a superuser)",
    )
    args = parser.parse_args()
    User = get_user_model()
    User._default_manager.get_or_create(**{User.USERNAME_FIELD: get_settings().SYSTEM_USER})
    print(f"database: {get_driver().vendor_label}, durability defaults")
    for concurrency in args.concurrency:
        rate = drain(
            args.messages,
            concurrency,
            args.partition_mode,
            args.keys,
            args.steady,
            max(args.priorities, 1),
        )
        shape = f", {args.partition_mode} over {args.keys} keys" if args.keys else ""
        if args.priorities > 1:
            shape += f", {args.priorities} priorities"
        print(
            f"drain {args.messages} no-op messages{shape}, concurrency {concurrency}: {rate:,.0f}/s"
        )
    if args.pickup:
        lat = pickup(args.pickup)
        print(
            f"idle pickup over {len(lat)} publishes: p50 {statistics.median(lat):.2f} ms, "
            f"p95 {percentile(lat, 0.95):.2f} ms, p99 {percentile(lat, 0.99):.2f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
