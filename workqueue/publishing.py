"""Publishing: validate a message, then hand it to ``wq_publish`` in one call.

Checks run in a fixed order and the first failure wins: topic-level problems (unknown, disabled,
not externally publishable) before problems with the message itself, and the size limit last.
Messages that pass local validation go straight to the procedure, which applies the topic checks
itself, so an accepted publish is a single round trip. Only a locally rejected message costs a
topology read, to report a topic problem first when there is one, and not even that when the
caller hands over the ``Topic`` it has just read (the REST API does).

The size limit is checked here too, before the database: against the topic's
``max_payload_bytes`` when the caller gave the ``Topic``, else against ``MAX_PAYLOAD_BYTES``, the
largest any topic allows. The procedure checks the topic's own limit in any case.

Values no database can be given (text with a NUL character or a lone surrogate, JSON nested
deeper than ``MAX_JSON_DEPTH`` or holding NaN; see ``workqueue.input_limits``) are not a
rejection of one message but a bad call: ``InvalidMessageError`` is raised before any database
work and nothing of the call is published.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import difflib
import logging
import re
import sys
import threading
import uuid
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.core import mail
from django.db import connections

from workqueue import metrics, signals
from workqueue.conf import setting
from workqueue.driver.base import (
    JsonText,
    canonical_json,
    encode_json_string,
    routed_to_django_connection,
)
from workqueue.exceptions import (
    DriverError,
    InvalidInputError,
    InvalidMessageError,
    OutsideTestTransactionWarning,
    PublishInsideAtomicInTestWarning,
    WorkQueueConfigurationError,
)
from workqueue.ids import new_message_id, new_message_ids
from workqueue.input_limits import (
    KEY_UNITS,
    TOO_DEEP_PROBLEM,
    json_text_problem,
    key_length,
    text_problem,
    within_units,
)
from workqueue.payload_ref import PayloadRefError, canonical_payload_ref
from workqueue.transports import BaseTransport, directory_transport
from workqueue.types import (
    MAX_PAYLOAD_BYTES,
    TOPIC_ON_OTHER_TRANSPORT,
    PublishError,
    PublishErrorCode,
    PublishResult,
    PublishStatus,
)

if TYPE_CHECKING:
    from workqueue.models import Topic

logger = logging.getLogger(__name__)

MAX_ATTRIBUTES = 10
# Used with fullmatch: `$` would also match before a trailing newline.
ATTRIBUTE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
RESERVED_ATTRIBUTE_PREFIXES = ("wq.", "wq_")
#: Deduplication keys of the work queue's own publishes (recurring slots: wq.schedule:...),
#: refused to external publishers.
RESERVED_DEDUPLICATION_PREFIX = "wq."
MAX_KEY_LENGTH = 200
#: The length of workqueue_message.published_by (Django's own user names fit: 150).
PUBLISHED_BY_MAX_LENGTH = 150
MIN_DEDUP_TTL, MAX_DEDUP_TTL = 60, 2_592_000
MIN_PRIORITY, MAX_PRIORITY = -100, 100


@dataclass(frozen=True, slots=True)
class OutgoingMessage:
    """One message for ``publish_many`` (``publish`` takes the same fields as arguments)."""

    payload: Any = None
    partition_key: str | None = None
    attributes: Mapping[str, str] | None = None
    correlation_id: str | None = None
    deduplication_key: str | None = None
    deduplication_ttl: int | None = None
    message_id: str | uuid.UUID | None = None
    #: A claim-check reference instead of a payload: ``uri`` and optionally ``content_type``,
    #: ``size_bytes``, ``checksum``, in any spelling (``contentType`` too); stored with these keys.
    payload_ref: Mapping[str, Any] | None = None
    #: Not claimed before this aware datetime (or ISO 8601 text with an offset).
    not_before: dt.datetime | str | None = None
    #: Not claimed before this many seconds from now (give this or ``not_before``).
    delay_seconds: int | None = None
    #: -100..100; higher is claimed first among a subscription's due deliveries.
    priority: int = 0


# A message handed over as a mapping, held for _prepare as an OutgoingMessage would hold it, in
# an unfrozen copy of that class: a frozen instance sets each of its eleven fields through
# object.__setattr__, a fifth of the cost of a small message's whole preparation. It bears the
# public name so that a mapping with an unknown key is refused in the same words.
_MessageFields = dataclasses.make_dataclass(
    "OutgoingMessage",
    [
        (f.name, f.type, dataclasses.field(default=f.default, default_factory=f.default_factory))
        for f in dataclasses.fields(OutgoingMessage)
    ],
    slots=True,
    eq=False,
    repr=False,
)


#: What publish_many takes as a message as it is (a mapping is read into a _MessageFields).
_MESSAGE_CLASSES = (OutgoingMessage, _MessageFields)


class _Invalid(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.error = PublishError(code, message)


class _Unstorable(Exception):
    """A field of one message holds a value the database cannot store."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(problem)
        self.field = field
        self.problem = problem


