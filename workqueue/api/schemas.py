"""Request and response shapes of the REST API. JSON field names are camelCase.

Responses are ninja Schemas filled from the operators' dataclasses (attribute names are the
snake_case field names; the camelCase aliases are what goes on the wire, so every operation sets
``by_alias=True``). The publish request is validated by the publish view itself, after the auth,
topic and size checks, so its models are plain strict pydantic models.
"""

from __future__ import annotations

import copy
import datetime as dt
from typing import Any

from ninja import Schema
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class _Out(Schema):
    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=True)


class _In(BaseModel):
    # Strict: a number where text is expected (or "60" for a number) is a shape error, not
    # something to coerce; unknown fields are refused so a misspelt field never goes missing.
    model_config = ConfigDict(
        alias_generator=to_camel, validate_by_name=False, strict=True, extra="forbid"
    )


# -- errors ---------------------------------------------------------------------------------


class FieldErrorOut(Schema):
    loc: list[str | int]
    msg: str


class ErrorOut(Schema):
    detail: str
    errors: list[FieldErrorOut] | None = None
    #: On a 409: the transport capability the operation needs (``supports_replay``, ...).
    capability: str | None = None
    #: On a 409 from a discard: the delivery whose row an open transaction holds (its handler
    #: completing it inside ``transaction.atomic()``); the same request can be sent again.
    delivery_id: str | None = Field(None, alias="deliveryId")
    # On a 503 (500 for a cloud transport's failure) from a bulk operation that a failure
    # stopped after some of its batches had committed: what those batches did, as a 200 counts.
    matched: int | None = Field(
        None, description="Bulk operation stopped partway: the rows its batches changed."
    )
    examined: int | None = Field(
        None, description="Bulk operation stopped partway: the rows its batches looked at."
    )
    batches: int | None = Field(
        None,
        description="Bulk operation stopped partway: the batches that committed (they stay "
        "applied; sending the request again goes on with what is left).",
    )


# -- publish --------------------------------------------------------------------------------


# The claim-check reference as documented; the publish view passes whatever JSON the caller sent
# to publishing, which checks it and stores its keys in one spelling (an item with a bad
# reference is Rejected with InvalidPayload, like other publish validation, not a 400).
PAYLOAD_REF_SCHEMA = {
    "type": "object",
    "description": "Where the payload is kept, instead of payload. Keys may also be spelt "
    "snake_case (content_type, size_bytes); handlers receive uri, content_type, size_bytes and "
    "checksum.",
    "properties": {
        "uri": {"type": "string", "minLength": 1},
        "contentType": {"type": "string", "minLength": 1},
        "sizeBytes": {"type": "integer", "minimum": 0},
        "checksum": {"type": "string", "minLength": 1},
    },
    "required": ["uri"],
}


class PublishMessageIn(_In):
    message_id: str | None = Field(
        default=None, description="A UUID; give one so a retried request cannot publish twice."
    )
    partition_key: str | None = None
    attributes: dict[str, str] | None = None
    payload: Any = Field(default=None, description="Any JSON value (or give payloadRef).")
    payload_ref: Any = Field(default=None, json_schema_extra=PAYLOAD_REF_SCHEMA)
    correlation_id: str | None = None
    deduplication_key: str | None = None
    deduplication_ttl_seconds: int | None = None
    not_before: str | None = Field(
        default=None,
        description="ISO 8601 time with an offset (2030-01-01T09:00:00Z); not delivered before "
        "then. At most the topic's retention ahead; give this or delaySeconds.",
    )
    delay_seconds: int | None = Field(
        default=None, description="Not delivered before this many seconds from now."
    )
    priority: int = Field(
        default=0,
        description="-100..100; higher is delivered first among due messages of a subscription "
        "(within one partition key, publish order decides).",
    )


class PublishRequest(_In):
    messages: list[PublishMessageIn] = Field(
        min_length=1, description="1 to PUBLISH_MAX_BATCH (default 100) messages."
    )


class PublishErrorOut(Schema):
    code: str
    message: str
    retryable: bool


class PublishResultOut(_Out):
    message_id: str | None
    status: str = Field(description="Accepted, Duplicate or Rejected.")
    error: PublishErrorOut | None = None


class PublishResponse(Schema):
    results: list[PublishResultOut] = Field(description="One result per message, in order.")


# -- operators ------------------------------------------------------------------------------


class SubscriptionStatsOut(_Out):
    subscription_name: str
    pending: int
    in_flight: int
    dead_lettered: int
    blocked_keys: int | None
    oldest_pending_age_seconds: int | None
    completed_last_hour: int | None = Field(
        description="Deliveries completed in the last hour; null when the subscription's "
        "transport keeps no history of completions (AWS)."
    )
    as_of: dt.datetime
    rate_limit_per_second: float | None = Field(
        description="Most deliveries started per second across every host; null: no limit."
    )
    capped: bool = Field(
        description="A count stopped at the server's STATS_COUNT_CAP (or the completions were "
        "counted among fewer than the last hour's, the newest that many of every "
        "subscription's): the counts are then at least what they say."
    )


