"""The worker pool's fire-and-forget ``run``: what a claim loop hands each delivery to."""

from __future__ import annotations

import logging
import threading

import pytest

from workqueue.runtime.workers import WorkerPool


@pytest.fixture
def pool():
    pool = WorkerPool(1, "test-pool")
    yield pool
    pool.shutdown()


def test_a_failing_task_is_logged_and_the_thread_runs_the_next(pool, caplog):
    done = threading.Event()

    def fail() -> None:
        raise ValueError("boom")

    with caplog.at_level(logging.ERROR, logger="workqueue.runtime.workers"):
        pool.run(fail)
        pool.run(done.set)
        assert done.wait(5), "the worker thread died with the failing task"

    [record] = caplog.records
    assert record.exc_info[0] is ValueError


def test_tasks_not_started_at_shutdown_are_dropped_and_later_ones_refused():
    pool = WorkerPool(1, "test-pool")
    release = threading.Event()
    ran: list[str] = []
    pool.run(release.wait, 5)
    pool.run(ran.append, "queued")

    pool.shutdown()
    release.set()

    with pytest.raises(RuntimeError, match="shut down"):
        pool.run(ran.append, "late")
    pool._threads[0].join(5)
    assert ran == []
