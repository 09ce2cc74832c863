"""Retention purge throughput: how fast the sweeper works off a backlog of settled deliveries.

Usage (against the embedded PostgreSQL, or DATABASE_URL; as the tables' owner):
    PYTHONPATH=. .venv/bin/python bench/sweep.py --deliveries 100000
    PYTHONPATH=. .venv/bin/python bench/sweep.py --deliveries 2000   # a short variant

Publishes --deliveries messages to a topic with one subscription, claims and completes them
all, moves their times back past the topic's retention, then runs sweeper passes back to back
(as the sweeper does while it is behind) until a pass purges nothing. Prints each pass (rows
purged, seconds) and the whole purge's rate in rows a second: settled deliveries and their
messages together. A queue whose hosts settle more deliveries a second than this for long
grows its tables whatever the sweeper's interval.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid

from bench.django_setup import prepare_database, start_django

start_django()

from bench.drain import make_subscriptions  # noqa: E402
from workqueue import publish_many  # noqa: E402
from workqueue.driver import get_driver  # noqa: E402
from workqueue.models import Subscription, Topic  # noqa: E402
from workqueue.runtime.sweeper import Sweeper  # noqa: E402
from workqueue.transport import Receiver  # noqa: E402

DAY = 86_400


def settled_backlog(topic: Topic, subscription: Subscription, count: int) -> None:
    """``count`` deliveries completed and aged past their topic's retention."""
    for start in range(0, count, 500):
        publish_many(
            topic.name, [{"payload": {"n": n}} for n in range(start, min(count, start + 500))]
        )
    receiver = Receiver(str(subscription.id), "bench")
    while claimed := receiver.receive(500).deliveries:
        receiver.complete_many(claimed)
    get_driver().shift_time(topic.retention_days * DAY + 60, topic_id=str(topic.id))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--deliveries", type=int, default=100_000)
    args = parser.parse_args()
    prepare_database()

    (subscription,) = make_subscriptions(f"sweep-{uuid.uuid4().hex[:6]}")
    topic = subscription.topic
    try:
        settled_backlog(topic, subscription, args.deliveries)
        print(f"database: {get_driver().vendor_label}; {args.deliveries:,} settled deliveries")
        print("pass  deliveries  messages  seconds")
        sweeper, passes, rows, began = Sweeper(), 0, 0, time.monotonic()
        while True:
            started = time.monotonic()
            result = sweeper.run_once()
            took = time.monotonic() - started
            if result.skipped:
                raise SystemExit(
                    "Another sweeper holds the lock (a host sweeping this database?): its passes "
                    "would mix with these. Stop it, or benchmark the embedded database."
                )
            deliveries = result.purged["terminal_deliveries"]
            messages = result.purged["orphan_messages"]
            if deliveries < 0 or messages < 0:
                raise SystemExit("a purge step failed: see the log above")
            passes += 1
            rows += deliveries + messages
            print(f"{passes:4}  {deliveries:10,}  {messages:8,}  {took:7.2f}", flush=True)
            if deliveries == 0 and messages == 0:
                break
        seconds = time.monotonic() - began
        print(
            f"purged {rows:,} rows in {seconds:.1f} s over {passes} passes back to back: "
            f"{rows / seconds:,.0f} rows/s ({args.deliveries / seconds:,.0f} deliveries/s "
            "with their messages)"
        )
    finally:
        get_driver().remove_topic(str(topic.id))
    return 0


if __name__ == "__main__":
    sys.exit(main())
