"""Claim cost on a partitioned subscription as one hot key's blocked backlog grows.

Usage (against the embedded PostgreSQL, or DATABASE_URL):
    PYTHONPATH=. .venv/bin/python bench/hot_key.py --backlog 1 1000 50000 --mode Ordered Exclusive

For each backlog size: publish that many messages on key "hot", claim its head (so the rest of
the key is blocked behind a delivery in flight), publish one message on each of 400 other keys,
then time claims of 8 (each claimed delivery is completed at once). The claim should cost the
same whatever the hot key's backlog.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid

from bench.django_setup import prepare_database, start_django

start_django()

from workqueue import publish_many  # noqa: E402
from workqueue.driver import get_driver  # noqa: E402
from workqueue.models import Subscription, Topic, Transport  # noqa: E402
from workqueue.transport import Receiver  # noqa: E402

OTHER_KEYS = 400
CLAIMS = 20


def claim_cost_ms(mode: str, backlog: int) -> list[float]:
    """Durations of CLAIMS claims of 8 with ``backlog`` rows of the hot key behind its head."""
    tag = uuid.uuid4().hex[:6]
    topic = Topic.objects.create(
        name=f"bench.hot-{tag}", transport=Transport.objects.get(name="Database")
    )
    subscription = Subscription.objects.create(
        topic=topic, name=f"bench.hot-{tag}-sub", handler_key="bench", partition_mode=mode
    )
    try:
        for offset in range(0, backlog, 1000):
            count = min(1000, backlog - offset)
            publish_many(topic.name, [{"payload": {}, "partition_key": "hot"}] * count)
        receiver = Receiver(subscription.id)
        assert len(receiver.receive(1).deliveries) == 1, "the hot key's head"
        publish_many(
            topic.name, [{"payload": {}, "partition_key": f"k{n}"} for n in range(OTHER_KEYS)]
        )
        durations = []
        for _ in range(CLAIMS):
            began = time.perf_counter()
            claimed = receiver.receive(8).deliveries
            durations.append((time.perf_counter() - began) * 1000)
            assert claimed and all(d.partition_key != "hot" for d in claimed), claimed
            receiver.complete_many(claimed)
        return durations
    finally:
        get_driver().remove_topic(str(topic.id))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backlog", type=int, nargs="*", default=[1, 1000, 50_000])
    parser.add_argument("--mode", nargs="*", default=["Ordered", "Exclusive"])
    args = parser.parse_args()
    prepare_database()
    print(f"database: {get_driver().vendor_label}")
    claim_cost_ms(args.mode[0], 1)  # warm the connection and the procedures' plans
    for mode in args.mode:
        for backlog in args.backlog:
            ms = claim_cost_ms(mode, backlog)
            print(
                f"{mode} hot key backlog {backlog}: claim of 8 median "
                f"{statistics.median(ms):.2f} ms, max {max(ms):.2f} ms"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
