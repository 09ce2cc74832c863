"""Process-level concerns of the host commands: stop signals, the kill switch, and what the
garbage collector walks."""

from __future__ import annotations

import gc
import os
import signal
import threading
from typing import Any


class StopSignal(threading.Event):
    """Set by the first SIGTERM or SIGINT; ``received`` names that signal (``"SIGTERM"``)."""

    received: str | None = None


def stop_on_signals() -> StopSignal:
    """An event set by the first SIGTERM or SIGINT (the host then drains)."""
    stop = StopSignal()

    def handler(signum: int, frame: Any) -> None:
        if not stop.is_set():
            stop.received = signal.Signals(signum).name
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def host_disabled() -> bool:
    """WORKQUEUE_DISABLE_HOST=1 makes the host commands exit 0 at once."""
    return os.environ.get("WORKQUEUE_DISABLE_HOST", "").strip().lower() in {"1", "true", "yes"}


def exit_now_if_abandoned(host: Any, code: int = 0) -> None:
    """End the process at once when handlers outlived the drain.

    Worker threads are joined at interpreter exit, so a handler that ignores its abort signal
    would otherwise keep a draining process alive past its termination grace period. Its
    delivery is left to lease expiry, as the drain promised.
    """
    if host.abandoned_handlers:
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def freeze_start_up_objects() -> None:
    """Take every object alive now out of the cyclic garbage collector's walks (``gc.freeze``).

    Called by the host commands once Django and the host are set up, before any claim. What
    exists by then (Django's apps, models, URL patterns and settings, the handler registry,
    the host's plans) lives as long as the process, yet each full collection walked all of it:
    with a project's 90,000-odd start-up objects, a host draining no-op handlers spent about a
    tenth of its CPU there (``bench/drain.py``). Objects frozen are still freed the ordinary
    way when nothing refers to them; only a cycle among them would no longer be collected,
    which start-up objects do not form. A collection first, so that no garbage is frozen.
    """
    gc.collect()
    gc.freeze()
