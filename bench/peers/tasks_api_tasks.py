"""The task bench/peers/tasks_api.py enqueues on both backends."""

from __future__ import annotations

from django_tasks import task


@task(queue_name="bench")
def noop(n: int) -> int:
    return n