def publish(
    topic: str | Topic,
    payload: Any = None,
    *,
    partition_key: str | None = None,
    attributes: Mapping[str, str] | None = None,
    correlation_id: str | None = None,
    deduplication_key: str | None = None,
    deduplication_ttl: int | None = None,
    message_id: str | uuid.UUID | None = None,
    payload_ref: Mapping[str, Any] | None = None,
    not_before: dt.datetime | str | None = None,
    delay_seconds: int | None = None,
    priority: int = 0,
    user: Any = None,
    enlist: bool = False,
    external: bool = False,
) -> PublishResult:
    """Publish one message to ``topic`` and fan it out to the topic's matching subscriptions.

    Returns ``Accepted`` (with the message id), ``Duplicate`` (with the id of the message that
    already owns the deduplication key, or this id if it was published before with the same
    content) or ``Rejected`` with an error code. Re-publishing with the same ``message_id`` is
    safe while the first message is stored: the id makes the publish idempotent until
    retention purges that message (its topic's ``retention_days`` after it was published, once
    its deliveries settled). A claim-check ``payload_ref`` (instead of
    ``payload``) is stored, and reaches handlers, as ``{"uri", "content_type", "size_bytes",
    "checksum"}`` (all but ``uri`` optional) whatever the spelling of its keys; a bad one is
    ``Rejected`` with ``InvalidPayload``.

    ``topic`` is a topic's name, or a ``Topic`` the caller has just read (with its transport):
    then a message larger than its ``max_payload_bytes`` is rejected without any database round
    trip.

    A message holding text the database cannot store (a NUL character or a lone surrogate, in
    any field, payload keys included), or a payload nested deeper than ``MAX_JSON_DEPTH`` (64)
    levels or holding NaN or Infinity, raises ``InvalidMessageError`` (an
    ``InvalidInputError``, so a ``ValueError``) naming the field, before any database work;
    such a topic name raises ``InvalidInputError``. Every other problem is a ``Rejected`` result.

    ``not_before`` (an aware datetime) or ``delay_seconds`` schedules the message: its
    deliveries are not claimed before then, by the database clock. At most the topic's
    ``retention_days`` ahead; both at once, a naive datetime or a time too far ahead is
    ``Rejected`` with ``InvalidSchedule``. ``priority`` (-100..100, default 0) puts it ahead of
    lower priorities among a subscription's due deliveries; within one partition key publish
    order still decides (``InvalidPriority`` outside the range).

    By default the publish commits on its own connection whatever the caller's transaction does.
    With ``enlist=True`` it joins the caller's ``transaction.atomic()`` on the work queue's
    database alias: it commits or rolls back with the caller, and database errors are raised.
    """
    message = _MessageFields(
        payload=payload,
        partition_key=partition_key,
        attributes=attributes,
        correlation_id=correlation_id,
        deduplication_key=deduplication_key,
        deduplication_ttl=deduplication_ttl,
        message_id=message_id,
        payload_ref=payload_ref,
        not_before=not_before,
        delay_seconds=delay_seconds,
        priority=priority,
    )
    return publish_many(topic, [message], user=user, enlist=enlist, external=external)[0]


def publish_or_raise(topic: str | Topic, payload: Any = None, **options: Any) -> PublishResult:
    """``publish`` (same arguments) that raises ``PublishRejectedError`` instead of returning a
    ``Rejected`` result; the exception carries the result. A ``Duplicate`` is not an error: the
    message is already stored."""
    return publish(topic, payload, **options).raise_if_rejected()


def publish_many(
    topic: str | Topic,
    messages: Iterable[OutgoingMessage | Mapping[str, Any]],
    *,
    user: Any = None,
    enlist: bool = False,
    external: bool = False,
) -> list[PublishResult]:
    """Publish a batch to one topic in one round trip; results align with ``messages``.

    The batch is one transaction applied in order, so two messages of one partition key keep
    their order. Each message is accepted or rejected on its own, but a message holding a value
    the database cannot store raises ``InvalidMessageError`` (as for ``publish``) and nothing of
    the batch is published.
    """
    known = None if isinstance(topic, str) else _given_topic(topic)
    if known is None and not isinstance(topic, str):
        # It failed deep in the transport with an AttributeError naming neither.
        raise InvalidInputError(
            f"topic must be a topic's name (a str) or a Topic, not {type(topic).__name__}."
        )
    name = topic if known is None else known.name
    if problem := text_problem(name):
        raise InvalidInputError(f"topic {problem}.")
    size_limit = _SizeLimit.of(known)
    items = [m if isinstance(m, _MESSAGE_CLASSES) else _MessageFields(**m) for m in messages]
    results: list[PublishResult | None] = [None] * len(items)
    prepared: list[tuple[int, dict[str, Any]]] = []
    # An id for each item, used where the publisher chose none: made together, cheaper.
    fresh_ids = new_message_ids(len(items))
    for index, item in enumerate(items):
        try:
            prepared.append((index, _prepare(item, size_limit, fresh_ids[index], external)))
        except _Invalid as invalid:
            results[index] = _rejected(invalid.error)
        except _Unstorable as unstorable:
            raise InvalidMessageError(index, unstorable.field, unstorable.problem) from None

    if len(prepared) < len(items):
        topic_error = _topic_error(name, external, known)
        if topic_error is not None:
            # The topic's problem outranks the messages' own; told below as on every path.
            results = [_rejected(topic_error) for _ in items]
            prepared = []

    if prepared:
        publisher = _publisher(user, setting("SYSTEM_USER"))
        # A topic given by name goes to the procedures first, which know every topic: one round
        # trip for a Database topic, as before the transport seam; a topic of another
        # transport comes back as TOPIC_ON_OTHER_TRANSPORT and is handed to its own transport.
        transport = known.transport.transport_class() if known else directory_transport()
        # The ids the publisher chose: a transport that records ids outside the queue tables
        # (to answer Duplicate / MessageIDConflict) records these only.
        chosen = frozenset(p["message_id"] for i, p in prepared if items[i].message_id is not None)
        rows = _publish_on(
            transport, known or name, prepared, results, publisher, enlist, external, chosen
        )
        if any(row["error_code"] == TOPIC_ON_OTHER_TRANSPORT for row in rows):
            found = _topic_row(name)
            if found is None:
                rows = [
                    _row(p["message_id"], PublishErrorCode.TOPIC_NOT_FOUND) for _, p in prepared
                ]
            else:
                rows = _publish_on(
                    found.transport.transport_class(),
                    found,
                    prepared,
                    results,
                    publisher,
                    enlist,
                    external,
                    chosen,
                )
        if external and chosen:
            _answer_alike_for_others_messages(rows, chosen, publisher)
        for (index, _), row in zip(prepared, rows, strict=True):
            if row is not None:
                results[index] = _result_from_row(row)
    final = [r for r in results if r is not None]
    if any(r.error is not None and r.error.code == PublishErrorCode.TOPIC_NOT_FOUND for r in final):
        not_found = PublishError(
            PublishErrorCode.TOPIC_NOT_FOUND, _topic_not_found_text(name, enlist, external)
        )
        final = [
            dataclasses.replace(r, error=not_found)
            if r.error is not None and r.error.code == PublishErrorCode.TOPIC_NOT_FOUND
            else r
            for r in final
        ]
    if enlist:
        _count_once_committed(name, final)
    else:
        metrics.count_published(name, final)
    _log_rejections(name, final, external)
    accepted = [r.message_id for r in final if r.accepted]
    if accepted and not enlist:
        _warn_if_a_test_keeps_it(name, len(accepted))
        # In-process consumers of the topic claim at once instead of at their next poll. (An
        # enlisted publish is not visible until the caller commits; NOTIFY covers that.)
        # Robust: the messages are committed; a receiver that raises (Django logs it) must
        # not make the publish look failed.
        signals.published.send_robust(sender=publish_many, topic=name, message_ids=accepted)
    return final


