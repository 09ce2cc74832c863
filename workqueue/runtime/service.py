"""A background service: ``run_once()`` on a fixed interval in its own thread until stopped.

``stop()`` is safe twice and before ``start()``; a failing pass is logged and the next one
still runs, an interval later. A service given ``pause`` waits what it says after each pass
that returned (from the pass's result and how long it took) instead of the interval.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from django.db import close_old_connections

from workqueue.driver import close_all_thread_connections

logger = logging.getLogger(__name__)


class PeriodicService:
    def __init__(
        self,
        name: str,
        interval_seconds: float,
        run_once: Callable[[], Any],
        *,
        pause: Callable[[Any, float, float], float] | None = None,
    ) -> None:
        self.name = name
        self.interval_seconds = interval_seconds
        self._run_once = run_once
        self._pause = pause
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

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
            wait = self.interval_seconds
            while not self._stop.wait(wait):
                wait = self.interval_seconds
                began = time.monotonic()
                try:
                    result = self._run_once()
                    if self._pause is not None:
                        wait = self._pause(result, time.monotonic() - began, self.interval_seconds)
                except Exception:
                    logger.exception("%s pass failed; the next pass will try again", self.name)
                finally:
                    # As at the end of a request: a Django connection a database restart broke
                    # is closed, so the next pass opens a fresh one instead of failing on it for
                    # the thread's whole life (the sweeper's task-results purge, for one).
                    close_old_connections()
        finally:
            # Kept between passes when CONN_MAX_AGE allows; closed with the thread.
            close_all_thread_connections()
