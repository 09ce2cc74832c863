"""AWS transport benchmark on moto's standalone server: an EMULATOR figure, not AWS's.

Usage (the embedded PostgreSQL holds the topology and the deduplication ledger):
    PYTHONPATH=. .venv/bin/python bench/aws_emulator.py --messages 2000

Starts ``moto_server`` on 127.0.0.1 and a free port, provisions a topic and one subscription
on an AWS transport, publishes ``--messages`` one at a time and with ``publish_many`` (SNS
Publish and PublishBatch), then drains the queue through the transport's receiver (receive 10,
complete in batches: DeleteMessageBatch). Every call is real boto3 HTTP to the emulator, which
runs on this machine in Python: the figures say what the transport's own overhead allows here,
nothing about SNS or SQS latency or throughput.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")

from bench.django_setup import prepare_database, start_django

start_django()

from tests.support.aws import moto_server  # noqa: E402
from workqueue import publish, publish_many  # noqa: E402
from workqueue.models import Subscription, Topic, Transport  # noqa: E402
from workqueue.transports import transport_for  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=2_000)
    args = parser.parse_args()
    prepare_database()
    with moto_server() as endpoint:
        suffix = uuid.uuid4().hex[:8]
        transport = Transport.objects.create(
            name=f"bench-aws-{suffix}",
            driver_class="AWS",
            configuration=endpoint.configuration(f"bench{suffix}"),
        )
        topic = Topic.objects.create(name=f"bench.aws-{suffix}", transport=transport)
        subscription = Subscription.objects.create(
            topic=topic, name=f"bench.aws-{suffix}.drain", handler_key="bench.noop"
        )
        aws = transport_for("AWS")
        aws.provision(transport, dry_run=False)
        print("AWS transport on moto_server (an emulator on this machine, NOT AWS)")
        try:
            began = time.perf_counter()
            for n in range(args.messages):
                publish(topic, {"n": n})
            single = args.messages / (time.perf_counter() - began)
            print(f"publish {args.messages} one at a time (SNS Publish): {single:,.0f} messages/s")

            began = time.perf_counter()
            for start in range(0, args.messages, 100):
                publish_many(topic, [{"payload": {"n": n}} for n in range(start, start + 100)])
            batched = args.messages / (time.perf_counter() - began)
            print(
                f"publish {args.messages} with publish_many of 100 (SNS PublishBatch of 10): "
                f"{batched:,.0f} messages/s"
            )

            receiver = aws.receiver(str(subscription.id))
            drained = 0
            began = time.perf_counter()
            while drained < 2 * args.messages:
                found = receiver.receive(10).deliveries
                if not found:
                    break
                receiver.complete_many(found)
                drained += len(found)
            rate = drained / (time.perf_counter() - began)
            print(
                f"drain {drained} (receive 10, DeleteMessageBatch): {rate:,.0f} messages/s "
                "on one thread"
            )
        finally:
            subscription.delete()
            topic.delete()
            transport.delete()
    return 0


if __name__ == "__main__":
    sys.exit(main())
