"""Steady-state soak: publish and drain at a steady rate for a long time, with retention purges,
and watch whether the queue tables, their indexes or the cost of a claim keep growing.

Usage (against the embedded PostgreSQL, or DATABASE_URL; as the tables' owner):
    PYTHONPATH=. .venv/bin/python bench/steady.py --minutes 60 --rate 500   # the hour-long run
    PYTHONPATH=. .venv/bin/python bench/steady.py --minutes 1 --interval 10 --sweep-seconds 10

One host in this process runs one subscription (--concurrency) and its sweeper (every
--sweep-seconds, by default the product's interval, and sooner while it is behind); a
publisher thread publishes --rate messages a second in batches of --batch. Retention is
counted in days, so the benchmark ages time instead of waiting: every interval it moves the
completion (and publish) time of rows completed more than --age-seconds ago back by a day, and
the sweeper's ordinary retention purge then deletes them. (Those updates write each completed
row once more, which makes bloat worse than in a live queue.)

Each interval prints: deliveries completed per second, the pending backlog, the mean claim
call (from the host's own metric), the queue tables' and indexes' sizes, and this process's
resident memory (the host's and the publisher's). At the end a verdict compares the last
intervals with the first ones: the drain keeping up within 10 %, the mean claim within 10 %
(or 1 ms), and sizes and memory no longer growing over the second half: growth is the run's
last quarter with both its mean and its peak more than 10 % above those of the quarter
before it (a table's size is a sawtooth between vacuum truncations, and one sample at the top
of a tooth is not growth). As the host commands do, the host starts with what start-up made
frozen out of full garbage collections.
Exit 1 when the verdict fails and --strict is given.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass

from bench.django_setup import prepare_database, start_django

start_django()

from django.db import connection  # noqa: E402

from workqueue import BaseWorkHandler, Outcome, metrics, publish_many  # noqa: E402
from workqueue.conf import get_settings  # noqa: E402
from workqueue.driver import get_driver  # noqa: E402
from workqueue.models import Subscription, Topic, Transport  # noqa: E402
from workqueue.runtime.handlers import HandlerRegistry  # noqa: E402
from workqueue.runtime.host import Host, HostConfig  # noqa: E402
from workqueue.runtime.process import start_up_objects_frozen  # noqa: E402

completed = 0
completed_lock = threading.Lock()


class NoopHandler(BaseWorkHandler):
    def handle(self, message, context):
        global completed
        with completed_lock:
            completed += 1
        return Outcome.complete()


@dataclass(frozen=True)
class Sample:
    minute: float
    drained_per_second: float
    pending: int
    claim_ms: float
    table_mb: float
    index_mb: float
    resident_mb: float


def claim_totals(name: str) -> tuple[float, float]:
    """(seconds, calls) of the host's claims so far, from its claim-duration histogram."""
    seconds = calls = 0.0
    for metric in metrics.CLAIM_SECONDS.collect():
        for sample in metric.samples:
            if sample.labels.get("subscription") != name:
                continue
            if sample.name.endswith("_sum"):
                seconds = sample.value
            elif sample.name.endswith("_count"):
                calls = sample.value
    return seconds, calls


def sizes() -> tuple[float, float]:
    tables = get_driver().queue_table_sizes()
    return (
        sum(t.table_bytes for t in tables) / 2**20,
        sum(t.index_bytes for t in tables) / 2**20,
    )


def resident_mb() -> float:
    """This process's resident memory (Linux), in MB."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def age_completed(subscription: Subscription, age_seconds: float) -> None:
    """Move rows completed more than ``age_seconds`` ago a day back (past the topic's one-day
    retention), with their messages, so the sweeper purges them as it would a day later."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE workqueue_message m SET published_at = published_at - interval '1 day' "
            "FROM workqueue_delivery d WHERE d.message_id = m.id AND d.subscription_id = %s "
            "AND d.status = 'Completed' AND d.completed_at < now() - %s * interval '1 second' "
            "AND d.completed_at > now() - interval '1 day'",
            [subscription.id, age_seconds],
        )
        cursor.execute(
            "UPDATE workqueue_delivery SET completed_at = completed_at - interval '1 day' "
            "WHERE subscription_id = %s AND status = 'Completed' "
            "AND completed_at < now() - %s * interval '1 second' "
            "AND completed_at > now() - interval '1 day'",
            [subscription.id, age_seconds],
        )


def publisher(topic: str, rate: float, batch: int, stop: threading.Event) -> None:
    """Publish ``rate`` messages a second in batches of ``batch``, on a fixed schedule."""
    began = time.monotonic()
    sent = 0
    while not stop.is_set():
        due = began + sent / rate
        if stop.wait(max(due - time.monotonic(), 0)):
            return
        publish_many(topic, [{"payload": {"n": sent + i}} for i in range(batch)])
        sent += batch


