"""A Django Tasks API task, run by ``manage.py workqueue_host`` through
``workqueue.tasks.WorkQueueBackend`` (the project's ``TASKS`` setting)."""

from __future__ import annotations

try:
    from django.tasks import task
except ImportError:  # Django < 6.0: the django-tasks backport
    from django_tasks import task


@task()
def greet(name: str) -> str:
    """Return a greeting; the host stores it as the task's result."""
    return f"Hello, {name}!"