def _count_once_committed(topic: str, results: list[PublishResult]) -> None:
    """Count an enlisted publish's results, the Accepted ones once the caller's transaction
    commits: one rolled back published nothing, and was counted Accepted all the same (review
    helper-166). A rejection or a duplicate was answered whatever the transaction does (a
    rejection raised in the block rolls it back: counted on commit, it was never counted)."""
    connection = connections[setting("DATABASE_ALIAS")]
    if not connection.in_atomic_block:
        # Autocommit (committed already), or a transaction managed by hand: counted now.
        metrics.count_published(topic, results)
        return
    answered = [r for r in results if not r.accepted]
    accepted = [r for r in results if r.accepted]
    if answered:
        metrics.count_published(topic, answered)
    if accepted:
        connection.on_commit(lambda: metrics.count_published(topic, accepted), robust=True)


def _given_topic(topic: Any) -> Topic | None:
    """``topic`` when it is a ``Topic``, else None (a name; any other value is refused by the
    caller)."""
    # Imported here: publishing needs topology models only when handed one (layering rule 6).
    from workqueue.models import Topic

    return topic if isinstance(topic, Topic) else None


def _warn_if_a_test_keeps_it(topic: Any, count: int) -> None:
    """Warn (``OutsideTestTransactionWarning``) when ``count`` messages were just committed on
    the queue's own connection while this thread is inside a ``TestCase``'s transaction, which
    Django marks as such: nothing rolls them back, and the tests after this one see them.
    Warn (``PublishInsideAtomicInTestWarning``) when test mode put them inside an atomic block
    of the code under test instead: its rollback takes them, where in production they would
    have committed on their own."""
    if "outbox" not in vars(mail):
        # Not in Django's test environment (which adds mail.outbox), so no TestCase is open:
        # every publish passes here, and a dictionary lookup is all it pays.
        return
    alias = setting("DATABASE_ALIAS")
    blocks = connections[alias].atomic_blocks
    if routed_to_django_connection(alias):
        # A TestCase's own blocks, and the one a Tasks API task runs in (its enqueue joins it;
        # a plain publish there is a handler's, which README "Testing your code" covers).
        if all(
            getattr(block, "_from_testcase", False) or getattr(block, RUNS_A_TASK, False)
            for block in blocks
        ):
            return
        warnings.warn(
            f"{count} message(s) published to topic {topic!r} without enlist=True inside "
            "transaction.atomic(): in production they commit at once on the work queue's own "
            "connection, whatever the block then does, but in test mode they joined the "
            "test's transaction and go with the block if it rolls back, so the test cannot "
            "see what production does. Publish with enlist=True to commit or roll back with "
            "the block, or after it (transaction.on_commit, the one way for a Tasks API "
            "enqueue: transaction.on_commit(functools.partial(task.enqueue, ...))).",
            PublishInsideAtomicInTestWarning,
            stacklevel=_callers_level(),
        )
        return
    if not any(getattr(block, "_from_testcase", False) for block in blocks):
        return
    warnings.warn(
        f"{count} message(s) published to topic {topic!r} during a test (TestCase, or "
        "pytest-django's db) were stored outside the test's transaction, which does not remove "
        "them: they stay for the tests after it. For a topic on the Database transport, "
        "decorate the test (or its class) with workqueue.testing.use_test_connection(), or "
        "publish with enlist=True.",
        OutsideTestTransactionWarning,
        stacklevel=_callers_level(),
    )


