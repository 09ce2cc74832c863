"""Peer benchmark: procrastinate enqueues N no-op jobs, one at a time and in batches.

The counterpart of bench/publish.py, run the same way as bench/peers/procrastinate_drain.py (a
separate virtualenv with procrastinate, a scratch database on the same server):

    DATABASE_URL=postgres://USER@HOST:PORT/peers_bench \\
        /tmp/peers/bin/python bench/peers/procrastinate_publish.py --jobs 5000 --batch 1 100

One job at a time is ``defer`` (its own transaction, like a ``publish``); a batch is one
``batch_defer`` call (like ``publish_many``). The jobs are deleted afterwards.
"""

from __future__ import annotations

import argparse
import os
import time

import procrastinate

app = procrastinate.App(
    connector=procrastinate.SyncPsycopgConnector(conninfo=os.environ["DATABASE_URL"])
)


@app.task(queue="bench_publish")
def noop(n: int) -> None:
    return None


def enqueue(jobs: int, batch: int) -> float:
    began = time.perf_counter()
    if batch == 1:
        for n in range(jobs):
            noop.defer(n=n)
    else:
        for offset in range(0, jobs, batch):
            noop.batch_defer(*({"n": n} for n in range(offset, min(offset + batch, jobs))))
    return jobs / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=5_000)
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 100])
    parser.add_argument("--apply-schema", action="store_true")
    args = parser.parse_args()
    with app.open():
        if args.apply_schema:
            app.schema_manager.apply_schema()
        for batch in args.batch:
            rate = enqueue(args.jobs, batch)
            how = "one at a time" if batch == 1 else f"batch_defer of {batch}"
            print(f"procrastinate enqueue {args.jobs} no-op jobs, {how}: {rate:,.0f}/s")
            app.connector.execute_query(
                "DELETE FROM procrastinate_jobs WHERE queue_name = %(queue)s",
                queue="bench_publish",
            )


if __name__ == "__main__":
    main()
