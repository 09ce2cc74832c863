"""Process-level concerns of the host commands: stop signals and the kill switch."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any


def stop_on_signals() -> threading.Event:
    """An event set by the first SIGTERM or SIGINT (the host then drains)."""
    stop = threading.Event()

    def handler(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def host_disabled() -> bool:
    """WORKQUEUE_DISABLE_HOST=1 makes the host commands exit 0 at once."""
    return os.environ.get("WORKQUEUE_DISABLE_HOST", "").strip().lower() in {"1", "true", "yes"}
