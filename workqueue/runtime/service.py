"""A background service: ``run_once()`` on a fixed interval in its own thread until stopped.

``stop()`` is safe twice and before ``start()``; a failing pass is logged and the next one
still runs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from django.db import connections

from workqueue.driver import close_thread_connections

logger = logging.getLogger(__name__)


class PeriodicService:
    def __init__(self, name: str, interval_seconds: float, run_once: Callable[[], object]) -> None:
        self.name = name
        self.interval_seconds = interval_seconds
        self._run_once = run_once
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None and self.interval_seconds > 0:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _loop(self) -> None:
        try:
            while not self._stop.wait(self.interval_seconds):
                try:
                    self._run_once()
                except Exception:
                    logger.exception("%s pass failed; the next pass will try again", self.name)
        finally:
            # Kept between passes when CONN_MAX_AGE allows; closed with the thread.
            close_thread_connections()
            connections.close_all()
