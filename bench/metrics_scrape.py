"""What one metrics scrape costs as the backlog grows.

Usage (against the embedded PostgreSQL, or DATABASE_URL):
    PYTHONPATH=. .venv/bin/python bench/metrics_scrape.py --pending 1000 100000 1000000

For each size: publish that many messages to a fresh subscription (half of them on 100 partition
keys), ANALYZE, then time SCRAPES renders of the exposition (``workqueue.metrics.render``: the
stats and the capped backlog of every subscription, and the host records).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid

from bench.django_setup import prepare_database, start_django

start_django()

from django.db import connection  # noqa: E402

from workqueue import metrics, publish_many  # noqa: E402
from workqueue.driver import get_driver  # noqa: E402
from workqueue.models import Subscription, Topic, Transport  # noqa: E402

SCRAPES = 20
BATCH = 100


def scrape_ms(pending: int) -> list[float]:
    tag = uuid.uuid4().hex[:6]
    topic = Topic.objects.create(
        name=f"bench.metrics-{tag}", transport=Transport.objects.get(name="Database")
    )
    Subscription.objects.create(
        topic=topic, name=f"bench.metrics-{tag}-sub", handler_key="bench", partition_mode="None"
    )
    try:
        items = [{"payload": {}}] * (BATCH // 2) + [
            {"payload": {}, "partition_key": f"k{n % 100}"} for n in range(BATCH // 2)
        ]
        for _ in range(0, pending, BATCH):
            publish_many(topic.name, items)
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE workqueue_delivery")
        metrics.render()  # warm the plans
        durations = []
        for _ in range(SCRAPES):
            began = time.perf_counter()
            metrics.render()
            durations.append((time.perf_counter() - began) * 1000)
        return durations
    finally:
        get_driver().remove_topic(str(topic.id))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pending", type=int, nargs="*", default=[1000, 100_000])
    args = parser.parse_args()
    prepare_database()
    print(f"database: {get_driver().vendor_label}")
    for pending in args.pending:
        ms = scrape_ms(pending)
        print(
            f"{pending} pending: scrape median {statistics.median(ms):.1f} ms, max {max(ms):.1f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
