"""The performance aims of the second round (issue 12), each measured in one run and scored.

Usage (against the embedded PostgreSQL, or DATABASE_URL on this machine):
    PYTHONPATH=. .venv/bin/python bench/aims.py --celery /tmp/peers-celery/bin/python
    PYTHONPATH=. .venv/bin/python bench/aims.py --quick

Every figure comes from the same run on the same machine, so the ratios hold even where the
machine's speed does not (this one is shared and varies by a factor of two between hours):

1. one publish at a time against Celery's enqueue on Redis (``bench/peers/celery_redis.py
   --enqueue-only`` run by ``--celery PYTHON``, the peer's virtualenv; skipped without it),
   in alternating rounds, medians compared. Next to them two durable floors, written through
   the same psycopg connection a publish uses and committed one by one: a bare one-row INSERT,
   and a publish's rows (a message and its delivery, with every index and constraint of the
   queue tables) in one bare statement. A publish cannot cost less than the second without
   storing less, so when that floor is under 1.3x Celery the aim is out of reach with
   durability on;
2. ``publish_many`` of 100, next to a batch's rows written bare (the same floor, 100 at once);
3. the drain at concurrency 8 and 32;
4. idle pickup p50 and p99, published from another process;
5. fan-out: the PostgreSQL CPU of one publish to a topic with 10 subscriptions against one
   with 1, and the host's drain of the same number of deliveries over 10 subscriptions
   against 1;
6. deep backlog: the drain of the first deliveries behind ``--backlog`` (default 1,000,000)
   against a backlog of just those, and single publishes onto each;
7. the steady state is ``bench/steady.py`` (an hour; not run here).

The floors write scratch tables (dropped afterwards): the database role needs CREATE on the
schema, as the embedded PostgreSQL's owner has. The verdict says whether the aim was met in
this run; a benchmark is not a test, and the exit status is 0 whatever the figures.
``--quick`` runs every step small (CI runs it so the script stays runnable); its figures mean
nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
os.environ.setdefault("WORKQUEUE_LOCALDB", "1")
os.environ.setdefault("DJANGO_SECRET_KEY", secrets.token_urlsafe(50))

import django

django.setup()

from django.contrib.auth import get_user_model  # noqa: E402

from bench import drain as drain_bench  # noqa: E402
from bench import publish as publish_bench  # noqa: E402
from bench.percentiles import percentile  # noqa: E402
from workqueue.conf import get_settings  # noqa: E402
from workqueue.driver import get_driver  # noqa: E402
from workqueue.ids import new_message_id  # noqa: E402

CELERY_SCRIPT = Path(__file__).resolve().parent / "peers" / "celery_redis.py"


@dataclass(frozen=True)
class Score:
    aim: str
    measured: str
    target: str
    verdict: str


def verdict(met: bool) -> str:
    return "met" if met else "NOT met"


@dataclass(frozen=True)
class Sizes:
    publishes: int  # single publishes per round (aim 1), and per fan-out shape (aim 5)
    rounds: int
    batched: int  # messages published with publish_many of 100
    drained: int  # deliveries per drain
    pickups: int
    backlog: int
    backlog_drained: int
    backlog_publishes: int


FULL = Sizes(3000, 3, 20_000, 10_000, 300, 1_000_000, 20_000, 1000)
QUICK = Sizes(100, 1, 400, 400, 20, 2_000, 200, 20)


def durable_floor(count: int) -> float:
    """One-row INSERTs per second, each committed on its own, through the driver's own
    connection (psycopg, autocommit): the least any durable publish from Python costs."""
    driver = get_driver()
    table = f"bench_floor_{uuid.uuid4().hex[:8]}"
    driver.execute(
        f"CREATE TABLE {table} (id uuid PRIMARY KEY, at timestamptz NOT NULL, body jsonb)", []
    )
    try:
        statement = f"INSERT INTO {table} VALUES (%s, now(), %s::jsonb)"
        return _timed(count, lambda n: driver.execute(statement, [new_message_id(), _body(n)]))
    finally:
        driver.execute(f"DROP TABLE {table}", [])


def publish_rows_floor(count: int, batch: int = 1) -> float:
    """What publishes to one subscription store, a message row and its delivery row each with
    every index and constraint of the queue tables (scratch copies of them), written ``batch``
    messages to one bare statement, each statement committed: messages per second. The least
    a publish (or a ``publish_many`` of ``batch``) costs without changing what it stores; the
    procedure adds the topic's checks, the fan-out's read of the subscriptions and its locks."""
    driver = get_driver()
    suffix = uuid.uuid4().hex[:8]
    messages, deliveries = f"bench_floor_message_{suffix}", f"bench_floor_delivery_{suffix}"
    driver.execute(f"CREATE TABLE {messages} (LIKE workqueue_message INCLUDING ALL)", [])
    try:
        driver.execute(f"CREATE TABLE {deliveries} (LIKE workqueue_delivery INCLUDING ALL)", [])
        statement = f"""
            WITH m AS (
                INSERT INTO {messages} (id, publish_ordinal, topic_id, payload, published_at)
                SELECT i.id, %s + i.n, %s, i.body::jsonb, now()
                  FROM unnest(%s::uuid[], %s::text[]) WITH ORDINALITY AS i(id, body, n)
                RETURNING id, publish_ordinal
            )
            INSERT INTO {deliveries} (id, message_id, subscription_id, order_key, visible_at)
            SELECT wq_new_id(), m.id, %s, m.publish_ordinal, now() FROM m
        """
        topic, subscription = uuid.uuid4(), uuid.uuid4()

        def write(first: int) -> None:
            numbers = range(first * batch, (first + 1) * batch)
            ids = [new_message_id() for _ in numbers]
            driver.execute(
                statement, [first * batch, topic, ids, [_body(n) for n in numbers], subscription]
            )

        return _timed(count // batch, write) * batch
    finally:
        driver.execute(f"DROP TABLE IF EXISTS {deliveries}, {messages}", [])


def _body(n: int) -> str:
    return json.dumps({"n": n})


def _timed(count: int, step: Callable[[int], object]) -> float:
    began = time.perf_counter()
    for n in range(count):
        step(n)
    return count / (time.perf_counter() - began)


def celery_enqueue(python: str, count: int) -> float:
    """Celery's enqueue rate, one task at a time, from the peer's own virtualenv."""
    run = subprocess.run(
        [python, str(CELERY_SCRIPT), "--tasks", str(count), "--enqueue-only"],
        cwd=CELERY_SCRIPT.parents[2],
        env={**os.environ, "PYTHONPATH": str(CELERY_SCRIPT.parents[2])},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    found = re.search(r"one at a time: ([\d,]+)/s", run.stdout)
    if run.returncode or not found:
        raise SystemExit(f"the Celery peer failed (exit {run.returncode}):\n{run.stderr[-2000:]}")
    return float(found.group(1).replace(",", ""))


def publish_rate(subscriptions: int, count: int) -> tuple[float, float | None]:
    """(single publishes per second, PostgreSQL CPU ms per publish) to a new topic."""
    topic = publish_bench.make_topic(subscriptions)
    try:
        publish_bench.run(topic, min(200, count), 1)  # the connection and its plans, warm
        rate, db_cpu_ms, _ = publish_bench.run(topic, count, 1)
        return rate, db_cpu_ms
    finally:
        get_driver().remove_topic(str(topic.id))


def aim_publish(sizes: Sizes, celery: str | None) -> list[Score]:
    ours, floor, rows, peer = [], [], [], []
    for round_ in range(sizes.rounds):
        ours.append(publish_rate(1, sizes.publishes)[0])
        floor.append(durable_floor(sizes.publishes))
        rows.append(publish_rows_floor(sizes.publishes))
        if celery:
            peer.append(celery_enqueue(celery, sizes.publishes))
        print(
            f"round {round_ + 1}: publish {ours[-1]:,.0f}/s, durable one-row INSERT "
            f"{floor[-1]:,.0f}/s, a publish's rows bare {rows[-1]:,.0f}/s"
            + (f", Celery enqueue {peer[-1]:,.0f}/s" if peer else ""),
            flush=True,
        )
    ours_rate, floor_rate = statistics.median(ours), statistics.median(floor)
    rows_rate = statistics.median(rows)
    if not peer:
        skipped = f"{ours_rate:,.0f}/s; no Celery to compare (--celery PYTHON)"
        return [Score("1. publish one at a time vs Celery enqueue", skipped, ">= 1.3x", "skipped")]
    peer_rate = statistics.median(peer)
    return [
        Score(
            "1. publish one at a time vs Celery enqueue",
            f"{ours_rate / peer_rate:.2f}x ({ours_rate:,.0f}/s vs {peer_rate:,.0f}/s)",
            ">= 1.3x",
            verdict(ours_rate >= 1.3 * peer_rate),
        ),
        Score(
            "   durable floor (bare INSERT) vs Celery",
            f"{floor_rate / peer_rate:.2f}x ({floor_rate:,.0f}/s)",
            "(a bound)",
            "aim 1 within reach" if floor_rate >= 1.3 * peer_rate else "aim 1 out of reach",
        ),
        Score(
            "   a publish's rows, bare, vs Celery",
            f"{rows_rate / peer_rate:.2f}x ({rows_rate:,.0f}/s)",
            "(a bound)",
            "aim 1 within reach" if rows_rate >= 1.3 * peer_rate else "aim 1 out of reach",
        ),
    ]


def aim_batches(sizes: Sizes) -> list[Score]:
    topic = publish_bench.make_topic(1)
    try:
        publish_bench.run(topic, 1000 if sizes is FULL else 100, 100)
        rate, _, _ = publish_bench.run(topic, sizes.batched, 100)
    finally:
        get_driver().remove_topic(str(topic.id))
    floor = publish_rows_floor(sizes.batched, 100)
    return [
        Score(
            "2. publish_many of 100",
            f"{rate:,.0f} messages/s",
            ">= 20,000/s",
            verdict(rate >= 20_000),
        ),
        Score(
            "   a batch's rows, bare",
            f"{floor:,.0f} messages/s ({rate / floor:.2f}x of it)",
            "(a bound)",
            "aim 2 within reach" if floor >= 20_000 else "aim 2 out of reach",
        ),
    ]


def drained(sizes: Sizes, concurrency: int, **options: int) -> drain_bench.DrainRun:
    return drain_bench.drain(
        options.pop("messages", sizes.drained),
        concurrency,
        "None",
        0,
        True,
        1,
        **options,
    )


def aim_drain(sizes: Sizes) -> list[Score]:
    scores = []
    for concurrency, target in ((8, 3000), (32, 6000)):
        rate = drained(sizes, concurrency).rate
        scores.append(
            Score(
                f"3. drain at concurrency {concurrency}",
                f"{rate:,.0f}/s",
                f">= {target:,}/s",
                verdict(rate >= target),
            )
        )
    return scores


def aim_pickup(sizes: Sizes) -> Score:
    latencies = drain_bench.pickup(sizes.pickups, "process").latencies_ms
    p50, p99 = percentile(latencies, 0.5), percentile(latencies, 0.99)
    return Score(
        "4. idle pickup p50 / p99",
        f"{p50:.2f} / {p99:.2f} ms",
        "<= 2.5 / 5 ms",
        verdict(p50 <= 2.5 and p99 <= 5),
    )


def aim_fanout(sizes: Sizes) -> list[Score]:
    one_rate, one_cpu = publish_rate(1, sizes.publishes)
    ten_rate, ten_cpu = publish_rate(10, sizes.publishes)
    if one_cpu is None or ten_cpu is None:
        cost = Score(
            "5. publish to 10 subscriptions vs 1 (PostgreSQL CPU)",
            f"n/a (server not local); wall {one_rate / ten_rate:.2f}x",
            "<= 2x",
            "skipped",
        )
    else:
        cost = Score(
            "5. publish to 10 subscriptions vs 1 (PostgreSQL CPU)",
            f"{ten_cpu / one_cpu:.2f}x ({ten_cpu:.3f} vs {one_cpu:.3f} ms; "
            f"wall {one_rate / ten_rate:.2f}x)",
            "<= 2x",
            verdict(ten_cpu <= 2 * one_cpu),
        )
    single = drained(sizes, 8).rate
    fanned = drained(sizes, 8, fanout=10).rate
    return [
        cost,
        Score(
            "5. drain 10 subscriptions vs 1 (deliveries/s)",
            f"{fanned / single:.2f}x ({fanned:,.0f}/s vs {single:,.0f}/s)",
            ">= 1x",
            verdict(fanned >= single),
        ),
    ]


def aim_backlog(sizes: Sizes) -> list[Score]:
    first = sizes.backlog_drained
    shallow = drained(
        sizes, 8, messages=first, backlog=first, publish_sample=sizes.backlog_publishes
    )
    deep = drained(
        sizes, 8, messages=first, backlog=sizes.backlog, publish_sample=sizes.backlog_publishes
    )
    depth = f"{sizes.backlog:,} vs {first:,}"
    return [
        Score(
            f"6. drain behind {depth} backlog",
            f"{deep.rate / shallow.rate:.2f}x ({deep.rate:,.0f}/s vs {shallow.rate:,.0f}/s)",
            ">= 0.8x",
            verdict(deep.rate >= 0.8 * shallow.rate),
        ),
        Score(
            f"6. publish onto {depth} backlog",
            f"{deep.publish_rate / shallow.publish_rate:.2f}x "
            f"({deep.publish_rate:,.0f}/s vs {shallow.publish_rate:,.0f}/s)",
            ">= 0.8x",
            verdict(deep.publish_rate >= 0.8 * shallow.publish_rate),
        ),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--celery",
        metavar="PYTHON",
        help="the Python of a virtualenv with celery[redis] (see bench/peers/celery_redis.py)",
    )
    parser.add_argument("--quick", action="store_true", help="every step small: a smoke run")
    parser.add_argument(
        "--backlog", type=int, help="pending deliveries for aim 6 (default 1,000,000)"
    )
    parser.add_argument(
        "--aims",
        type=int,
        nargs="+",
        choices=range(1, 8),
        default=list(range(1, 8)),
        help="run only these aims (default: all)",
    )
    args = parser.parse_args()
    if args.celery and not os.access(args.celery, os.X_OK):
        parser.error(f"--celery {args.celery}: not an executable Python")
    sizes = QUICK if args.quick else FULL
    if args.backlog is not None:
        if args.backlog < sizes.backlog_drained:
            parser.error(f"--backlog must be at least {sizes.backlog_drained:,}")
        sizes = Sizes(**{**sizes.__dict__, "backlog": args.backlog})
    User = get_user_model()
    User._default_manager.get_or_create(**{User.USERNAME_FIELD: get_settings().SYSTEM_USER})
    print(f"database: {get_driver().vendor_label}, durability defaults", flush=True)
    steps = {
        1: lambda: aim_publish(sizes, args.celery),
        2: lambda: aim_batches(sizes),
        3: lambda: aim_drain(sizes),
        4: lambda: [aim_pickup(sizes)],
        5: lambda: aim_fanout(sizes),
        6: lambda: aim_backlog(sizes),
        7: lambda: [
            Score("7. steady state over an hour", "bench/steady.py --minutes 60", "flat", "not run")
        ],
    }
    scores = [score for aim in sorted(set(args.aims)) for score in steps[aim]()]
    width = max(len(s.aim) for s in scores)
    measured = max(len(s.measured) for s in scores)
    for score in scores:
        print(
            f"{score.aim:<{width}}  {score.measured:<{measured}}  {score.target:<14}  "
            f"{score.verdict}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
