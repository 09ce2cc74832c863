"""A small pool of daemon worker threads that tidy up after themselves.

Used instead of ``concurrent.futures.ThreadPoolExecutor`` for two reasons: its threads are
joined at interpreter exit, so a handler that ignores its abort signal would keep a drained
process alive past its termination grace period; and it offers no hook when a thread ends, so
the thread's database connections would be left for the garbage collector. Here each thread
closes its connections as it exits.

A pool starts ``started`` threads at once and the rest of its ``size`` only when a task finds
none idle, as ThreadPoolExecutor does; a thread once started stays until the pool shuts down.
A consumer's pools are sized for its busiest moment (twice the concurrency for handlers, two
for heartbeats, two for settles off the handlers' threads), which most subscriptions never reach:
started whole, a host of 50 subscriptions at concurrency 8 ran 1,000 threads, most of them
never used. The handler threads a subscription's concurrency calls for are started with it all
the same: a thread start hands the GIL over both ways, which costs a claim loop far more among
busy threads than at start-up.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from workqueue.driver import close_all_thread_connections

logger = logging.getLogger(__name__)

_Task = tuple[Callable[..., Any], tuple[Any, ...], Future | None]


class _MustRun:
    """A task queued by ``run_or_call``: work that must happen whether or not a worker thread
    has taken it when the pool shuts down. Dropped, a hand-back would leave its delivery leased
    until the lease expired, and the expiry counts the attempt the hand-back refunds: a delivery
    claimed ahead on its last attempt would be dead-lettered without its handler ever running."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


class WorkerPool:
    def __init__(self, size: int, name: str, *, started: int = 0) -> None:
        self._queue: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._size, self._name = size, name
        self._threads: list[threading.Thread] = []
        # One permit per thread on its way to take a task that nobody has claimed for it (one
        # just started, or one back from its last task): a task that takes a permit has a
        # thread coming for it; one that finds none starts a thread.
        self._idle = threading.Semaphore(0)
        with self._lock:
            try:
                for _ in range(min(started, size)):
                    self._start_thread()
                    self._idle.release()
            except BaseException:
                # The system refused a thread (a process at its thread limit): those started
                # would otherwise wait for work forever, as many again at each retry.
                for _ in self._threads:
                    self._queue.put(None)
                raise

    def runs_on_current_thread(self) -> bool:
        return threading.current_thread() in self._threads

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on a worker; raises RuntimeError once the pool is shut down."""
        future: Future = Future()
        self._put((fn, args, future))
        return future

    def run(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on a worker when nobody waits for its result (a Future costs a
        lock and a condition, per delivery); what it raises is logged. Raises RuntimeError
        once the pool is shut down."""
        self._put((fn, args, None))

    def _put(self, task: _Task) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the worker pool is shut down")
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._size:
                try:
                    self._start_thread()
                except RuntimeError:
                    # The system refused a thread: the task waits for one of the pool's
                    # threads to be free, or, with none at all, the caller hears it (as from a
                    # shut-down pool) and no task is left behind for a thread started later.
                    if not self._threads:
                        raise
            self._queue.put(task)

    def _start_thread(self) -> None:
        thread = threading.Thread(
            target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True
        )
        # Listed before it starts: a started thread may take a queued task at once, and
        # runs_on_current_thread must already know it as the pool's.
        self._threads.append(thread)
        try:
            thread.start()
        except BaseException:
            self._threads.remove(thread)
            raise

    def run_or_call(self, fn: Callable[..., Any], *args: Any) -> None:
        """``run``, or once the pool is shut down ``fn(*args)`` on the calling thread: for work
        that must happen either way (a settle, a hand-back), rather than never. Still queued
        when the pool shuts down, it is left to the pool's threads, which end after it."""
        try:
            self._put((_MustRun(fn), args, None))
        except RuntimeError:
            fn(*args)

    def shutdown(self) -> None:
        """Stop taking work; tasks not yet started are cancelled, except ``run_or_call``'s,
        which the threads still run before they end; running ones finish. Returns at once: the
        threads do not block a drain, nor interpreter exit (work left then is lost with the
        process, as a running handler is). Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            kept: list[_Task] = []
            while True:
                try:
                    task = self._queue.get_nowait()
                except queue.Empty:
                    break
                if task is None:
                    continue
                if task[2] is not None:
                    task[2].cancel()
                elif isinstance(task[0], _MustRun):
                    kept.append(task)
            # Ahead of the threads' stop marks, so each thread takes them first. Not run on
            # this thread: a pool whose threads are all busy usually waits on a slow or lost
            # database, and a consumer's stop must not wait on it past its drain time.
            for task in kept:
                self._queue.put(task)
            for _ in self._threads:
                self._queue.put(None)

    def _run(self) -> None:
        try:
            while True:
                task = self._queue.get()
                if task is None:
                    return
                self._execute(*task)
                # Not kept while the thread waits for its next task: the arguments are often a
                # delivery's execution, with its payload.
                task = None
                self._idle.release()
        finally:
            close_all_thread_connections()

    @staticmethod
    def _execute(fn: Callable[..., Any], args: tuple[Any, ...], future: Future | None) -> None:
        if future is None:
            try:
                fn(*args)
            except BaseException:
                logger.exception("A task on a worker thread failed")
        elif future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # the caller reads it from the future
                future.set_exception(exc)