class StatsFailureOut(_Out):
    subscription_name: str
    error: str


class StatsOut(_Out):
    subscriptions: list[SubscriptionStatsOut]
    failures: list[StatsFailureOut]


class PayloadRefOut(_Out):
    uri: str
    content_type: str | None = None
    size_bytes: int | None = None
    checksum: str | None = None


class DeadLetterMessageOut(_Out):
    message_id: str
    topic: str
    partition_key: str | None
    attributes: dict[str, str]
    payload: Any = Field(description="Null unless the caller has workqueue.view_payload.")
    payload_ref: PayloadRefOut | None = Field(
        description="Null unless the caller has workqueue.view_payload."
    )
    correlation_id: str | None
    published_at: dt.datetime


class DeadLetterOut(_Out):
    delivery_id: str
    partition_key: str | None
    attempts: int
    reason: str | None
    last_error: str | None
    dead_lettered_at: dt.datetime | None
    blocks_key: bool
    message: DeadLetterMessageOut


class DeadLetterPageOut(_Out):
    supported: bool
    items: list[DeadLetterOut]
    next_cursor: str | None


class PartitionOut(_Out):
    partition_key: str
    condition: str
    head_delivery_id: str
    waiting_items: int
    lease_owner: str | None = None
    lease_expires_at: dt.datetime | None = None


class PartitionPageOut(_Out):
    supported: bool
    items: list[PartitionOut]
    next_cursor: str | None


class BacklogOut(_Out):
    supported: bool
    claimable: int
    in_flight: int
    total: int
    capped: bool


class ReplayIn(Schema):
    # Unknown fields refused, as in every request: a misspelt "Note" was dropped, and the
    # replay went ahead without its audit note.
    model_config = ConfigDict(extra="forbid")

    note: str | None = Field(default=None, description="At most 1000 characters.")


class ReplayOut(_Out):
    supported: bool
    replayed: bool


class DiscardIn(Schema):
    # Unknown fields refused: {"reason": ..., "dryRun": true} discarded for real (only the bulk
    # discards have a dry run).
    model_config = ConfigDict(extra="forbid")

    reason: str = Field(description="Why the delivery is discarded; at most 1000 characters.")


class DiscardOut(_Out):
    supported: bool
    discarded: bool
    cancel_requested: bool
    holds_key: bool = Field(
        default=False,
        description="With cancelRequested: the handler completed the delivery in its own "
        "transaction and runs on, holding its partition key; the delivery stays Completed and "
        "the key is free when the handler returns.",
    )


class DeadLetterFilterIn(Schema):
    """Which dead letters a bulk operation takes; an absent field matches all."""

    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=False, extra="forbid")

    dead_letter_reason: str | None = Field(
        default=None, description="The dead-letter reason, e.g. MaxAttemptsExceeded (any case)."
    )
    partition_key: str | None = Field(default=None, description="Exactly this partition key.")
    dead_lettered_from: dt.datetime | None = Field(
        default=None, description="Dead-lettered at or after this time (with its UTC offset)."
    )
    dead_lettered_before: dt.datetime | None = Field(
        default=None, description="Dead-lettered before this time (with its UTC offset)."
    )
    error_contains: str | None = Field(
        default=None, description="Text the last error contains (any case)."
    )


class BulkReplayIn(Schema):
    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=False, extra="forbid")

    filter: DeadLetterFilterIn = Field(default_factory=DeadLetterFilterIn)
    dry_run: bool = Field(default=False, description="Count the matching dead letters only.")
    note: str | None = Field(
        default=None, description="Recorded on each replayed delivery; at most 1000 characters."
    )


class BulkDiscardIn(Schema):
    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=False, extra="forbid")

    filter: DeadLetterFilterIn = Field(default_factory=DeadLetterFilterIn)
    dry_run: bool = Field(default=False, description="Count the matching dead letters only.")
    reason: str = Field(
        description="Why they are discarded, recorded on each; at most 1000 characters."
    )


class PendingFilterIn(Schema):
    """Which waiting deliveries a bulk discard takes; an absent field matches all."""

    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=False, extra="forbid")

    partition_key: str | None = Field(default=None, description="Exactly this partition key.")
    published_from: dt.datetime | None = Field(
        default=None, description="Published at or after this time (with its UTC offset)."
    )
    published_before: dt.datetime | None = Field(
        default=None, description="Published before this time (with its UTC offset)."
    )
    error_contains: str | None = Field(
        default=None, description="Text an earlier attempt's error contains (any case)."
    )


