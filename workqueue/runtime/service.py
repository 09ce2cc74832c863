"""A background service: ``run_once()`` on a fixed interval in its own thread until stopped.

``stop()`` is safe twice and before ``start()``; a failing pass is logged and the next one
still runs, an interval later (passes failing while the database is away, or refuses writes,
are told once, and their end once: :class:`OutageLog`). A service given ``pause`` waits what
it says after each pass that returned (from the pass's result and how long it took) instead of
the interval.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from django.db import close_old_connections

from workqueue.driver import close_all_thread_connections, database_away
from workqueue.exceptions import one_line

logger = logging.getLogger(__name__)


class OutageLog:
    """Logs a periodic job's failed passes: a database away, restarting or refusing writes
    once, as a WARNING without a traceback, and its end once, at INFO (a traceback each pass,
    on every host, for as long as an outage lasted, told nothing more); anything else each
    time, with its traceback."""

    def __init__(self, what: str, log: logging.Logger) -> None:
        self.what = what
        self.log = log
        self._away = False

    def failed(self, exc: Exception) -> None:
        if not database_away(exc):
            self.log.exception("%s pass failed; the next pass will try again", self.what)
            return
        if not self._away:
            self.log.warning(
                "%s pass failed: %s; passing again each interval, and saying so once one "
                "goes through",
                self.what,
                one_line(exc),
                extra={"action": "pass_failed"},
            )
        self._away = True

    def passed(self) -> None:
        if self._away:
            self._away = False
            self.log.info("%s passes work again", self.what)


class PeriodicService:
    def __init__(
        self,
        name: str,
        interval_seconds: float,
        run_once: Callable[[], Any],
        *,
        pause: Callable[[Any, float, float], float] | None = None,
        first_wait_seconds: float | None = None,
    ) -> None:
        self.name = name
        self.interval_seconds = interval_seconds
        self._run_once = run_once
        self._pause = pause
        self._first_wait = interval_seconds if first_wait_seconds is None else first_wait_seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failures = OutageLog(name, logger)

    def start(self) -> None:
        if self._thread is None and self.interval_seconds > 0:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    def request_stop(self) -> None:
        """Stop after the pass in progress, if any; returns at once (``stop`` waits)."""
        self._stop.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _loop(self) -> None:
        try:
            wait = self._first_wait
            while not self._stop.wait(wait):
                wait = self.interval_seconds
                began = time.monotonic()
                try:
                    result = self._run_once()
                    if self._pause is not None:
                        wait = self._pause(result, time.monotonic() - began, self.interval_seconds)
                except Exception as exc:
                    self._failures.failed(exc)
                else:
                    self._failures.passed()
                finally:
                    # As at the end of a request: a Django connection a database restart broke
                    # is closed, so the next pass opens a fresh one instead of failing on it for
                    # the thread's whole life (the sweeper's task-results purge, for one).
                    close_old_connections()
        finally:
            # Kept between passes when CONN_MAX_AGE allows; closed with the thread.
            close_all_thread_connections()
