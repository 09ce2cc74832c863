"""Settings for bench/peers/tasks_api.py: the project's, plus django-tasks-db beside the queue."""

from __future__ import annotations

from project.settings import *  # noqa: F403
from project.settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "django_tasks_db"]
TASKS = {
    "default": {"BACKEND": "workqueue.tasks.WorkQueueBackend", "QUEUES": ["bench"]},
    "db": {"BACKEND": "django_tasks_db.DatabaseBackend", "QUEUES": ["bench"]},
}
