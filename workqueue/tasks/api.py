"""The Tasks API this Django provides: ``django.tasks`` (Django 6.0+), else the ``django-tasks``
backport. The rest of ``workqueue.tasks`` imports the API from here, so one module decides."""

from __future__ import annotations

try:
    from django.tasks import base, default_task_backend, exceptions, signals, task, task_backends
    from django.tasks.backends.base import BaseTaskBackend

    #: Where a project imports the API from, for messages that show code to run.
    MODULE = "django.tasks"
except ImportError:
    from django_tasks import base, default_task_backend, exceptions, signals, task, task_backends
    from django_tasks.backends.base import BaseTaskBackend

    MODULE = "django_tasks"

Task = base.Task
TaskContext = base.TaskContext
TaskError = base.TaskError
TaskResult = base.TaskResult
TaskResultStatus = base.TaskResultStatus
# Django 6.0 renamed the backport's InvalidTaskError to InvalidTask.
InvalidTaskError: type[Exception] = (
    getattr(exceptions, "InvalidTask", None) or exceptions.InvalidTaskError
)
TaskResultDoesNotExist = exceptions.TaskResultDoesNotExist
task_enqueued = signals.task_enqueued
task_started = signals.task_started
task_finished = signals.task_finished

__all__ = [
    "MODULE",
    "BaseTaskBackend",
    "InvalidTaskError",
    "Task",
    "TaskContext",
    "TaskError",
    "TaskResult",
    "TaskResultDoesNotExist",
    "TaskResultStatus",
    "default_task_backend",
    "task",
    "task_backends",
    "task_enqueued",
    "task_finished",
    "task_started",
]
