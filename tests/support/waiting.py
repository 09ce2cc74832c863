"""Polling for a condition in tests that run real threads and processes (no fixed sleeps)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_until(condition: Callable[[], Any], timeout: float = 15.0, interval: float = 0.02) -> Any:
    """Return ``condition()``'s first truthy value; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)
