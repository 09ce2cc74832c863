"""Peer benchmark: procrastinate drains N no-op jobs with one worker process.

Run it side by side with bench/drain.py, against a scratch database on the same server, from a
separate virtualenv that has procrastinate (it is not a dependency of this project):

    python -m venv /tmp/peers && /tmp/peers/bin/pip install procrastinate==3.10.0
    createdb peers_bench   # or: psql ... -c 'CREATE DATABASE peers_bench'
    DATABASE_URL=postgres://USER@HOST:PORT/peers_bench \\
        /tmp/peers/bin/python bench/peers/procrastinate_drain.py --jobs 10000 --concurrency 1 8
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import procrastinate

app = procrastinate.App(
    connector=procrastinate.PsycopgConnector(conninfo=os.environ["DATABASE_URL"])
)


@app.task(queue="bench")
def noop(n: int) -> None:
    return None


async def drain(jobs: int, concurrency: int) -> float:
    async with app.open_async():
        for offset in range(0, jobs, 1000):
            await noop.batch_defer_async(
                *({"n": n} for n in range(offset, min(offset + 1000, jobs)))
            )
        began = time.perf_counter()
        await app.run_worker_async(queues=["bench"], wait=False, concurrency=concurrency)
        return jobs / (time.perf_counter() - began)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--apply-schema", action="store_true")
    args = parser.parse_args()
    if args.apply_schema:
        async with app.open_async():
            await app.schema_manager.apply_schema_async()
    for concurrency in args.concurrency:
        rate = await drain(args.jobs, concurrency)
        print(
            f"procrastinate drain {args.jobs} no-op jobs, concurrency {concurrency}: {rate:,.0f}/s"
        )


if __name__ == "__main__":
    asyncio.run(main())
