"""What a request holds in the web process at its peak, and the payloads that make a page's
memory blow up: JSON that is small as text and large as Python objects."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any

from workqueue.types import MAX_PAYLOAD_BYTES

#: About as many empty objects as a message of MAX_PAYLOAD_BYTES holds (its size counts the
#: envelope too): three bytes of JSON each ("{},") become an empty dict of 64 bytes and a list
#: slot, some 25 times their text.
SWOLLEN_PAYLOAD: list[dict[str, Any]] = [{} for _ in range((MAX_PAYLOAD_BYTES - 1024) // 3)]


def peak_bytes(action: Callable[[], Any]) -> tuple[Any, int]:
    """``action()``'s result and the most memory it held at once beyond what was held before."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        result = action()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, peak - before
