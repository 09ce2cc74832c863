"""What a handler returns, and the two errors it may raise on purpose."""

from __future__ import annotations

from dataclasses import dataclass

from workqueue.exceptions import WorkQueueError


@dataclass(frozen=True, slots=True)
class Outcome:
    """A handler's verdict on one delivery; build it with the class methods."""

    kind: str
    reason: str | None = None
    delay_seconds: float | None = None

    COMPLETE = "Complete"
    RETRY = "Retry"
    DEAD_LETTER = "DeadLetter"

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
        self.retry_after_seconds = retry_after_seconds
