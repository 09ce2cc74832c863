"""``POST /topics/{topic}/messages``: external publish with an API key.

Checks run in a fixed order and the first failure answers; nothing of the body is read before
the caller is known and allowed:

1. no credentials → 401 (ninja, before this view runs);
2. signed in without an API key (a session) → 403;
3. topic name not ``^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$`` or containing ``..`` → 400;
4. key without ``workqueue:publish``, topic outside the key's limit, or owner without the
   permission → 403;
5. body larger than the limit → 413 (checked on Content-Length, then on what is read); body
   holding more than ``PUBLISH_MAX_JSON_VALUES`` JSON values and keys → 413, unparsed;
6. body not JSON → 400; more than ``PUBLISH_MAX_BATCH`` messages → 400 (counted on the parsed
   list, before any message is looked at); not ``{"messages": [1..N objects]}`` → 400;
7. unknown topic → 404; topic without ``allow_external_publish`` → 403;
8. a message holding text the database cannot store (a NUL character, a lone surrogate) or a
   payload nested deeper than ``MAX_JSON_DEPTH`` → 400 naming the message and field;
9. otherwise 202 with one result per message, in order (202 even if some were rejected).

Every refusal writes nothing. Messages are published as the key's owner with ``external=True``.

What one request can cost is bounded before the work starts: the body limit is derived from the
batch size and the topic's ``max_payload_bytes`` (see ``body_limit``), so a body that could not
hold an acceptable batch is refused unparsed; the batch size is checked before any message is
validated; and a message over the topic's limit is rejected before the database. Under WSGI,
Django passes the view only Content-Length bytes; under ASGI, Django receives the whole body
before the view runs, so the proxy in front must enforce the limit (README, "Running in
production").
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pydantic
from django.http import HttpRequest
from ninja import Router, Status
from ninja.errors import HttpError
from pydantic.alias_generators import to_camel

from workqueue.api.schemas import (
    ErrorOut,
    PublishRequest,
    PublishResponse,
    field_errors,
    inline_json_schema,
)
from workqueue.conf import get_settings
from workqueue.exceptions import InvalidMessageError, PermissionDeniedError
from workqueue.input_limits import MAX_JSON_DEPTH, holds_more_json_values
from workqueue.models import Topic
from workqueue.models.topology import EXTERNAL_TASKS_PROBLEM
from workqueue.operators.permissions import PUBLISH, Actor, require
from workqueue.publishing import OutgoingMessage, publish_many
from workqueue.types import MAX_PAYLOAD_BYTES, PublishResult

# Used with fullmatch: `$` would also match before a trailing newline ("orders%0A").
TOPIC_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
#: Room per message for what is sent besides the envelope that max_payload_bytes counts: the
#: field names, the message id, a 200-character deduplication key and its TTL, a due time and a
#: priority take under 1 KiB as compact UTF-8 JSON.
MESSAGE_OVERHEAD_BYTES = 2048

router = Router(tags=["publish"])


def body_limit(max_payload_bytes: int = MAX_PAYLOAD_BYTES) -> int:
    """The largest request body accepted for a topic of ``max_payload_bytes``, in bytes.

    ``WORKQUEUE["PUBLISH_BODY_LIMIT_BYTES"]`` when set; otherwise room for a full batch of
    full-size messages sent as compact UTF-8 JSON: ``PUBLISH_MAX_BATCH`` x (``max_payload_bytes``
    + ``MESSAGE_OVERHEAD_BYTES``), 25.2 MiB by default for a topic of the largest size. Anything
    larger cannot be an acceptable batch, so it is refused before it is parsed: parsing costs
    many times the body's size in memory.
    """
    settings = get_settings()
    if settings.PUBLISH_BODY_LIMIT_BYTES is not None:
        return settings.PUBLISH_BODY_LIMIT_BYTES
    return settings.PUBLISH_MAX_BATCH * (max_payload_bytes + MESSAGE_OVERHEAD_BYTES)


@router.post(
    "/topics/{topic}/messages",
    response={
        202: PublishResponse,
        400: ErrorOut,
        401: ErrorOut,
        403: ErrorOut,
        404: ErrorOut,
        413: ErrorOut,
    },
    by_alias=True,
    operation_id="publishMessages",
    summary="Publish messages to a topic",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": inline_json_schema(PublishRequest)}},
        }
    },
)
def publish_messages(request: HttpRequest, topic: str) -> Status[dict[str, Any]]:
    """Publish a batch to one topic with an API key (scope ``workqueue:publish``) acting as its
    owner. The topic must allow external publishing. Each message is accepted or rejected on
    its own: results line up with the request's messages."""
    actor: Actor = request.auth  # type: ignore[attr-defined]
    if actor.scopes is None:
        raise PermissionDeniedError("Publishing needs an API key: send it in the X-API-Key header.")
    if not TOPIC_NAME.fullmatch(topic) or ".." in topic:
        raise HttpError(400, "The topic name is not valid.")
    require(actor, PUBLISH, topic=topic)
    # Read before the body, which is limited by the topic's message size. An unknown topic is
    # answered 404 only after the body checks, as the order above says.
    found = Topic.objects.select_related("transport").filter(name=topic.lower()).first()
    limit = body_limit(found.max_payload_bytes) if found is not None else body_limit()
    raw = _read_body(request, limit)
    _refuse_too_many_values(raw)
    body = _validate(_parse(raw))
    if found is None:
        raise HttpError(404, "No topic has this name.")
    if not found.allow_external_publish:
        raise PermissionDeniedError("This topic does not accept external publishing.")
    if found.is_read_by_tasks():
        # Left open by a release before the rule (validate-bindings reports it as an Error).
        raise PermissionDeniedError(EXTERNAL_TASKS_PROBLEM)
    messages = [
        OutgoingMessage(
            payload=item.payload,
            partition_key=item.partition_key,
            attributes=item.attributes,
            correlation_id=item.correlation_id,
            deduplication_key=item.deduplication_key,
            deduplication_ttl=item.deduplication_ttl_seconds,
            message_id=item.message_id,
            payload_ref=item.payload_ref,
            not_before=item.not_before,
            delay_seconds=item.delay_seconds,
            priority=item.priority,
        )
        for item in body.messages
    ]
    try:
        # The Topic, not its name: messages over its max_payload_bytes are rejected without a
        # database round trip.
        results = publish_many(found, messages, user=actor.user, external=True)
    except InvalidMessageError as exc:
        raise MessageValueError(exc) from None
    return Status(202, {"results": [_result(r) for r in results]})


