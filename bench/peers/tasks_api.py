"""Django's Tasks API on two backends, side by side in one run: this queue's WorkQueueBackend and
django-tasks-db's DatabaseBackend, against the same PostgreSQL.

For each backend: enqueue N no-op tasks one at a time (``task.using(backend=...).enqueue()``),
then drain them with one worker process (``workqueue_work --once --max N`` at each concurrency;
``db_worker --batch``, which runs one task at a time), and report the enqueue rate and the drain
rate measured from the results' own start and finish times (so process start-up is not counted),
and the worker process's CPU per task (its start-up, measured by running it once more with
nothing to do, taken out; its database backend's CPU is not counted).

django-tasks-db is not a dependency of this project: run this from a virtualenv that has it:

    python3.11 -m venv /tmp/peers-dtdb
    /tmp/peers-dtdb/bin/pip install -r requirements.txt django-tasks-db==0.12.0
    PYTHONPATH=. /tmp/peers-dtdb/bin/python bench/peers/tasks_api.py --tasks 2000 --concurrency 1 8
"""

from __future__ import annotations

import argparse
import os
import resource
import secrets
import subprocess
import sys
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.peers.tasks_api_settings")
# The project's settings fail closed: a benchmark opts in to the embedded PostgreSQL when
# DATABASE_URL is unset, and signs nothing that outlives the run.
os.environ.setdefault("WORKQUEUE_LOCALDB", "1")
os.environ.setdefault("DJANGO_SECRET_KEY", secrets.token_urlsafe(50))

import django

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db.models import Max, Min  # noqa: E402
from django_tasks_db.models import DBTaskResult  # noqa: E402

from bench.peers.tasks_api_tasks import noop  # noqa: E402
from workqueue.models import Delivery, TaskResult  # noqa: E402

QUEUE = "bench"


def manage(*args: str) -> float:
    """Run a management command to its end; the CPU seconds (user + system) it spent."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    # Their per-task log lines are not part of the measurement.
    subprocess.run(
        [sys.executable, "manage.py", *args],
        check=True,
        env=os.environ.copy(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def cpu_per_task(worker: list[str], spent: float, count: int) -> float:
    """Milliseconds of the worker process's CPU per task, its start-up taken out: the same
    command run once more with nothing left to do, exiting at its first empty claim, costs the
    start-up and one claim. The worker's database backend is not counted."""
    return (spent - manage(*worker)) * 1000 / count


def enqueue(backend: str, count: int) -> tuple[float, list[str]]:
    """Enqueue ``count`` tasks one at a time; the rate and the result ids."""
    task = noop.using(backend=backend, queue_name=QUEUE)
    began = time.perf_counter()
    ids = [task.enqueue(n).id for n in range(count)]
    return count / (time.perf_counter() - began), ids


def drain_rate(started: object, finished: object, count: int) -> float:
    return count / (finished - started).total_seconds()  # type: ignore[operator]


def workqueue_round(count: int, concurrency: int) -> tuple[float, float, float]:
    noop.using(backend="default").get_backend().ensure_queue(QUEUE)
    # Whatever an earlier, interrupted run left waiting would be drained with this round's.
    manage("workqueue", "discard-pending", "-s", f"tasks.{QUEUE}", "--discard-reason", "bench")
    rate, ids = enqueue("default", count)
    worker = [
        "workqueue_work",
        "-s",
        f"tasks.{QUEUE}",
        "--once",
        "--max",
        str(count),
        "--concurrency",
        str(concurrency),
        # Exits once the queue is empty, as db_worker --batch does, rather than after 5 s of
        # polling it, which the start-up run below would count as start-up.
        "--idle-exit-ms",
        "0",
    ]
    spent = manage(*worker)
    done = Delivery.objects.filter(message_id__in=ids, status="Completed")
    assert done.count() == count, f"{done.count()} of {count} completed"
    first = TaskResult.objects.filter(pk__in=ids).aggregate(first=Min("started_at"))["first"]
    last = done.aggregate(last=Max("completed_at"))["last"]
    return rate, drain_rate(first, last, count), cpu_per_task(worker, spent, count)


def db_round(count: int) -> tuple[float, float, float]:
    DBTaskResult.objects.filter(status="READY").delete()  # an interrupted run's leftovers
    rate, ids = enqueue("db", count)
    worker = [
        "db_worker",
        "--backend",
        "db",
        "--queue-name",
        QUEUE,
        "--batch",
        "--interval",
        "0.1",
        "--no-startup-delay",
        "--no-reload",
    ]
    spent = manage(*worker)
    results = DBTaskResult.objects.filter(pk__in=ids)
    assert results.filter(status="SUCCESSFUL").count() == count
    span = results.aggregate(first=Min("started_at"), last=Max("finished_at"))
    return rate, drain_rate(span["first"], span["last"], count), cpu_per_task(worker, spent, count)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 8])
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    call_command("workqueue", "create-system-user", verbosity=0)
    rate, drained, cpu = db_round(args.tasks)
    print(
        f"django-tasks-db: enqueue {rate:,.0f}/s, drain (one db_worker) {drained:,.0f}/s, "
        f"worker CPU {cpu:.2f} ms a task"
    )
    for concurrency in args.concurrency:
        rate, drained, cpu = workqueue_round(args.tasks, concurrency)
        print(
            f"django-workqueue: enqueue {rate:,.0f}/s, drain (one host, concurrency "
            f"{concurrency}) {drained:,.0f}/s, worker CPU {cpu:.2f} ms a task"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
