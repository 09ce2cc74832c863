"""Publish benchmark: one message at a time, and ``publish_many`` in batches.

Usage (against the embedded PostgreSQL, or DATABASE_URL on this machine):
    PYTHONPATH=. .venv/bin/python bench/publish.py --messages 5000 --batch 100
    PYTHONPATH=. .venv/bin/python bench/publish.py --messages 5000 --batch 1 --publishers 1 4 8

Each run publishes small payloads (``--payload-bytes N``: order-like ones of about N bytes) to
a fresh topic with one subscription (``--subscriptions`` for fan-out) and reports messages per
second and the CPU time the publishing connection's PostgreSQL backend spent per message (user
+ system, read from /proc/<pid>/stat of that backend, so the server must run on this machine;
"n/a" otherwise), and this process's own CPU time per message (validation, serialisation,
psycopg). Durability settings are the server's (the embedded one keeps fsync and
synchronous_commit on).

With ``--publishers N`` the messages are shared among N threads publishing at once, each on its
own connection; the PostgreSQL CPU is then that of all N backends, per message.

``--wakeups N`` also times how soon a host in another process would hear of a publish: a session
LISTENs on the topic's channel, as a host's wake-up thread does, and N publishes 10 ms apart are
each timed from ``publish`` returning to their notification's arrival (p50 and p99).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from bench.django_setup import prepare_database, start_django

start_django()

from bench.percentiles import percentile  # noqa: E402
from bench.proc_cpu import backend_cpu_seconds  # noqa: E402
from workqueue import publish, publish_many  # noqa: E402
from workqueue.driver import get_driver  # noqa: E402
from workqueue.driver.base import canonical_json  # noqa: E402
from workqueue.models import Subscription, Topic, Transport  # noqa: E402


def make_topic(subscriptions: int) -> Topic:
    topic = Topic.objects.create(
        name=f"bench.publish-{uuid.uuid4().hex[:6]}",
        transport=Transport.objects.get(name="Database"),
    )
    for n in range(subscriptions):
        Subscription.objects.create(topic=topic, name=f"{topic.name}-sub{n}", handler_key="bench")
    return topic


def payload_of(n: int, size: int) -> dict:
    """``{"n": n}``, or with ``size`` an order-like payload of about that many bytes of JSON."""
    if not size:
        return {"n": n}
    line = {"sku": "SKU-00000", "quantity": 1, "unit_price": "12.50", "note": "gift wrap"}
    lines = max(1, size // (len(canonical_json(line)) + 1))
    return {"n": n, "customer": "c-42", "lines": [line] * lines}


def run(
    topic: Topic, messages: int, batch: int, size: int = 0, publishers: int = 1
) -> tuple[float, float | None, float]:
    """(messages per second, backend CPU ms per message, this process's CPU ms per message)
    for one run: ``publishers`` threads, each on its own connection, publishing its share."""
    shares = [messages // publishers + (n < messages % publishers) for n in range(publishers)]
    start = threading.Barrier(publishers + 1, timeout=60)
    with ThreadPoolExecutor(publishers) as pool:
        futures = [
            pool.submit(_publish_share, topic.name, share, batch, size, start) for share in shares
        ]
        own_before = time.process_time()
        try:
            start.wait()
        except threading.BrokenBarrierError:
            for future in futures:
                future.result()  # the publisher's own error, when one failed before the start
            raise
        began = time.perf_counter()
        backend_cpu = [future.result() for future in futures]  # re-raises a publisher's error
        elapsed = time.perf_counter() - began
        own = time.process_time() - own_before
    cpu = None if None in backend_cpu else sum(backend_cpu)
    return messages / elapsed, None if cpu is None else cpu * 1000 / messages, own * 1000 / messages


def _publish_share(
    name: str, messages: int, batch: int, size: int, start: threading.Barrier
) -> float | None:
    """Publish ``messages`` on this thread's connection once every publisher is ready; return
    the CPU seconds its PostgreSQL backend spent meanwhile (None when the server is remote)."""
    driver = get_driver()
    try:
        [(pid,)] = driver.execute("SELECT pg_backend_pid()", [])
        cpu_before = backend_cpu_seconds(pid)
    except BaseException:
        start.abort()  # the others stop waiting for this publisher
        raise
    start.wait()
    if batch == 1:
        for n in range(messages):
            assert publish(name, payload_of(n, size)).accepted
    else:
        for offset in range(0, messages, batch):
            results = publish_many(
                name,
                [
                    {"payload": payload_of(n, size)}
                    for n in range(offset, min(offset + batch, messages))
                ],
            )
            assert all(r.accepted for r in results)
    cpu_after = backend_cpu_seconds(pid)
    [(same_pid,)] = driver.execute("SELECT pg_backend_pid()", [])
    assert same_pid == pid, "the publishing connection changed during the run"
    driver.close()
    return None if cpu_before is None or cpu_after is None else cpu_after - cpu_before


def wakeups(topic: Topic, samples: int) -> list[float]:
    """Milliseconds from ``publish`` returning to its notification reaching a listening
    session (the driver's own listener, as a host's wake-up thread holds it), for ``samples``
    publishes 10 ms apart."""
    listener = get_driver().open_listener()
    latencies = []
    try:
        listener.listen(get_driver().topic_channel(str(topic.id)))
        for n in range(samples):
            assert publish(topic.name, payload_of(n, 0)).accepted
            returned = time.perf_counter()
            arrivals = listener.notifications(timeout=5)
            heard = next(arrivals, None)
            arrivals.close()
            assert heard is not None, "no notification within 5 s of a publish"
            latencies.append((time.perf_counter() - returned) * 1000)
            time.sleep(0.01)
    finally:
        listener.close()
    return latencies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=5_000)
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 100])
    parser.add_argument("--subscriptions", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument(
        "--publishers",
        type=int,
        nargs="*",
        default=[1],
        help="run each shape with this many publishing threads at once, each on its own "
        "connection (as a threaded web server's requests would; their commits share the "
        "WAL flushes)",
    )
    parser.add_argument(
        "--payload-bytes",
        type=int,
        default=0,
        help="publish order-like payloads of about this many bytes of JSON (default: {'n': n})",
    )
    parser.add_argument(
        "--wakeups",
        type=int,
        default=0,
        help="then time this many publishes from returning to their notification's arrival",
    )
    args = parser.parse_args()
    prepare_database()
    print(f"database: {get_driver().vendor_label}, durability defaults")
    topic = make_topic(args.subscriptions)
    try:
        if args.warmup:
            run(topic, args.warmup, 1)
        for batch, publishers in itertools.product(args.batch, args.publishers):
            rate, cpu, own = run(topic, args.messages, batch, args.payload_bytes, publishers)
            shape = "one at a time" if batch == 1 else f"publish_many of {batch}"
            if publishers > 1:
                shape += f", {publishers} publishers at once"
            cpu_text = "n/a" if cpu is None else f"{cpu:.3f} ms"
            size = f" of ~{args.payload_bytes} bytes" if args.payload_bytes else ""
            print(
                f"publish {args.messages} messages{size}, {shape}, {args.subscriptions} "
                f"subscription(s): {rate:,.0f} messages/s, PostgreSQL CPU {cpu_text} and "
                f"Python {own:.3f} ms per message"
            )
        if args.wakeups:
            heard = wakeups(topic, args.wakeups)
            print(
                f"notification after publish returned, {len(heard)} publishes 10 ms apart: "
                f"p50 {percentile(heard, 0.5):.2f} ms, p99 {percentile(heard, 0.99):.2f} ms"
            )
    finally:
        get_driver().remove_topic(str(topic.id))
    return 0


if __name__ == "__main__":
    sys.exit(main())
