"""A small pool of daemon worker threads that tidy up after themselves.

Used instead of ``concurrent.futures.ThreadPoolExecutor`` for two reasons: its threads are
joined at interpreter exit, so a handler that ignores its abort signal would keep a drained
process alive past its termination grace period; and it offers no hook when a thread ends, so
the thread's database connections would be left for the garbage collector. Here each thread
closes its connections as it exits.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from django.db import connections

from workqueue.driver import close_thread_connections

logger = logging.getLogger(__name__)

_Task = tuple[Callable[..., Any], tuple[Any, ...], Future | None]


class WorkerPool:
    def __init__(self, size: int, name: str) -> None:
        self._queue: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{n}", daemon=True) for n in range(size)
        ]
        for thread in self._threads:
            thread.start()

    def runs_on_current_thread(self) -> bool:
        return threading.current_thread() in self._threads

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on a worker; raises RuntimeError once the pool is shut down."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the worker pool is shut down")
            self._queue.put((fn, args, future))
        return future

    def run(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on a worker when nobody waits for its result (a Future costs a
        lock and a condition, per delivery); what it raises is logged. Raises RuntimeError
        once the pool is shut down."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the worker pool is shut down")
            self._queue.put((fn, args, None))

    def run_or_call(self, fn: Callable[..., Any], *args: Any) -> None:
        """``run``, or once the pool is shut down ``fn(*args)`` on the calling thread: for work
        that must happen either way (a settle), rather than never."""
        try:
            self.run(fn, *args)
        except RuntimeError:
            fn(*args)

    def shutdown(self) -> None:
        """Stop taking work; tasks not yet started are cancelled, running ones finish (the
        threads do not block interpreter exit). Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while True:
                try:
                    task = self._queue.get_nowait()
                except queue.Empty:
                    break
                if task is not None and task[2] is not None:
                    task[2].cancel()
            for _ in self._threads:
                self._queue.put(None)

    def _run(self) -> None:
        try:
            while True:
                task = self._queue.get()
                if task is None:
                    return
                fn, args, future = task
                if future is None:
                    try:
                        fn(*args)
                    except BaseException:
                        logger.exception("A task on a worker thread failed")
                    continue
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # the caller reads it from the future
                    future.set_exception(exc)
        finally:
            close_thread_connections()
            connections.close_all()