class PendingDiscardIn(Schema):
    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=False, extra="forbid")

    filter: PendingFilterIn = Field(default_factory=PendingFilterIn)
    dry_run: bool = Field(default=False, description="Count the matching deliveries only.")
    reason: str = Field(
        description="Why they are discarded, recorded on each; at most 1000 characters."
    )


class BulkOut(_Out):
    supported: bool
    action: str = Field(description="replay or discard.")
    dry_run: bool
    matched: int = Field(
        description="Dead letters matching the filter: changed, or on a dry run, to be changed."
    )
    examined: int = Field(description="Dead letters of the subscription looked at.")
    batches: int = Field(description="Transactions the work was split into.")


class BindingIssueOut(_Out):
    severity: str = Field(description="Error or Warning.")
    subject: str
    message: str


class BindingIssuesOut(_Out):
    issues: list[BindingIssueOut]


# -- health ---------------------------------------------------------------------------------


class StuckRunOut(_Out):
    delivery_id: str = Field(
        description="Cancel it with POST .../subscriptions/{name}/deliveries/{id}/discard."
    )
    handler_key: str
    seconds: float = Field(description="How long its handler had run when the host reported.")
    threshold_seconds: int = Field(
        description="The subscription's max_processing_seconds, else the server's "
        "HANDLER_RUN_WARNING_SECONDS."
    )


class HostSubscriptionOut(_Out):
    name: str
    state: str
    reason: str
    in_flight: int
    concurrency: int
    oldest_run_seconds: float | None = Field(
        description="How long the oldest handler of the subscription running on this host had "
        "run when it reported; null when none runs."
    )
    stuck_count: int = Field(description="Its handler runs here past their threshold.")
    stuck_runs: list[StuckRunOut] = Field(description="The oldest ten of them.")


class HostOut(_Out):
    instance_id: str = Field(
        description="hostname:pid:random; for a key limited to subscriptions, a stable "
        "pseudonym instead."
    )
    hostname: str | None = Field(description="Null for a key limited to subscriptions.")
    pid: int | None = Field(description="Null for a key limited to subscriptions.")
    started_at: dt.datetime
    last_seen_at: dt.datetime
    subscriptions: list[HostSubscriptionOut]


class SubscriptionHealthOut(_Out):
    name: str
    state: str = Field(
        description="Running when any live host runs it, else a host's state; NotRunning when "
        "work is due and no live host lists it."
    )
    reason: str
    running_hosts: int
    in_flight: int
    oldest_run_seconds: float | None = Field(
        description="The oldest handler run among the live hosts; null when none runs."
    )
    stuck_count: int = Field(
        description="Handler runs past their threshold on the live hosts: each makes the "
        "status degraded."
    )
    stuck_runs: list[StuckRunOut] = Field(description="The oldest ten of them.")


class HealthOut(_Out):
    status: str = Field(
        description="ok: live hosts, every subscription running, no stuck handler run, no "
        "database warning; degraded: some subscription is not running, or has due work that "
        "no live host runs, or a handler run past its threshold, or the database warns; down: "
        "no live host."
    )
    hosts: list[HostOut]
    subscriptions: list[SubscriptionHealthOut]
    database_warnings: list[str] = Field(
        description="Threats to the queue tables' upkeep (a vacuum horizon held too long, dead "
        "rows outnumbering live ones, sparse indexes, the tables locked for more than 2 s), each "
        "naming its fix. Always empty for a key limited to named subscriptions."
    )


# -- OpenAPI helper ---------------------------------------------------------------------------


def inline_json_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON schema (by alias) with every ``$ref`` replaced by its definition, for
    documenting a body the view reads itself (its definitions are not in the components)."""
    schema = model.model_json_schema(by_alias=True, mode="validation")
    definitions = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                target = copy.deepcopy(definitions[ref.removeprefix("#/$defs/")])
                return resolve({**target, **{k: v for k, v in node.items() if k != "$ref"}})
            return {key: resolve(value) for key, value in node.items()}
        if isinstance(node, list):
            return [resolve(value) for value in node]
        return node

    return resolve(schema)


#: Field errors a 400 lists at most; the rest are counted in one more entry.
MAX_FIELD_ERRORS = 20


def field_errors(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where and what of each of ``errors`` (pydantic's or ninja's), never the input, at most
    MAX_FIELD_ERRORS of them: one per unknown field, a body of a million was answered with
    more than it sent (audit helper-137)."""
    listed = [
        {"loc": list(e.get("loc", ())), "msg": str(e.get("msg", ""))}
        for e in errors[:MAX_FIELD_ERRORS]
    ]
    if len(errors) > MAX_FIELD_ERRORS:
        listed.append({"loc": [], "msg": f"... and {len(errors) - MAX_FIELD_ERRORS} more"})
    return listed
