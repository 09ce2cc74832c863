"""The worker pool's fire-and-forget ``run``: what a claim loop hands each delivery to."""

from __future__ import annotations

import logging
import threading

import pytest

from tests.support.waiting import wait_until
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


def test_work_that_must_happen_is_still_run_by_the_pools_threads_after_shutdown():
    """A settle or hand-back queued with ``run_or_call`` while every worker is busy is not
    dropped with the plain tasks when the pool shuts down (a consumer's stop): dropped, a
    delivery claimed ahead would stay leased until expiry counted its refunded attempt. Nor
    does the shutdown wait for it: the busy thread runs it once it is free, then ends."""
    pool = WorkerPool(1, "test-pool")
    release = threading.Event()
    ran: list[str] = []
    pool.run(release.wait, 30)  # the pool's one thread is busy
    pool.run_or_call(ran.append, "hand-back")
    pool.run(ran.append, "handler")

    pool.shutdown()  # returns while the thread is still busy
    assert ran == [] and pool._threads[0].is_alive()
    release.set()
    pool._threads[0].join(5)

    assert ran == ["hand-back"] and not pool._threads[0].is_alive()


def test_a_pool_starts_threads_only_for_tasks_that_find_none_idle_and_never_past_its_size():
    pool = WorkerPool(4, "test-pool")
    try:
        assert pool._threads == []  # none before any work
        for n in range(20):  # one task at a time: the first thread takes every one
            pool.submit(int, n).result(5)
            # A result is set just before its thread is back for the next task: wait for it
            # to be back, or the next task rightly finds no thread idle and starts one.
            wait_until(lambda: pool._idle._value == 1)
        assert len(pool._threads) == 1

        release = threading.Event()
        running = threading.Barrier(5)  # the four tasks below and this test
        blocked = [pool.submit(lambda: (running.wait(5), release.wait(5))) for _ in range(4)]
        running.wait(5)  # all four run at once: three more threads were started for them
        late = pool.submit(int, 7)
        assert len(pool._threads) == 4  # the fifth waits for one of the four
        assert not late.done()
        release.set()
        assert late.result(5) == 7
        for future in blocked:
            future.result(5)
    finally:
        pool.shutdown()


def test_a_task_never_waits_for_a_busy_thread_while_the_pool_is_below_its_size():
    # Rounds of tasks that can only finish together, on a pool whose idle threads came back
    # from earlier rounds of other sizes: each round must get one thread per task at once,
    # some idle and some new, never one queued behind another.
    pool = WorkerPool(6, "test-pool")
    try:
        for together in (2, 1, 4, 3, 6, 2, 5, 6, 1, 6):
            barrier = threading.Barrier(together)
            futures = [pool.submit(barrier.wait, 5) for _ in range(together)]
            for future in futures:
                future.result(10)  # a task queued behind a busy thread breaks the barrier
            assert len(pool._threads) <= 6
    finally:
        pool.shutdown()


def test_threads_started_with_the_pool_take_the_first_tasks_before_any_more_start():
    pool = WorkerPool(4, "test-pool", started=2)
    try:
        assert len(pool._threads) == 2
        release = threading.Event()
        running = threading.Barrier(3)  # the two tasks below and this test
        blocked = [pool.submit(lambda: (running.wait(5), release.wait(5))) for _ in range(2)]
        running.wait(5)
        assert len(pool._threads) == 2  # the two waiting threads took them

        third = threading.Barrier(2)
        extra = pool.submit(third.wait, 5)  # none idle: a third thread starts for it
        third.wait(5)
        assert len(pool._threads) == 3
        release.set()
        for future in [*blocked, extra]:
            future.result(5)
    finally:
        pool.shutdown()


def test_a_thread_the_system_refuses_leaves_the_task_to_the_pools_threads_or_to_the_caller(
    monkeypatch,
):
    pool = WorkerPool(2, "test-pool")
    try:
        monkeypatch.setattr(threading.Thread, "start", _refused)
        with pytest.raises(RuntimeError, match="can't start new thread"):
            pool.run(print, "never")  # no thread at all: the caller hears it, nothing queued
        assert pool._threads == [] and pool._queue.empty()
        monkeypatch.undo()

        release = threading.Event()
        busy = pool.submit(release.wait, 5)  # the one thread, busy
        monkeypatch.setattr(threading.Thread, "start", _refused)
        waiting = pool.submit(int, 3)  # no second thread: it waits for the first
        assert len(pool._threads) == 1
        release.set()
        assert waiting.result(5) == 3 and busy.result(5) is True
    finally:
        monkeypatch.undo()
        pool.shutdown()


def test_a_pool_refused_one_of_the_threads_it_starts_with_ends_those_it_started(monkeypatch):
    """The system refused the third of three threads a pool starts with: the pool's
    construction fails, and the two started end instead of waiting for work forever."""
    real_start = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        if thread.name == "test-pool-2":
            _refused(thread)
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        WorkerPool(3, "test-pool", started=3)
    wait_until(lambda: not [t for t in threading.enumerate() if t.name.startswith("test-pool-")])


def _refused(thread: threading.Thread) -> None:
    raise RuntimeError("can't start new thread")
