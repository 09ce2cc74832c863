"""Retry delays: the handler's own delay when it gives one, else full-jitter exponential."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

MAX_EXPONENT = 30


def retry_delay_seconds(
    attempt: int,
    base_seconds: int,
    max_seconds: int,
    requested: float | None = None,
    rand: Callable[[], float] = random.random,
) -> int:
    """Seconds to wait before the next attempt of a delivery now on ``attempt`` (1-based).

    A finite ``requested`` delay (from ``Outcome.retry`` or ``TransientWorkError``) is rounded
    up and clamped to ``[0, max_seconds]``. Otherwise the delay is drawn uniformly from
    ``(0, min(max_seconds, base_seconds * 2**(attempt-1))]`` (full jitter), so a burst of
    failures spreads out instead of retrying in lock-step, and rounded up to a whole second:
    a subscription with a backoff never retries at once (rounded to the nearest, one retry in
    twenty with a 10 s base did, and a test asserting the retried run saw it run again).
    """
    if requested is not None:
        try:
            if math.isfinite(requested):
                return int(min(max(math.ceil(requested), 0), max_seconds))
        except OverflowError:
            # An int or Fraction beyond a float's range (a handler's own ``2 ** attempt`` at
            # attempt 1024): as long a wait as allowed, or none (audit helper-134).
            return max_seconds if requested > 0 else 0
        except ValueError:
            pass  # a signalling NaN (Decimal): no delay asked for, as for any other NaN
    exponent = min(max(attempt - 1, 0), MAX_EXPONENT)
    ceiling = min(max_seconds, base_seconds * 2**exponent)
    if ceiling <= 0:
        return 0
    return min(max(math.ceil(rand() * ceiling), 1), ceiling)
