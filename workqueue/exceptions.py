"""The work queue's error hierarchy.

Expected outcomes (a duplicate publish, a stale lease token, a row that is not there) are result
values, not exceptions: the procedures decide them by affected-row count. Exceptions are for
configuration mistakes, bad input and database failures.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured, ValidationError

if TYPE_CHECKING:
    from workqueue.types import PublishResult


def one_line(error: BaseException) -> str:
    """``error``'s text for a log line or a command's message: on one line, its detail and hint
    kept, without where in a procedure it arose (the server's ``CONTEXT``, a dozen lines of
    SQL), a query it quotes, or the line of a statement it points at (``LINE 4: ...`` and its
    caret: a session cut while the procedure planned a statement); its class's name when it has
    no text."""
    kept = []
    pointing = False
    for line in str(error).splitlines():
        if line.startswith(("CONTEXT:", "QUERY:")):
            break
        if _STATEMENT_LINE.match(line):
            pointing = True
            continue
        if pointing and line.strip() == "^":
            continue
        pointing = False
        kept.append(line)
    return " ".join(" ".join(kept).split()) or type(error).__name__


#: How libpq quotes the line of a statement an error points at, before a line with a caret.
_STATEMENT_LINE = re.compile(r"LINE \d+: ")


class WorkQueueError(Exception):
    """Base class of every error the work queue raises on purpose."""


class WorkQueueConfigurationError(WorkQueueError, ImproperlyConfigured):
    """The work queue is configured in a way it cannot run with; the message names the fix."""


class InvalidInputError(WorkQueueError, ValueError):
    """An operator or API input failed validation before any database work was done."""


class InvalidMessageError(InvalidInputError):
    """A message to publish holds a value the database cannot store: text with a NUL character
    or a lone surrogate, JSON nested deeper than ``MAX_JSON_DEPTH`` or holding NaN/Infinity.

    Raised by ``publish``/``publish_many`` before any database work, so nothing of the call was
    published. ``index`` is the message's position in the call (0 for ``publish``), ``field``
    the field's name, ``problem`` what is wrong with it; the message never quotes the value.
    """

    def __init__(self, index: int, field: str, problem: str) -> None:
        super().__init__(f"{field} of message {index} {problem}.")
        self.index = index
        self.field = field
        self.problem = problem


class PublishRejectedError(WorkQueueError):
    """A publish was rejected and the caller asked for an exception (``publish_or_raise``,
    ``PublishResult.raise_if_rejected``). ``result`` is the ``PublishResult``; ``code`` its error
    code (``TopicNotFound``, ``PayloadTooLarge``, ...) and ``retryable`` whether publishing again
    unchanged may succeed."""

    def __init__(self, result: PublishResult) -> None:
        error = result.error
        code = error.code if error is not None else "Rejected"
        text = error.message if error is not None else "The message was rejected."
        super().__init__(f"Publish rejected: {code}: {text}")
        self.result = result
        self.code = code
        self.retryable = error.retryable if error is not None else False


class DriverOwnedWriteError(WorkQueueError):
    """An ORM write was attempted on a table that only the stored procedures may change."""


class DriverError(WorkQueueError):
    """A database call made by the driver failed; the library's error is kept as ``__cause__``."""


class TransientDriverError(DriverError):
    """A failure worth retrying: deadlock, serialization failure, lock timeout, lost connection."""


class DeadlockError(TransientDriverError):
    """The database broke a circle of transactions waiting for each other's locks by aborting
    this one (PostgreSQL SQLSTATE 40P01, SQL Server error 1205): the whole transaction may run
    again."""


class SerializationFailureError(TransientDriverError):
    """The transaction ran above READ COMMITTED (REPEATABLE READ, SERIALIZABLE, SQL Server's
    SNAPSHOT) and was refused a row changed since its snapshot, or a result no serial order
    gives (PostgreSQL SQLSTATE 40001, SQL Server error 3960)."""


class LockTimeoutError(TransientDriverError):
    """A statement waited longer than its procedure allows for a row another transaction
    holds (PostgreSQL SQLSTATE 55P03, SQL Server error 1222)."""


class PrivilegeRefusedError(DriverError):
    """The database refused the call for want of a grant (PostgreSQL SQLSTATE 42501, SQL
    Server error 229): a DBA's REVOKE, or a role never given its grants. Every such call fails
    the same way until the grant is given (back), so it is not retried."""


class UnstorableValueError(DriverError):
    """The database, or its client library, refused a value: a NUL character, a lone surrogate,
    malformed JSON, a number out of range (PostgreSQL's SQLSTATE class 22, "data exception").
    The same call would fail again, so it is never retried; the input checks are meant to catch
    such values first."""


class UniqueViolationError(DriverError):
    """A unique constraint rejected a write (for example a lost race for a partition key)."""


class LeaseLost(WorkQueueError):
    """The delivery is no longer this handler's to settle: its lease expired and another
    consumer may hold it now. ``context.complete(enlist=True)`` raises it, having completed
    nothing, so that the ``transaction.atomic()`` block it leaves rolls back the handler's
    writes with it. Catching ``LeaseLost`` catches ``Cancelled`` too."""


class Cancelled(LeaseLost):
    """An operator cancelled the running delivery (discard of an InFlight delivery), so it may
    no longer be completed; raised like ``LeaseLost``. The runtime acknowledges the cancel
    (the delivery becomes Discarded) once the handler returns."""


class EnlistError(WorkQueueError):
    """``context.complete(enlist=True)`` or ``publish(..., enlist=True)`` cannot join a
    transaction here: the caller's transaction is on another alias than the work queue's, or (a
    completion) none is open, the handler has already returned or the delivery was already
    completed. The message names the fix."""