def _callers_level() -> int:
    """The ``stacklevel`` of the first frame outside this package and what calls it on a
    test's behalf (the test's line)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_NOT_THE_CALLER):
        frame, level = frame.f_back, level + 1
    return level


_NOT_THE_CALLER = (
    "workqueue.",
    "django_tasks.",
    "django.tasks.",
    # An enqueue run by transaction.on_commit (captureOnCommitCallbacks), async_to_sync, a
    # thread pool or a REST view: the test's line is further out.
    "django.db.",
    "django.test.",
    "django.utils.asyncio",  # the async_unsafe guard around the backend's enqueue
    "asgiref.",
    "concurrent.",
    "ninja.",
)


#: Marks the ``transaction.atomic()`` a Tasks API task runs in (``workqueue.tasks.handler``):
#: an enqueue inside it joins it, and test mode does not take it for the code under test's.
RUNS_A_TASK = "_workqueue_runs_a_task"


def running_a_task(alias: str) -> bool:
    """Whether this thread is inside the transaction a Tasks API task runs in on ``alias``."""
    return any(getattr(block, RUNS_A_TASK, False) for block in connections[alias].atomic_blocks)


#: The ``action`` of the line logging a call's rejections (for log pipelines that count them).
REJECTIONS_LOGGED = "publish_rejected"


#: Set on a thread while its caller reports rejections itself (rejections_reported_by_caller).
_rejections_reported = threading.local()


@contextlib.contextmanager
def rejections_reported_by_caller() -> Iterator[None]:
    """Leave out this thread's lines on a call's rejections (``_log_rejections``), for a caller
    that reports them itself: the CLI printed the same sentence twice, and the Tasks backend,
    which raises for any enqueue not accepted, logged a topic it then created as not found
    (review helper-175). Other threads keep their lines."""
    before = getattr(_rejections_reported, "on", False)
    _rejections_reported.on = True
    try:
        yield
    finally:
        _rejections_reported.on = before


def _log_rejections(topic: Any, results: list[PublishResult], external: bool) -> None:
    """One line a call that had messages rejected, with the first one's reason: a caller that
    does not look at its results (``publish(...)`` then a redirect) loses that work otherwise,
    with no trace. A WARNING for this process's own publishers; INFO for an API key's, which
    reads its results in the answer (a faulty client would fill the log)."""
    first = next((r for r in results if r.status == PublishStatus.REJECTED), None)
    if first is None or getattr(_rejections_reported, "on", False):
        return  # every publish's path: no list is built
    logger.log(
        logging.INFO if external else logging.WARNING,
        "%d of %d message(s) published to topic %r were rejected; the first: %s: %s",
        sum(r.status == PublishStatus.REJECTED for r in results),
        len(results),
        topic,
        first.error.code,
        first.error.message,
        extra={"action": REJECTIONS_LOGGED},
    )


def _topic_not_found_text(topic: str, enlist: bool, external: bool) -> str:
    """What a TopicNotFound says: which name was not found; to this server's own callers, the
    topics it resembles and how to make one (an external publisher is told no other topic's
    name); and why a topic that exists may not be seen: made in the caller's open transaction
    (a test's, typically), which the queue's own connection cannot see."""
    # Imported here: publishing reads topology only on this path (layering rule 6).
    from workqueue.models import Topic

    text = f"No topic is named {topic!r}."
    if external:
        return text
    alias = setting("DATABASE_ALIAS")
    existing = Topic.objects.using(alias).values_list("name", flat=True)
    wanted = topic.strip().lower()
    # Itself too, when it exists where this reads but not on the queue's connection (below).
    near = [n for n in difflib.get_close_matches(wanted, existing, n=4, cutoff=0.8) if n != wanted]
    if near:
        text += f" Did you mean {' or '.join(map(repr, near[:3]))}?"
    if (
        not enlist
        and not routed_to_django_connection(alias)
        and connections[alias].in_atomic_block
        and _topic_row(topic) is not None  # on the caller's connection, in its transaction
    ):
        return text + (
            " This publish ran on the work queue's own connection, which cannot see a topic "
            "your open transaction made; in a test, use "
            "workqueue.testing.use_test_connection() (or publish with enlist=True): as a "
            "decorator of the test or its TestCase class, or as a context manager in a pytest "
            "fixture (`with use_test_connection(): ...`)."
        )
    return text + (
        " Create it in the admin, or declare it in WORKQUEUE['TOPOLOGY'] and run "
        "`manage.py workqueue sync-topology`."
    )


def _publish_on(
    transport: BaseTransport,
    topic: str | Topic,
    prepared: list[tuple[int, dict[str, Any]]],
    results: list[PublishResult | None],
    publisher: str,
    enlist: bool,
    external: bool,
    chosen_message_ids: frozenset[str],
) -> list[dict[str, Any] | None]:
    """Publish ``prepared`` through ``transport``: one row per prepared message, None where
    the transport lacks a capability the message asks for (its rejection then goes straight
    into ``results``)."""
    if enlist and not transport.supports_enlisted_publish:
        # Like a database error in an enlisted publish, a bad call rather than a rejection.
        transport.require(
            "supports_enlisted_publish", "An enlisted publish", _transport_name(topic)
        )
    # Only the rules this transport could break are checked (none, for the database).
    lacking = [rule for rule in _CAPABILITY_RULES if not getattr(transport, rule[0])]
    sendable: list[dict[str, Any]] = []
    for index, message in prepared:
        problem = _capability_problem(lacking, transport, message, topic) if lacking else None
        if problem is None:
            sendable.append(message)
        else:
            results[index] = _rejected(problem)
    try:
        sent = iter(
            transport.publish(
                topic,
                sendable,
                publisher=publisher,
                enlist=enlist,
                external=external,
                chosen_message_ids=chosen_message_ids,
            )
            if sendable
            else []
        )
    except DriverError as exc:
        # A database not migrated answers that wq_publish does not exist, in the database's
        # words (audit helper-136); the commands said so, a view's publish did not.
        # Imported here: publishing must not load the runtime at import time.
        from workqueue.runtime.process import unmigrated_problem

        if (problem := unmigrated_problem(exc)) is not None:
            raise WorkQueueConfigurationError(problem) from exc
        raise
    return [None if results[index] is not None else next(sent) for index, _ in prepared]


def _transport_name(topic: str | Topic) -> str:
    return topic if isinstance(topic, str) else topic.transport.name


#: What a message may ask for only on a transport with the capability: the flag, the field
#: that asks, and the rejection's code.
_CAPABILITY_RULES = (
    ("supports_deduplication", "deduplication_key", PublishErrorCode.INVALID_DEDUPLICATION),
    ("supports_scheduled_publish", "not_before", PublishErrorCode.INVALID_SCHEDULE),
    ("supports_scheduled_publish", "delay_seconds", PublishErrorCode.INVALID_SCHEDULE),
    ("supports_priority", "priority", PublishErrorCode.INVALID_PRIORITY),
)


def _capability_problem(
    lacking: list[tuple[str, str, str]],
    transport: BaseTransport,
    message: dict[str, Any],
    topic: str | Topic,
) -> PublishError | None:
    """The rejection of a message that asks for what ``transport`` lacks (``lacking``, rules of
    _CAPABILITY_RULES), if it does."""
    for flag, field, code in lacking:
        if message[field] not in (None, 0):
            return PublishError(code, transport.refusal(flag, field, _transport_name(topic)))
    return None


def _answer_alike_for_others_messages(
    rows: list[dict[str, Any] | None], chosen: frozenset[str], publisher: str
) -> None:
    """Make an external publisher's re-publish of another publisher's message id answer the
    same whatever the content it sent: ``MessageIDConflict``.

    ``Duplicate`` (same content) and ``MessageIDConflict`` (different content) would tell an
    API key's holder, one guess at a time, what another publisher's message holds, without the
    permission to view payloads (the deduplication key answers any caller with the owning
    message's id). Its own re-publish, the reason to choose an id, still answers Duplicate."""
    # Imported here: publishing reads models only on the paths that need them (layering rule 6).
    from workqueue.models import Message

    answered = {
        row["message_id"]
        for row in rows
        if row is not None
        and row["message_id"] in chosen
        and (
            row["status"] == PublishStatus.DUPLICATE
            or row["error_code"] == PublishErrorCode.MESSAGE_ID_CONFLICT
        )
    }
    if not answered:
        return
    others = {
        str(message_id)
        for message_id, published_by in Message.objects.filter(pk__in=answered).values_list(
            "id", "published_by"
        )
        if published_by != publisher
    }
    for index, row in enumerate(rows):
        if row is not None and row["message_id"] in others:
            rows[index] = _row(row["message_id"], PublishErrorCode.MESSAGE_ID_CONFLICT)


def _row(message_id: str, code: str) -> dict[str, Any]:
    return {"message_id": message_id, "status": PublishStatus.REJECTED, "error_code": code}


def _topic_row(name: str) -> Topic | None:
    # Imported here: publishing reads topology only on this path (layering rule 6).
    from workqueue.models import Topic

    return Topic.objects.select_related("transport").filter(name=name.strip().lower()).first()


_ERROR_TEXT = {
    PublishErrorCode.TOPIC_NOT_FOUND: "No topic has this name.",
    PublishErrorCode.TOPIC_DISABLED: "The topic or its transport is disabled.",
    PublishErrorCode.TOPIC_NOT_EXTERNALLY_PUBLISHABLE: (
        "The topic does not allow external publishing (allow_external_publish is off)."
    ),
    PublishErrorCode.PAYLOAD_TOO_LARGE: "The message is larger than the topic's max_payload_bytes.",
    PublishErrorCode.INVALID_SCHEDULE: (
        "The due time is invalid: give not_before or delay_seconds (not both), at most the "
        "topic's retention_days ahead."
    ),
    PublishErrorCode.INVALID_PRIORITY: "priority must be a whole number from -100 to 100.",
    PublishErrorCode.MESSAGE_ID_CONFLICT: (
        "A different message was already published with this message id."
    ),
    PublishErrorCode.DEDUPLICATION_PENDING: (
        "Another publish holds this deduplication key and has not finished; try again shortly."
    ),
    PublishErrorCode.TRANSPORT_UNAVAILABLE: (
        "The database stayed busy (deadlock, lock timeout or lost connection); publish again."
    ),
}


def _result_from_row(row: Mapping[str, Any]) -> PublishResult:
    code = row["error_code"]
    if not code:
        return PublishResult(row["message_id"], row["status"], delivered_to=row.get("delivered_to"))
    text = row.get("error_message") or _ERROR_TEXT.get(code, code)
    return PublishResult(row["message_id"], row["status"], PublishError(code, text))


def _rejected(error: PublishError) -> PublishResult:
    return PublishResult(None, PublishStatus.REJECTED, error)


def _publisher(user: Any, system_user: str) -> str:
    """Who published, as recorded: cut to the column's length (a custom user model may allow
    e-mail addresses of 254 characters as user names, and the record is for reading only)."""
    name = user.get_username() if user is not None else system_user
    return within_units(name, PUBLISHED_BY_MAX_LENGTH)


def _topic_error(topic: str, external: bool, known: Topic | None) -> PublishError | None:
    """The topic-level rejection for ``topic``, if any (outranks a message's own problems);
    read from ``known`` when the caller gave the topic, else from the database."""
    found = known
    if found is None:
        # Imported here: publishing reads topology only on this rare path (layering rule 6).
        from workqueue.models import Topic

        found = Topic.objects.select_related("transport").filter(name=topic.strip().lower()).first()
    if found is None:
        code = PublishErrorCode.TOPIC_NOT_FOUND
    elif found.status != "Active" or found.transport.status != "Active":
        code = PublishErrorCode.TOPIC_DISABLED
    elif external and not found.allow_external_publish:
        code = PublishErrorCode.TOPIC_NOT_EXTERNALLY_PUBLISHABLE
    else:
        return None
    return PublishError(code, _ERROR_TEXT[code])


@dataclass(frozen=True, slots=True)
class _SizeLimit:
    """The largest message accepted locally, and how to name that limit in a rejection."""

    max_bytes: int
    named: str

    @classmethod
    def of(cls, topic: Topic | None) -> _SizeLimit:
        if topic is None:
            return _ANY_TOPICS_LIMIT
        return cls(topic.max_payload_bytes, "the topic's max_payload_bytes")


#: The limit of a publish by topic name, made once: the procedure checks the topic's own.
_ANY_TOPICS_LIMIT = _SizeLimit(
    MAX_PAYLOAD_BYTES, "the largest max_payload_bytes any topic may have"
)


def message_problem(message: OutgoingMessage) -> str | None:
    """Why every publish of ``message`` would be refused whatever its topic, or None: checked
    ahead of time for messages published later (the schedules of ``WORKQUEUE["SCHEDULES"]``),
    so that a mistake stops the host at start rather than being refused at every slot."""
    try:
        _prepare(message, _SizeLimit.of(None))
    except _Invalid as invalid:
        return f"{invalid.error.code}: {invalid.error.message}"
    except _Unstorable as unstorable:
        return f"{unstorable.field}: {unstorable.problem}"
    return None


def _prepare(
    message: OutgoingMessage,
    size_limit: _SizeLimit,
    fresh_id: str | None = None,
    external: bool = False,
) -> dict[str, Any]:
    """Validate one message and return the procedure's parameters for it (raises _Invalid, or
    _Unstorable first for a value the database cannot store). A message without an id of its
    publisher's gets ``fresh_id`` (a new one when None)."""
    _require_storable_text(message)
    message_id = _message_id(message.message_id, fresh_id)
    attributes = _attributes(message.attributes)
    payload, payload_ref, body = _payload(message.payload, message.payload_ref)
    partition_key = message.partition_key
    if partition_key is not None and (
        not isinstance(partition_key, str)
        or not partition_key
        or key_length(partition_key) > MAX_KEY_LENGTH
    ):
        raise _Invalid(
            PublishErrorCode.INVALID_PARTITION_KEY,
            f"partition_key must be a string of 1 to {MAX_KEY_LENGTH} {KEY_UNITS}.",
        )
    if partition_key is not None and partition_key.endswith(" "):
        # SQL Server compares text ignoring trailing spaces, even under a binary collation:
        # there 'a ' would share the key 'a' (and its Ordered line, and bulk operations by key)
        # while PostgreSQL keeps them apart. Refused on every vendor, so that a key means one
        # thing wherever the queue runs.
        raise _Invalid(
            PublishErrorCode.INVALID_PARTITION_KEY,
            f"partition_key {partition_key!r} ends with a space, which SQL Server ignores when "
            "it compares keys: strip it (or end the key with another character).",
        )
    dedup_key, dedup_ttl = _deduplication(
        message.deduplication_key, message.deduplication_ttl, external
    )
    not_before, delay_seconds = _schedule(message.not_before, message.delay_seconds)
    priority = _priority(message.priority)
    correlation_id = message.correlation_id
    if correlation_id is not None and (
        not isinstance(correlation_id, str) or key_length(correlation_id) > MAX_KEY_LENGTH
    ):
        raise _Invalid(
            PublishErrorCode.INVALID_PAYLOAD,
            f"correlation_id must be a string of at most {MAX_KEY_LENGTH} {KEY_UNITS}.",
        )
    envelope_bytes = _envelope_bytes(partition_key, attributes, correlation_id, body)
    # Refused here so that an oversized message costs no database round trip (the procedure
    # would refuse it too: it is the authority on the topic's current limit).
    if envelope_bytes > size_limit.max_bytes:
        raise _Invalid(
            PublishErrorCode.PAYLOAD_TOO_LARGE,
            f"The message is {envelope_bytes} bytes; {size_limit.named} is {size_limit.max_bytes}.",
        )
    return {
        "message_id": message_id,
        "partition_key": partition_key,
        "attributes": attributes,
        "payload": payload,
        # The payload's text, made above to measure the envelope: the database transport sends
        # it as it is (workqueue.transport.publish) instead of serialising the payload again.
        "payload_json": None if payload is None else JsonText(body),
        "payload_ref": payload_ref,
        "correlation_id": correlation_id,
        "deduplication_key": dedup_key,
        "deduplication_ttl_seconds": dedup_ttl,
        "envelope_bytes": envelope_bytes,
        "not_before": not_before,
        "delay_seconds": delay_seconds,
        "priority": priority,
    }


def _require_storable_text(message: OutgoingMessage) -> None:
    """Raise _Unstorable for a text field the database cannot store (the JSON fields are
    checked as they are serialised, in _payload). Values of the wrong type are left to the
    other rules."""
    for field in ("partition_key", "correlation_id", "deduplication_key"):
        value = getattr(message, field)
        if isinstance(value, str) and (problem := text_problem(value)):
            raise _Unstorable(field, problem)
    # Tested for None first: an isinstance test against an abstract class is slow.
    if message.attributes is not None and isinstance(message.attributes, Mapping):
        for name, text in message.attributes.items():
            for part in (name, text):
                if isinstance(part, str) and (problem := text_problem(part)):
                    raise _Unstorable("attributes", problem)


def _message_id(value: Any, fresh_id: str | None) -> str:
    if value is None:
        return fresh_id or new_message_id()
    try:
        return str(uuid.UUID(str(value)))
    except ValueError:
        raise _Invalid(PublishErrorCode.INVALID_MESSAGE_ID, "message_id must be a UUID.") from None


def _attributes(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _Invalid(PublishErrorCode.INVALID_ATTRIBUTES, "attributes must be an object.")
    if len(value) > MAX_ATTRIBUTES:
        raise _Invalid(
            PublishErrorCode.INVALID_ATTRIBUTES,
            f"At most {MAX_ATTRIBUTES} attributes are allowed; got {len(value)}.",
        )
    for name, text in value.items():
        if not isinstance(name, str) or not ATTRIBUTE_NAME.fullmatch(name):
            raise _Invalid(
                PublishErrorCode.INVALID_ATTRIBUTES,
                f"Attribute name {name!r} must be 1-64 letters, digits, '_' or '-'.",
            )
        if name.lower().startswith(RESERVED_ATTRIBUTE_PREFIXES):
            raise _Invalid(
                PublishErrorCode.INVALID_ATTRIBUTES,
                f"Attribute name {name!r} uses the reserved prefix 'wq.' or 'wq_'.",
            )
        if not isinstance(text, str) or not 1 <= len(text) <= 256:
            raise _Invalid(
                PublishErrorCode.INVALID_ATTRIBUTES,
                f"Attribute {name!r} must be a string of 1 to 256 characters.",
            )
    # An empty object and no object mean the same; store one form so duplicates compare equal.
    return dict(value) or None


def _payload(payload: Any, payload_ref: Any) -> tuple[Any, dict[str, Any] | None, str]:
    """(payload, canonical payload_ref, the canonical JSON text of whichever of them is set)."""
    if payload is not None and payload_ref is not None:
        raise _Invalid(
            PublishErrorCode.INVALID_PAYLOAD, "Give either payload or payload_ref, not both."
        )
    if payload_ref is not None:
        try:
            payload_ref = canonical_payload_ref(payload_ref)
        except PayloadRefError as exc:
            raise _Invalid(PublishErrorCode.INVALID_PAYLOAD, str(exc)) from None
    field, value = ("payload", payload) if payload_ref is None else ("payload_ref", payload_ref)
    try:
        text = canonical_json(value)
    except RecursionError:
        # Hundreds of levels deep: far past MAX_JSON_DEPTH, and too deep to serialise here.
        raise _Unstorable(field, TOO_DEEP_PROBLEM) from None
    except (TypeError, ValueError) as exc:
        # Keys of two types cannot be sorted (TypeError): name the key, not the comparison. (A
        # ValueError is a value that contains itself: nothing to walk.)
        key_problem = _non_text_key(value, field) if isinstance(exc, TypeError) else None
        raise _Invalid(
            PublishErrorCode.INVALID_PAYLOAD,
            key_problem or f"The payload is not JSON-serialisable: {exc}",
        ) from None
    # json writes a number, boolean or null key as text ({1: "a"} as {"1": "a"}), so the handler
    # would get another object than the one published. Only a text that has a key spelled like
    # one is walked to tell a written number from a text key "1". (The first search finds a
    # key's end at about the speed of a substring test; the second reads the whole key, so that
    # keys such as "line1" or "v2" cost no walk.)
    if _CONVERTED_KEY_END.search(text) and _CONVERTED_KEY.search(text):
        key_problem = _non_text_key(value, field)
        if key_problem is not None:
            raise _Invalid(PublishErrorCode.INVALID_PAYLOAD, key_problem)
    problem = json_text_problem(text)
    if problem is not None:
        raise _Unstorable(field, problem)
    return payload, payload_ref, text


#: The end of a key as json writes a number, boolean or null key (or of a text key that ends like
#: one, "item1"): found from the literal '":' and a look back, at about the speed of a substring
#: test (a pattern that starts with the key's first character searched 2x slower).
_CONVERTED_KEY_END = re.compile(
    r'":(?:(?<=[0-9]":)|(?<=true":)|(?<=false":)|(?<=null":)|(?<=NaN":)|(?<=Infinity":))'
)
#: A whole key as json writes a number (int or float, Infinity and NaN included), boolean or null
#: key. In valid JSON text a '"' after '{' or ',' opens a string, so this matches keys only.
_CONVERTED_KEY = re.compile(
    r'[{,]"(?:-?[0-9]+(?:\.[0-9]+)?(?:e[-+][0-9]+)?|true|false|null|NaN|-?Infinity)":'
)


def _non_text_key(value: Any, field: str) -> str | None:
    """The problem with the first object key in ``value`` that is not text, or None. Only
    containers are walked, each linked to its parent by (link, key or index), and the path is
    spelled out only for the key it reports."""
    if not isinstance(value, dict | list | tuple):
        return None
    stack: list[tuple[Any, Any]] = [(value, None)]
    seen: set[int] = set()
    while stack:
        item, link = stack.pop()
        if id(item) in seen:
            continue  # a value that contains itself (and something json cannot write)
        seen.add(id(item))
        if isinstance(item, dict):
            for key in item:
                if not isinstance(key, str):
                    return (
                        f"The {field}'s object keys must be text: {_spelled(field, link)} "
                        f"has the key {key!r} ({type(key).__name__})."
                    )
            members: Any = item.items()
        else:
            members = enumerate(item)
        stack.extend(
            (member, (link, key))
            for key, member in members
            if isinstance(member, dict | list | tuple)
        )
    return None


def _spelled(field: str, link: Any) -> str:
    """The path a chain of (parent link, key or index) links names, e.g. payload['a'][0]."""
    parts = []
    while link is not None:
        link, key = link
        parts.append(f"[{key}]" if isinstance(key, int) else f"[{key!r}]")
    return field + "".join(reversed(parts))


def _envelope_bytes(
    partition_key: str | None,
    attributes: dict[str, str] | None,
    correlation_id: str | None,
    body: str,
) -> int:
    """The UTF-8 size of the message's canonical envelope (``canonical_json`` of its partition
    key, attributes, payload, payload_ref and correlation id; ``body`` is the text of whichever
    of payload and payload_ref is set), added up from its parts: the body's text is already
    made, and joining the envelope to measure it would copy the payload twice more (joined,
    then encoded)."""
    return (
        _ENVELOPE_FRAME_BYTES
        + (4 if attributes is None else _utf8_length(canonical_json(attributes)))
        + _utf8_length(_json_text(correlation_id))
        + _utf8_length(_json_text(partition_key))
        + _utf8_length(body)
        + 4  # the "null" of whichever of payload and payload_ref the body is not
    )


#: The envelope's text around its five values: {"attributes":<a>,"correlation_id":<c>,...}.
_ENVELOPE_FRAME_BYTES = len(
    '{"attributes":,"correlation_id":,"partition_key":,"payload":,"payload_ref":}'
)


def _utf8_length(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def _json_text(value: str | None) -> str:
    return "null" if value is None else encode_json_string(value)


def _deduplication(key: Any, ttl: Any, external: bool) -> tuple[str | None, int | None]:
    if key is not None and not isinstance(key, str):
        raise _Invalid(PublishErrorCode.INVALID_DEDUPLICATION, "deduplication_key must be text.")
    if key is not None:
        key = key.strip()
        if not key:
            # Not read as "no key": the caller meant one, and would deduplicate nothing.
            raise _Invalid(
                PublishErrorCode.INVALID_DEDUPLICATION,
                "deduplication_key is blank; give a key, or leave it out for no deduplication.",
            )
    if key is not None and key_length(key) > MAX_KEY_LENGTH:
        raise _Invalid(
            PublishErrorCode.INVALID_DEDUPLICATION,
            f"deduplication_key must be at most {MAX_KEY_LENGTH} {KEY_UNITS}.",
        )
    if external and key is not None and key.lower().startswith(RESERVED_DEDUPLICATION_PREFIX):
        # The work queue's own keys (a recurring publish's slots): an external publisher that
        # sent one first would keep the slot from ever being published.
        raise _Invalid(
            PublishErrorCode.INVALID_DEDUPLICATION,
            f"deduplication_key {key!r} uses the reserved prefix "
            f"{RESERVED_DEDUPLICATION_PREFIX!r}.",
        )
    if ttl is not None:
        if key is None:
            raise _Invalid(
                PublishErrorCode.INVALID_DEDUPLICATION,
                "deduplication_ttl needs a deduplication_key.",
            )
        if (
            isinstance(ttl, bool)
            or not isinstance(ttl, int)
            or not (MIN_DEDUP_TTL <= ttl <= MAX_DEDUP_TTL)
        ):
            raise _Invalid(
                PublishErrorCode.INVALID_DEDUPLICATION,
                f"deduplication_ttl must be a whole number of seconds from {MIN_DEDUP_TTL} "
                f"to {MAX_DEDUP_TTL}.",
            )
    return key, ttl


def _schedule(not_before: Any, delay_seconds: Any) -> tuple[str | None, int | None]:
    """The due time as the procedure takes it: ISO 8601 text with an offset, or a delay."""
    if not_before is not None and delay_seconds is not None:
        raise _Invalid(
            PublishErrorCode.INVALID_SCHEDULE, "Give not_before or delay_seconds, not both."
        )
    if delay_seconds is not None:
        if isinstance(delay_seconds, bool) or not isinstance(delay_seconds, int):
            raise _Invalid(
                PublishErrorCode.INVALID_SCHEDULE, "delay_seconds must be a whole number."
            )
        if not 0 <= delay_seconds <= 2**31 - 1:
            raise _Invalid(
                PublishErrorCode.INVALID_SCHEDULE,
                "delay_seconds must be from 0 to the topic's retention_days in seconds.",
            )
        return None, delay_seconds
    if not_before is None:
        return None, None
    if isinstance(not_before, str):
        try:
            not_before = dt.datetime.fromisoformat(not_before)
        except ValueError:
            raise _Invalid(
                PublishErrorCode.INVALID_SCHEDULE,
                f"not_before {not_before!r} is not an ISO 8601 date and time.",
            ) from None
    if not isinstance(not_before, dt.datetime):
        raise _Invalid(PublishErrorCode.INVALID_SCHEDULE, "not_before must be a datetime.")
    if not_before.utcoffset() is None:
        # A naive time would be read in whatever zone the database session has.
        raise _Invalid(
            PublishErrorCode.INVALID_SCHEDULE,
            "not_before must carry a time zone (an aware datetime, or text with an offset "
            "such as 2030-01-01T09:00:00+00:00).",
        )
    # In UTC: an offset with fractions of a second (local mean time, which Python reads) is not
    # one the database reads.
    try:
        return not_before.astimezone(dt.UTC).isoformat(), None
    except OverflowError:  # 0001-01-01T00:00+14:00 is before the first UTC datetime
        raise _Invalid(
            PublishErrorCode.INVALID_SCHEDULE,
            f"not_before {not_before.isoformat()} is outside the range of dates in UTC.",
        ) from None


def _priority(priority: Any) -> int | None:
    """The priority to send: None for the default 0, which every procedure reads NULL as (a
    batch's items then leave it out, text neither side has to write or parse)."""
    if priority is None:
        return None
    if (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or not MIN_PRIORITY <= priority <= MAX_PRIORITY
    ):
        raise _Invalid(
            PublishErrorCode.INVALID_PRIORITY,
            f"priority must be a whole number from {MIN_PRIORITY} to {MAX_PRIORITY}.",
        )
    return priority or None
