"""A task's message names its task and the options it was enqueued with; the host loads the task
with those options. Most tasks are enqueued as decorated, and then load as the decorated task
itself, without a copy validated again on every run."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.test import override_settings

from tests.task_functions import add
from workqueue.tasks.messages import TaskMessage


def message(**options: Any) -> TaskMessage:
    return TaskMessage(
        task_path="tests.task_functions.add",
        args=[1, 2],
        kwargs={},
        backend=options.pop("backend", add.backend),
        queue_name=options.pop("queue_name", add.queue_name),
        **options,
    )


def test_a_task_enqueued_as_decorated_loads_as_the_decorated_task():
    assert message().load_task() is add


# A second queue and a second backend for tasks to be enqueued on, so each option can differ.
TWO_QUEUES_TWO_BACKENDS = {
    alias: {"BACKEND": "workqueue.tasks.WorkQueueBackend", "QUEUES": ["default", "other"]}
    for alias in ("default", "second")
}


@pytest.mark.parametrize(
    "options",
    [
        {"priority": 7},
        {"run_after": dt.datetime(2031, 1, 2, 3, 4, 5, tzinfo=dt.UTC)},
        {"queue_name": "other"},
        {"backend": "second"},
        {"priority": -3, "run_after": dt.datetime(2031, 6, 1, tzinfo=dt.UTC)},
    ],
    ids=["priority", "run_after", "queue_name", "backend", "two"],
)
def test_a_task_enqueued_with_other_options_loads_with_them(options):
    with override_settings(TASKS=TWO_QUEUES_TWO_BACKENDS):
        loaded = message(**options).load_task()

    assert loaded is not add and loaded.func is add.func
    expected = {"priority": add.priority, "run_after": None, "queue_name": "default"}
    expected |= {"backend": "default"} | options
    assert {name: getattr(loaded, name) for name in expected} == expected
