"""Tasks API tasks for the tests (module level, as the API requires). The host processes import
them by path (``tests.task_functions.<name>``), like any project's tasks module."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from django.contrib.auth import get_user_model
from django.db import transaction

from workqueue.tasks.api import TaskContext, task


@task()
def add(x: int, y: int) -> int:
    return x + y


@task()
def always_fails(text: str) -> None:
    raise ValueError(text)


@task(takes_context=True)
def fails_on_first_attempt(context: TaskContext) -> int:
    if context.attempt < 2:
        raise RuntimeError(f"attempt {context.attempt} fails")
    return context.attempt


@task()
async def multiply_later(x: int, y: int) -> int:
    await asyncio.sleep(0.01)
    return x * y


@task(takes_context=True)
def describe_context(context: TaskContext, label: str) -> dict[str, Any]:
    return {
        "label": label,
        "attempt": context.attempt,
        "result_id": context.task_result.id,
        "status": str(context.task_result.status),
        "args": context.task_result.args,
    }


@task()
def user_exists(username: str) -> bool:
    return get_user_model().objects.filter(username=username).exists()


@task()
def returns_a_tuple() -> tuple[int, int]:
    return (1, 2)


@task()
def echo(value: Any) -> Any:
    return value


@task()
def commits_durably(username: str) -> None:
    with transaction.atomic(durable=True):
        get_user_model().objects.create(username=username)


#: Each run of the tasks below that have side effects, by label (an e-mail sent, an API called).
RUNS: list[str] = []


@task()
def returns_unstorable_text(label: str) -> str:
    RUNS.append(label)
    return "abc\x00def"  # round-trips through JSON; jsonb cannot store it


@task()
def fails_with_unstorable_text(padding: int) -> None:
    # NUL and a lone surrogate (a file name that is not UTF-8), then a long tail.
    raise ValueError(
        "bad\x00input caf" + b"\xe9".decode("utf-8", "surrogateescape") + "x" * padding
    )


@task()
def renamed_after_enqueue() -> None:
    """A test removes this attribute once the task is enqueued (a deploy that renamed it)."""


@task()
def returns_more_than_jsonb_holds(label: str) -> str:
    RUNS.append(label)
    return "x" * (256 * 1024 * 1024)  # one byte past the longest string jsonb stores


@task()
def returns_itself(label: str) -> list[Any]:
    RUNS.append(label)
    value: list[Any] = []
    value.append(value)
    return value


@task()
def creates_a_user_then_a_commit_callback_raises(username: str) -> str:
    get_user_model().objects.create(username=username)

    def callback() -> None:
        raise RuntimeError("the on_commit callback failed")

    transaction.on_commit(callback)
    return "done"


#: ``first_run_fails_when_released``: set by its first run once it runs; it then waits for
#: RELEASE_FIRST_RUN and fails.
FIRST_RUN_STARTED = threading.Event()
RELEASE_FIRST_RUN = threading.Event()


@task()
def first_run_fails_when_released() -> str:
    RUNS.append("run")
    if len(RUNS) == 1:
        FIRST_RUN_STARTED.set()
        RELEASE_FIRST_RUN.wait(20)
        raise ValueError("the first run failed after another run took its delivery over")
    return "ok"


@task()
def enqueues_a_follow_up(n: int) -> int:
    """Enqueues ``add(n, 1)``: a task chaining another."""
    add.enqueue(n, 1)
    return n


@task()
def makes_a_user_then_enqueues_its_check(username: str, then_fail: bool = False) -> None:
    """Creates ``username``, enqueues ``user_exists(username)``, then works on a while (or
    fails): a follow-up that ran before this committed would not find the user."""
    get_user_model().objects.create(username=username)
    user_exists.enqueue(username)
    time.sleep(1)
    if then_fail:
        raise ValueError("failed after enqueueing its follow-up")


@task()
def returns_a_set() -> set[int]:
    return {1, 2}


#: Set while ``enqueues_when_told`` waits to enqueue; set ``ENQUEUE_NOW`` to let it go on.
WAITING_TO_ENQUEUE = threading.Event()
ENQUEUE_NOW = threading.Event()
ENQUEUE_REFUSALS: list[str] = []


@task()
def enqueues_when_told(username: str) -> str:
    """Makes a user, waits for ``ENQUEUE_NOW``, then enqueues a follow-up as best effort: a
    refused enqueue is noted in ``ENQUEUE_REFUSALS`` and the task goes on."""
    get_user_model().objects.create(username=username)
    WAITING_TO_ENQUEUE.set()
    ENQUEUE_NOW.wait(30)
    try:
        user_exists.enqueue(username)
    except Exception as refused:  # what a best-effort caller does
        ENQUEUE_REFUSALS.append(f"{type(refused).__name__}: {refused}")
    return get_user_model().objects.get(username=username).username