def verdict(samples: list[Sample], rate: float) -> list[str]:
    """What failed, comparing the first and last quarter of the run (at least one sample
    each), and the second half's sizes; empty when the steady state held."""
    quarter = max(len(samples) // 4, 1)
    first, last = samples[:quarter], samples[-quarter:]
    problems = []
    last_drain = statistics.mean(s.drained_per_second for s in last)
    if last_drain < 0.9 * rate:
        problems.append(f"the drain fell behind: {last_drain:,.0f}/s against {rate:,.0f}/s")
    first_claim = statistics.mean(s.claim_ms for s in first)
    last_claim = statistics.mean(s.claim_ms for s in last)
    if last_claim > max(first_claim * 1.1, first_claim + 1.0):
        problems.append(f"claims got slower: {first_claim:.2f} ms, then {last_claim:.2f} ms")
    half = samples[len(samples) // 2 :]
    if len(half) >= 2:
        # A table grows between vacuums and shrinks when vacuum truncates it, so its size is a
        # sawtooth: one sample says little, and neither does one peak (a sample taken just
        # before a truncation). Growth lifts the whole band, so it must show in both the
        # mean and the peak of the later quarter; a lone spike lifts the peak only.
        earlier, later = half[: len(half) // 2], half[len(half) // 2 :]
        for label, size, slack_mb in (
            ("tables", "table_mb", 1),
            ("indexes", "index_mb", 1),
            # An allocator keeps some of what it freed: growth, not a few MB, is the problem.
            ("this process's memory", "resident_mb", 8),
        ):
            before = [getattr(s, size) for s in earlier]
            after = [getattr(s, size) for s in later]
            if all(
                end > start * 1.1 + slack_mb
                for start, end in (
                    (statistics.mean(before), statistics.mean(after)),
                    (max(before), max(after)),
                )
            ):
                problems.append(
                    f"{label} still growing: means of {statistics.mean(before):.1f} MB, "
                    f"then {statistics.mean(after):.1f} MB; peaks of {max(before):.1f} MB, "
                    f"then {max(after):.1f} MB"
                )
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--rate", type=float, default=500, help="messages published a second")
    parser.add_argument("--batch", type=int, default=50, help="messages per publish_many")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--interval", type=float, default=60, help="seconds between samples")
    parser.add_argument(
        "--sweep-seconds",
        type=float,
        default=get_settings().SWEEPER_INTERVAL_MS / 1000,
        help="the sweeper's interval (default: the product's, SWEEPER_INTERVAL_MS)",
    )
    parser.add_argument("--age-seconds", type=float, default=60)
    parser.add_argument("--strict", action="store_true", help="exit 1 when the verdict fails")
    args = parser.parse_args()
    prepare_database()

    tag = f"steady-{uuid.uuid4().hex[:6]}"
    topic = Topic.objects.create(
        name=f"bench.{tag}", transport=Transport.objects.get(name="Database"), retention_days=1
    )
    subscription = Subscription.objects.create(
        topic=topic, name=f"bench.{tag}-sub", handler_key="bench"
    )
    registry = HandlerRegistry()
    registry.register("bench", NoopHandler)
    with start_up_objects_frozen():  # as the host commands run a host
        host = Host(
            HostConfig.from_settings(
                get_settings(),
                [subscription.name],
                concurrency=args.concurrency,
                sweeper_interval_ms=int(args.sweep_seconds * 1000),
                reconcile_interval_ms=0,
            ),
            registry=registry,
        )
        stop = threading.Event()
        feeder = threading.Thread(
            target=publisher, args=(topic.name, args.rate, args.batch, stop), daemon=True
        )
        samples: list[Sample] = []
        print(
            f"database: {get_driver().vendor_label}, durability defaults; {args.rate:,.0f} "
            f"messages/s for {args.minutes:g} min, concurrency {args.concurrency}"
        )
        print("minute  drained/s  pending  claim ms  tables MB  indexes MB  process MB")
        began = time.monotonic()
        host.start()
        feeder.start()
        try:
            last_done, last_time = 0, began
            last_claim = claim_totals(subscription.name)
            while time.monotonic() - began < args.minutes * 60:
                left = args.minutes * 60 - (time.monotonic() - began)
                time.sleep(min(args.interval, max(left, 0)))
                age_completed(subscription, args.age_seconds)
                now = time.monotonic()
                with completed_lock:
                    done = completed
                claim = claim_totals(subscription.name)
                calls = claim[1] - last_claim[1]
                table_mb, index_mb = sizes()
                sample = Sample(
                    minute=(now - began) / 60,
                    drained_per_second=(done - last_done) / (now - last_time),
                    pending=subscription.deliveries.filter(status="Pending").count(),
                    claim_ms=(claim[0] - last_claim[0]) / calls * 1000 if calls else 0.0,
                    table_mb=table_mb,
                    index_mb=index_mb,
                    resident_mb=resident_mb(),
                )
                samples.append(sample)
                print(
                    f"{sample.minute:6.1f}  {sample.drained_per_second:9,.0f}  {sample.pending:7,}"
                    f"  {sample.claim_ms:8.2f}  {sample.table_mb:9.1f}  {sample.index_mb:10.1f}"
                    f"  {sample.resident_mb:10.1f}",
                    flush=True,
                )
                last_done, last_time, last_claim = done, now, claim
        finally:
            stop.set()
            feeder.join()
            host.shutdown()
            get_driver().remove_topic(str(topic.id))
    problems = verdict(samples, args.rate)
    print("steady state held" if not problems else "steady state failed: " + "; ".join(problems))
    return 1 if problems and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
