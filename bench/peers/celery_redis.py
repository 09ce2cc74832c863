"""Peer benchmark: Celery on Redis enqueues N no-op tasks one at a time; one worker drains them.

The counterpart of bench/publish.py (one at a time) and bench/drain.py, run from its own
virtualenv with a local Redis (``apt-get install redis-server``; the script starts its own
server on a spare port with Redis's default persistence, snapshots only, so an acknowledged
task can still be lost, unlike a committed publish):

    python3 -m venv /tmp/peers-celery && /tmp/peers-celery/bin/pip install "celery[redis]"
    PYTHONPATH=. /tmp/peers-celery/bin/python bench/peers/celery_redis.py --tasks 10000 \\
        --pool solo threads --concurrency 1 8

``--appendfsync always`` runs Redis with an fsync per write instead, the closest it comes to a
committed publish. Each task counts itself in Redis; the drain rate runs from the first task's
start to the last one's end (the worker's own start-up is left out, which favours Celery a
little: bench/drain.py times its host from start).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

import celery
import redis
from celery import Celery

REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6390/0")

app = Celery("bench_celery", broker=REDIS_URL)
app.conf.update(
    task_ignore_result=True,
    worker_prefetch_multiplier=4,  # Celery's default
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)
ledger = redis.Redis.from_url(REDIS_URL)


@app.task(name="bench.noop")
def noop(n: int, total: int) -> None:
    done = ledger.incr("bench:done")
    if done == 1:
        ledger.set("bench:first", time.time())
    if done == total:
        ledger.set("bench:last", time.time())


def start_redis(port: int, appendfsync: str | None, workdir: str) -> subprocess.Popen:
    command = ["redis-server", "--port", str(port), "--dir", workdir, "--daemonize", "no"]
    if appendfsync:
        command += ["--appendonly", "yes", "--appendfsync", appendfsync]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"redis-server could not start on port {port} (one left running?)")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return server
        except OSError:
            time.sleep(0.05)
    server.kill()
    raise SystemExit(f"redis-server did not start on port {port}")


def enqueue(tasks: int) -> float:
    began = time.perf_counter()
    for n in range(tasks):
        noop.delay(n, tasks)
    return tasks / (time.perf_counter() - began)


def enqueue_blocks() -> None:
    """Serve bench/aims.py, which alternates blocks of Celery's enqueue with blocks of its own
    publishes so that both meet the same moments of a shared machine: each line read is a
    number of tasks to enqueue one at a time, each line written the seconds that took."""
    print("ready", flush=True)
    for line in sys.stdin:
        began = time.perf_counter()
        for n in range(int(line)):
            noop.delay(n, 0)
        print(f"{time.perf_counter() - began:.6f}", flush=True)


def drain(tasks: int, pool: str, concurrency: int) -> float:
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "bench.peers.celery_redis",
            "worker",
            "--pool",
            pool,
            "--concurrency",
            str(concurrency),
            "--loglevel",
            "WARNING",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ],
        # C_FORCE_ROOT: Celery refuses to run its worker as root (as on this build machine).
        env={**os.environ, "BENCH_REDIS_URL": REDIS_URL, "C_FORCE_ROOT": "1"},
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 600
        while ledger.get("bench:last") is None:
            if time.monotonic() > deadline or worker.poll() is not None:
                raise SystemExit("the Celery worker did not finish the backlog")
            time.sleep(0.05)
    finally:
        worker.terminate()
        worker.wait(30)
    first, last = float(ledger.get("bench:first")), float(ledger.get("bench:last"))
    return tasks / (last - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--pool", nargs="*", default=["solo"])
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1])
    parser.add_argument("--appendfsync", choices=["always", "everysec"], default=None)
    parser.add_argument(
        "--enqueue-only",
        action="store_true",
        help="time the enqueue only (the README's table of peers)",
    )
    parser.add_argument(
        "--enqueue-blocks",
        action="store_true",
        help="enqueue blocks of tasks as standard input asks, each timed (bench/aims.py)",
    )
    args = parser.parse_args()
    port = int(REDIS_URL.rsplit(":", 1)[1].split("/")[0])
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as workdir:
        server = start_redis(port, args.appendfsync, workdir)
        persistence = f"appendfsync {args.appendfsync}" if args.appendfsync else "snapshots only"
        print(f"Celery {celery.__version__} on Redis ({persistence})")
        try:
            if args.enqueue_blocks:
                ledger.flushdb()
                enqueue_blocks()
                return
            if args.enqueue_only:
                ledger.flushdb()
                rate = enqueue(args.tasks)
                print(f"celery enqueue {args.tasks} no-op tasks, one at a time: {rate:,.0f}/s")
                return
            for pool in args.pool:
                for concurrency in [1] if pool == "solo" else args.concurrency:
                    ledger.flushdb()
                    rate = enqueue(args.tasks)
                    print(f"celery enqueue {args.tasks} no-op tasks, one at a time: {rate:,.0f}/s")
                    rate = drain(args.tasks, pool, concurrency)
                    print(
                        f"celery drain {args.tasks} no-op tasks, pool {pool}, "
                        f"concurrency {concurrency}: {rate:,.0f}/s"
                    )
        finally:
            server.terminate()
            server.wait(10)


if __name__ == "__main__":
    main()