def _read_body(request: HttpRequest, limit: int) -> bytes:
    too_large = HttpError(
        413,
        f"The request body is larger than {limit} bytes: room for PUBLISH_MAX_BATCH messages "
        "of the topic's max_payload_bytes plus 2 KiB each, unless "
        'WORKQUEUE["PUBLISH_BODY_LIMIT_BYTES"] says otherwise. Send fewer messages per '
        'request, or raise WORKQUEUE["PUBLISH_BODY_LIMIT_BYTES"].',
    )
    try:
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        raise HttpError(400, "The Content-Length header is not valid.") from None
    if declared > limit:
        raise too_large
    # Read the stream, not request.body: request.body applies Django's much smaller
    # DATA_UPLOAD_MAX_MEMORY_SIZE, and reading one byte past the limit proves the size.
    raw = request.read(limit + 1)
    if len(raw) > limit:
        raise too_large
    return raw


def _refuse_too_many_values(raw: bytes) -> None:
    most = get_settings().PUBLISH_MAX_JSON_VALUES
    if holds_more_json_values(raw, most):
        raise HttpError(
            413,
            f"The request body holds more than {most} JSON values and keys (counted before it "
            "is parsed, with the brackets). Send fewer or smaller messages per request, or "
            'raise WORKQUEUE["PUBLISH_MAX_JSON_VALUES"].',
        )


class ShapeError(HttpError):
    """The body is JSON but not a publish request; carries the field errors (never the input)."""

    def __init__(self, error: pydantic.ValidationError) -> None:
        super().__init__(
            400, 'The body must be {"messages": [...]} with 1 or more message objects.'
        )
        self.errors = field_errors(error.errors(include_url=False, include_input=False))


class MessageValueError(HttpError):
    """A message holds a value the database cannot store: 400 saying where (never the value)."""

    def __init__(self, error: InvalidMessageError) -> None:
        field = to_camel(error.field)
        super().__init__(400, f"messages[{error.index}].{field} {error.problem}.")
        self.errors = [{"loc": ["messages", error.index, field], "msg": error.problem}]


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class _NumberOutOfRange(ValueError):
    pass


def _finite_float(text: str) -> float:
    # Valid JSON, but past what a float holds (1e400): Python reads it as infinity, which
    # would then be refused as "NaN or Infinity", a value the caller never sent.
    number = float(text)
    if math.isinf(number):
        raise _NumberOutOfRange(text)
    return number


def _parse(raw: bytes) -> Any:
    try:
        return json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except _NumberOutOfRange as exc:
        shown = str(exc) if len(str(exc)) <= 40 else f"{str(exc)[:37]}..."
        raise HttpError(
            400,
            f"The request body holds the number {shown}, beyond what a double-precision float "
            "holds (about 1.8e308); send it as a string.",
        ) from None
    except RecursionError:
        raise HttpError(
            400,
            "The request body is JSON nested too deeply to read; payloads may nest at most "
            f"{MAX_JSON_DEPTH} levels.",
        ) from None
    except ValueError:
        raise HttpError(400, "The request body is not valid JSON.") from None


#: Keys of any one object of a publish request (the body, a message, its attributes) beyond
#: which it is refused before it is validated field by field.
MAX_KEYS_VALIDATED = 1000


def _validate(data: Any) -> PublishRequest:
    messages = data.get("messages") if isinstance(data, dict) else None
    max_batch = get_settings().PUBLISH_MAX_BATCH
    # Counted on the parsed list, before any message is validated: an oversized batch costs no
    # per-message work.
    if isinstance(messages, list) and len(messages) > max_batch:
        raise HttpError(
            400,
            f'messages must hold 1 to {max_batch} items (WORKQUEUE["PUBLISH_MAX_BATCH"]); '
            f"got {len(messages)}.",
        )
    # Counted before pydantic too, which makes an error of each unknown field and of each
    # attribute that is no text: a body of a million cost seconds and gigabytes to refuse
    # (audit helper-137). Up to the limit, their errors are listed (the first few).
    objects = [("The body", data)]
    for index, message in enumerate(messages if isinstance(messages, list) else []):
        if isinstance(message, dict):
            objects += [(f"messages[{index}]", message)]
            objects += [(f"messages[{index}].attributes", message.get("attributes"))]
    for where, value in objects:
        if isinstance(value, dict) and len(value) > MAX_KEYS_VALIDATED:
            raise HttpError(
                400,
                f"{where} holds {len(value)} keys, more than a publish request has: see "
                "the API's schema (/work-queue/docs).",
            )
    try:
        return PublishRequest.model_validate(data)
    except pydantic.ValidationError as exc:
        raise ShapeError(exc) from None


def _result(result: PublishResult) -> dict[str, Any]:
    error = result.error
    return {
        "message_id": result.message_id,
        "status": str(result.status),
        "error": (
            None
            if error is None
            else {"code": str(error.code), "message": error.message, "retryable": error.retryable}
        ),
    }
