"""A task's message names its task and the options it was enqueued with; the host loads the task
with those options. Most tasks are enqueued as decorated, and then load as the decorated task
itself, without a copy validated again on every run."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

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


@pytest.mark.parametrize(
    "options",
    [
        {"priority": 7},
        {"run_after": dt.datetime(2031, 1, 2, 3, 4, 5, tzinfo=dt.UTC)},
        {"priority": -3, "run_after": dt.datetime(2031, 6, 1, tzinfo=dt.UTC)},
    ],
    ids=["priority", "run_after", "both"],
)
def test_a_task_enqueued_with_other_options_loads_with_them(options):
    loaded = message(**options).load_task()

    assert loaded is not add and loaded.func is add.func
    assert loaded.priority == options.get("priority", add.priority)
    assert loaded.run_after == options.get("run_after")
    assert (loaded.queue_name, loaded.backend) == (add.queue_name, add.backend)
