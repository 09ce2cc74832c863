"""``POST /topics/{topic}/messages``: external publish with an API key.

Checks run in a fixed order and the first failure answers; nothing of the body is read before
the caller is known and allowed:

1. no credentials → 401 (ninja, before this view runs);
2. signed in without an API key (a session) → 403;
3. topic name not ``^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$`` or containing ``..`` → 400;
4. key without ``workqueue:publish``, topic outside the key's limit, or owner without the
   permission → 403;
5. body larger than the limit → 413 (checked on Content-Length, then on what is read);
6. body not JSON → 400; not ``{"messages": [1..PUBLISH_MAX_BATCH objects]}`` → 400;
7. unknown topic → 404; topic without ``allow_external_publish`` → 403;
8. otherwise 202 with one result per message, in order (202 even if some were rejected).

Every refusal writes nothing. Messages are published as the key's owner with ``external=True``.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pydantic
from django.http import HttpRequest
from ninja import Router, Status
from ninja.errors import HttpError

from workqueue.api.schemas import ErrorOut, PublishRequest, PublishResponse, inline_json_schema
from workqueue.conf import get_settings
from workqueue.exceptions import PermissionDeniedError
from workqueue.models import Topic
from workqueue.operators.permissions import PUBLISH, Actor, require
from workqueue.publishing import OutgoingMessage, publish_many
from workqueue.types import PublishResult

# Used with fullmatch: `$` would also match before a trailing newline ("orders%0A").
TOPIC_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")

router = Router(tags=["publish"])


def body_limit() -> int:
    """The largest request body accepted, in bytes: ``WORKQUEUE["PUBLISH_BODY_LIMIT_BYTES"]``
    when the settings define it, else 30 MB."""
    return get_settings().PUBLISH_BODY_LIMIT_BYTES


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
    body = _parse(_read_body(request))
    max_batch = get_settings().PUBLISH_MAX_BATCH
    if len(body.messages) > max_batch:
        raise HttpError(400, f"messages must hold 1 to {max_batch} items.")
    found = Topic.objects.filter(name=topic.lower()).first()
    if found is None:
        raise HttpError(404, "No topic has this name.")
    if not found.allow_external_publish:
        raise PermissionDeniedError("This topic does not accept external publishing.")
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
        )
        for item in body.messages
    ]
    results = publish_many(found.name, messages, user=actor.user, external=True)
    return Status(202, {"results": [_result(r) for r in results]})


def _read_body(request: HttpRequest) -> bytes:
    limit = body_limit()
    too_large = HttpError(413, f"The request body is larger than {limit} bytes.")
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


class ShapeError(HttpError):
    """The body is JSON but not a publish request; carries the field errors (never the input)."""

    def __init__(self, error: pydantic.ValidationError) -> None:
        super().__init__(
            400, 'The body must be {"messages": [...]} with 1 or more message objects.'
        )
        self.errors = [
            {"loc": list(item["loc"]), "msg": item["msg"]}
            for item in error.errors(include_url=False, include_input=False)
        ]


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _parse(raw: bytes) -> PublishRequest:
    try:
        data = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        raise HttpError(400, "The request body is not valid JSON.") from None
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
