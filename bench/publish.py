"""Publish benchmark: one message at a time, and ``publish_many`` in batches.

Usage (against the embedded PostgreSQL, or DATABASE_URL on this machine):
    PYTHONPATH=. .venv/bin/python bench/publish.py --messages 5000 --batch 100

Each run publishes small payloads (``--payload-bytes N``: order-like ones of about N bytes) to
a fresh topic with one subscription (``--subscriptions`` for fan-out) and reports messages per
second and the CPU time the publishing connection's PostgreSQL backend spent per message (user
+ system, read from /proc/<pid>/stat of that backend, so the server must run on this machine;
"n/a" otherwise), and this process's own CPU time per message (validation, serialisation,
psycopg). Durability settings are the server's (the embedded one keeps fsync and
synchronous_commit on).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import time
import uuid

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
os.environ.setdefault("WORKQUEUE_LOCALDB", "1")
os.environ.setdefault("DJANGO_SECRET_KEY", secrets.token_urlsafe(50))

import django

django.setup()

from django.contrib.auth import get_user_model  # noqa: E402

from bench.proc_cpu import backend_cpu_seconds  # noqa: E402
from workqueue import publish, publish_many  # noqa: E402
from workqueue.conf import get_settings  # noqa: E402
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
    topic: Topic, messages: int, batch: int, size: int = 0
) -> tuple[float, float | None, float]:
    """(messages per second, backend CPU ms per message, this process's CPU ms per message)
    for one run."""
    driver = get_driver()
    [(pid,)] = driver.execute("SELECT pg_backend_pid()", [])
    name = topic.name
    cpu_before = backend_cpu_seconds(pid)
    own_before = time.process_time()
    began = time.perf_counter()
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
    elapsed = time.perf_counter() - began
    own = time.process_time() - own_before
    cpu_after = backend_cpu_seconds(pid)
    [(same_pid,)] = driver.execute("SELECT pg_backend_pid()", [])
    assert same_pid == pid, "the publishing connection changed during the run"
    cpu = None if cpu_before is None or cpu_after is None else (cpu_after - cpu_before)
    return messages / elapsed, None if cpu is None else cpu * 1000 / messages, own * 1000 / messages


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=5_000)
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 100])
    parser.add_argument("--subscriptions", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument(
        "--payload-bytes",
        type=int,
        default=0,
        help="publish order-like payloads of about this many bytes of JSON (default: {'n': n})",
    )
    args = parser.parse_args()
    User = get_user_model()
    User._default_manager.get_or_create(**{User.USERNAME_FIELD: get_settings().SYSTEM_USER})
    print(f"database: {get_driver().vendor_label}, durability defaults")
    topic = make_topic(args.subscriptions)
    try:
        if args.warmup:
            run(topic, args.warmup, 1)
        for batch in args.batch:
            rate, cpu, own = run(topic, args.messages, batch, args.payload_bytes)
            shape = "one at a time" if batch == 1 else f"publish_many of {batch}"
            cpu_text = "n/a" if cpu is None else f"{cpu:.3f} ms"
            size = f" of ~{args.payload_bytes} bytes" if args.payload_bytes else ""
            print(
                f"publish {args.messages} messages{size}, {shape}, {args.subscriptions} "
                f"subscription(s): {rate:,.0f} messages/s, PostgreSQL CPU {cpu_text} and "
                f"Python {own:.3f} ms per message"
            )
    finally:
        get_driver().remove_topic(str(topic.id))
    return 0


if __name__ == "__main__":
    sys.exit(main())
