"""What a handler returns, and the two errors it may raise on purpose."""

from __future__ import annotations

import decimal
import numbers
from dataclasses import dataclass

from django.utils.functional import Promise

from workqueue.exceptions import WorkQueueError


def _checked_seconds(value: object, name: str) -> float | None:
    """``value`` if it is None or a number; otherwise a TypeError naming ``name``. Raised where
    the handler builds its outcome: the delivery is then retried after the subscription's
    backoff with this error as its last error, instead of its settle failing later and the
    delivery waiting out its lease."""
    if value is None or (
        isinstance(value, numbers.Real | decimal.Decimal) and not isinstance(value, bool)
    ):
        return value  # type: ignore[return-value]
    raise TypeError(
        f"{name} must be a number of seconds or None, not {type(value).__name__} {value!r} "
        "(convert a Retry-After header with float())"
    )


@dataclass(frozen=True, slots=True)
class Outcome:
    """A handler's verdict on one delivery; build it with the class methods."""

    kind: str
    reason: str | None = None
    delay_seconds: float | None = None

    COMPLETE = "Complete"
    RETRY = "Retry"
    DEAD_LETTER = "DeadLetter"

    def __post_init__(self) -> None:
        if isinstance(self.reason, Promise):  # a translated reason (gettext_lazy)
            object.__setattr__(self, "reason", str(self.reason))
        if self.reason is not None and not isinstance(self.reason, str):
            raise TypeError(
                f"an Outcome's reason must be text or None, not {type(self.reason).__name__} "
                f"{self.reason!r} (pass str(error), or raise the error itself to keep its "
                "traceback)"
            )
        _checked_seconds(self.delay_seconds, "an Outcome's delay_seconds")

    @classmethod
    def complete(cls) -> Outcome:
        """The work is done; the delivery becomes Completed."""
        return cls(cls.COMPLETE)

    @classmethod
    def retry(cls, reason: str | None = None, delay_seconds: float | None = None) -> Outcome:
        """Try again later: after ``delay_seconds`` if given, else after jittered backoff.

        On the subscription's last attempt the delivery is dead-lettered instead
        (reason ``MaxAttemptsExceeded``).
        """
        return cls(cls.RETRY, reason, delay_seconds)

    @classmethod
    def dead_letter(cls, reason: str) -> Outcome:
        """Give up now, whatever attempts remain; an operator must replay or discard it."""
        return cls(cls.DEAD_LETTER, reason)


class FatalWorkError(WorkQueueError):
    """Raise from a handler when retrying cannot help: the delivery is dead-lettered at once."""


class TransientWorkError(WorkQueueError):
    """Raise from a handler for a passing failure: the delivery is retried, after
    ``retry_after_seconds`` when given, else after the subscription's backoff."""

    def __init__(self, message: str = "", retry_after_seconds: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_seconds = _checked_seconds(
            retry_after_seconds, "TransientWorkError's retry_after_seconds"
        )