class UnsupportedDatabaseError(WorkQueueConfigurationError):
    """The configured database vendor has no work-queue driver."""


class UnsupportedByTransportError(WorkQueueError):
    """The subscription's transport lacks the capability an operation needs.

    ``capability`` is the flag's name (``supports_replay``, ...); the text names it, the
    transport and the fix. REST answers 409, the CLI exits 1, the admin reports it per row.
    """

    def __init__(self, message: str, capability: str) -> None:
        super().__init__(message)
        self.capability = capability


class TransportUnavailableError(WorkQueueError):
    """A transport's remote service (SNS, SQS, ...) failed, refused or could not be reached;
    ``code`` is the service's error code when it answered with one. The client library's error
    is not kept (its text can name an endpoint's credentials): the message says what it said.
    Consumers treat it like a database outage: they log once, back off and try again."""

    def __init__(self, message: str, *, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class TransientTransportError(TransportUnavailableError):
    """The remote service could not be reached, timed out, throttled the call or failed on its
    side (HTTP 5xx): worth making the call again soon, as a database's transient errors are.
    A refusal (denied, missing, invalid) is a TransportUnavailableError: made again until a
    lease ran out, it would only hold a settle thread that long.

    ``may_have_arrived``: the request may have been carried out all the same (its answer was
    lost, or the service failed on its side); False when it never left (no connection) or was
    throttled."""

    def __init__(self, message: str, *, code: str = "", may_have_arrived: bool = False) -> None:
        super().__init__(message, code=code)
        self.may_have_arrived = may_have_arrived


class _BulkCounts:
    """What the committed batches of a stopped bulk replay or discard did: ``matched`` of the
    ``examined`` rows were changed (on a ``dry_run``, only counted) in ``batches`` batches;
    ``action`` is replay or discard."""

    def __init__(
        self,
        message: str,
        *,
        action: str,
        dry_run: bool,
        matched: int,
        examined: int,
        batches: int,
    ) -> None:
        super().__init__(message)
        self.action = action
        self.dry_run = dry_run
        self.matched = matched
        self.examined = examined
        self.batches = batches


class BulkOperationStopped(_BulkCounts, KeyboardInterrupt):
    """A bulk replay or discard stopped by Ctrl-C (a KeyboardInterrupt) after at least one
    batch had committed: still a KeyboardInterrupt, which stops what it stops, but it carries
    what those batches did, as BulkOperationInterrupted does, and its text says so; the CLI
    prints it and exits 130."""


class BulkOperationInterrupted(_BulkCounts, WorkQueueError):
    """A bulk replay or discard, which commits batch by batch, was stopped by a database or
    transport failure (its ``__cause__``) after at least one batch had committed. Those batches
    stay applied, as its counts say (see _BulkCounts). The text says so, and that running the
    operation again is safe. REST answers as for the failure, with the counts; the CLI exits 1;
    the admin reports the counts and records them in the subscription's history."""


class DeliveryBusyError(WorkQueueError):
    """A delivery could not be changed because a transaction holds its row: its handler is
    completing it inside ``transaction.atomic()`` and has not committed yet. Nothing was
    changed; the same request succeeds (or says the delivery has settled) once that
    transaction ends."""

    def __init__(self, message: str, delivery_id: str) -> None:
        super().__init__(message)
        self.delivery_id = delivery_id


class NotFoundError(WorkQueueError, LookupError):
    """A named subscription, topic or transport does not exist."""


class PermissionDeniedError(WorkQueueError, PermissionError):
    """The caller lacks the scope or Django permission for an operation."""


class TopologyValidationError(WorkQueueError, ValidationError):
    """A transport, topic or subscription breaks a rule the admin enforces; nothing was written.

    ``message_dict`` maps each field to its problems, as ``full_clean()`` does; the text names
    the row, each field and what to change.
    """

    def __init__(self, row: str, errors: dict[str, Any]) -> None:
        super().__init__(errors)
        self.row = row

    def __str__(self) -> str:
        problems = "; ".join(
            f"{field}: {' '.join(messages)}" for field, messages in self.message_dict.items()
        )
        return f"{self.row} was not saved: {problems}"


class OutsideTestTransactionWarning(RuntimeWarning):
    """A publish committed on the work queue's own connection while the thread was inside a
    Django ``TestCase``'s transaction: the test's rollback does not remove it, so it stays in
    the test database for the tests after it. ``workqueue.testing.use_test_connection()`` (or
    ``enlist=True``) keeps it inside the test. Turn it into an error with pytest's
    ``filterwarnings = error::workqueue.exceptions.OutsideTestTransactionWarning``."""


class PublishInsideAtomicInTestWarning(RuntimeWarning):
    """In test mode (``workqueue.testing.use_test_connection``), a publish without
    ``enlist=True`` ran inside a ``transaction.atomic()`` block of the code under test. In
    production such a publish commits at once on the work queue's own connection, whatever the
    block then does; in test mode it joined the test's transaction, so a rollback of the block
    takes it, and a test of "the block failed" passes while production would have published.
    Publish with ``enlist=True`` (to commit or roll back with the block) or after the block
    (``transaction.on_commit``)."""


class DeliveriesNotRunWarning(RuntimeWarning):
    """``workqueue.testing.run_until_idle()`` (run for every subscription) left Pending
    deliveries of a subscription it could not run: its handler key is registered by no handler
    of this project (a typo, say), or it is Unsupported or in Error. The text names the
    subscription and the reason, with the handler keys the key resembles. Also when the run
    stopped at its ``max_deliveries`` with due deliveries left."""
