"""The registry: every ``wq_*`` procedure described once.

Each vendor driver renders a call line from these descriptions, and the parity test checks both
vendors' SQL files against them, so a procedure's name, parameter names and order and result
columns cannot drift between PostgreSQL, SQL Server and Python.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ParamType(enum.Enum):
    UUID = "uuid"
    TEXT = "text"
    INT = "int"
    BOOL = "bool"
    JSON = "json"
    TIMESTAMP = "timestamp"


class Grant(enum.Enum):
    """Which role's grant includes a procedure (``manage.py workqueue grant-<role>``)."""

    #: Hosts and publishers: publish, claim, heartbeat, settle, and the sweeper a host runs
    #: (its steps act only on expired leases and retention, whatever the caller passes).
    RUNTIME = "runtime"
    #: People and tools that look and intervene: stats, listings, backlog, replay, discard,
    #: cancel, the topology lock a partition-mode change (or a new, enabled, refiltered or
    #: moved Ordered subscription) takes, and binding checks.
    OPERATOR = "operator"


class ResultKind(enum.Enum):
    ONE = "one"  # exactly one row
    MANY = "many"  # zero or more rows
    ROWCOUNT = "rowcount"  # one row with one column, affected_rows


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    type: ParamType


# A result column has the same shape as a parameter: a name and the type it decodes to.
Column = Param


# Compared and hashed by identity (eq=False): each procedure is defined once, below, and the
# driver looks its result shape up per returned row, where hashing every parameter and column
# cost more than decoding the row.
@dataclass(frozen=True, slots=True, eq=False)
class Procedure:
    name: str
    params: tuple[Param, ...]
    columns: tuple[Column, ...]
    result: ResultKind
    grant: Grant = Grant.RUNTIME

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)


def _p(spec: str) -> tuple[Param, ...]:
    """Parse ``"name:type, ..."`` (type defaults to text) so the table below stays readable."""
    params = []
    for item in spec.split(","):
        if item.strip():
            name, _, type_name = item.strip().partition(":")
            params.append(Param(name, ParamType(type_name or "text")))
    return tuple(params)


_c = _p


_ROWCOUNT = _c("affected_rows:int")
_EXPIRED = _c("delivery_id:uuid, subscription_id:uuid, partition_key, new_status")
_CLAIMED = _c(
    "kind, delivery_id:uuid, lease_token:uuid, lease_expires_at:timestamp, attempt_count:int, "
    "is_replay:bool, message_id:uuid, topic_id:uuid, partition_key, attributes:json, "
    # The payload as its stored text: decoded when its handler starts (ClaimedDelivery).
    "payload, payload_ref:json, correlation_id, published_at:timestamp"
)

PROCEDURES: dict[str, Procedure] = {
    p.name: p
    for p in [
        # Publishing
        Procedure(
            "wq_publish",
            _p(
                "topic_name:text, message_id:uuid, partition_key:text, attributes:json, "
                "payload:json, payload_ref:json, correlation_id:text, deduplication_key:text, "
                "deduplication_ttl_seconds:int, envelope_bytes:int, external:bool, "
                "published_by:text, not_before:timestamp, delay_seconds:int, priority:int, "
                "caller_announces:bool"
            ),
            _c("message_id:uuid, status, error_code"),
            ResultKind.ONE,
        ),
        Procedure(
            "wq_publish_many",
            _p(
                "topic_name:text, messages:json, external:bool, published_by:text, "
                "caller_announces:bool"
            ),
            _c("item_index:int, message_id:uuid, status, error_code"),
            ResultKind.MANY,
        ),
        Procedure(
            "wq_announce",
            _p("topic_name:text, message_ids:json"),
            _c("announced:bool"),
            ResultKind.ONE,
        ),
        Procedure(
            "wq_lock_topology",
            _p("topic_id:uuid"),
            _c("locked:bool"),
            ResultKind.ONE,
            Grant.OPERATOR,
        ),
        # Claiming and leases
        Procedure(
            "wq_claim",
            _p(
                "subscription_id:uuid, lease_owner:text, max_rows:int, after_key:text, "
                "claim_id:uuid, retake_claim_id:uuid"
            ),
            _CLAIMED,
            ResultKind.MANY,
        ),
        Procedure(
            "wq_expire_leases",
            _p("subscription_id:uuid, batch_size:int"),
            _EXPIRED,
            ResultKind.MANY,
        ),
        Procedure(
            "wq_extend_lease",
            _p("delivery_id:uuid, lease_token:uuid, progress:json"),
            _c("lease_state, lease_expires_at:timestamp"),
            ResultKind.ONE,
        ),
        # Rate limits
        # Deduplication for transports outside these tables: reserve, send, confirm or release
        Procedure(
            "wq_reserve_deduplication",
            _p("topic_name:text, deduplication_key:text, message_id:uuid"),
            _c("status, owner_message_id:uuid"),
            ResultKind.ONE,
        ),
        Procedure(
            "wq_confirm_deduplication",
            _p(
                "topic_name:text, deduplication_key:text, message_id:uuid, "
                "deduplication_ttl_seconds:int"
            ),
            _ROWCOUNT,
            ResultKind.ROWCOUNT,
        ),
        Procedure(
            "wq_release_deduplication",
            _p("topic_name:text, deduplication_key:text, message_id:uuid"),
            _ROWCOUNT,
            ResultKind.ROWCOUNT,
        ),
        Procedure(
            "wq_take_rate_tokens",
            _p("subscription_id:uuid, wanted:int"),
            _c("granted:int, wait_ms:int, full_in_ms:int"),
            ResultKind.ONE,
        ),
        Procedure(
            "wq_return_rate_tokens",
            _p("subscription_id:uuid, unused:int, held_ms:int, full_in_ms:int"),
            _ROWCOUNT,
            ResultKind.ROWCOUNT,
        ),
        # Settling
        Procedure(
            "wq_complete", _p("delivery_id:uuid, lease_token:uuid"), _ROWCOUNT, ResultKind.ROWCOUNT
        ),
        Procedure("wq_complete_many", _p("items:json"), _c("delivery_id:uuid"), ResultKind.MANY),
        Procedure(
            "wq_complete_holding_key",
            _p("delivery_id:uuid, lease_token:uuid"),
            _ROWCOUNT,
            ResultKind.ROWCOUNT,
        ),
        Procedure(
            "wq_release_key",
            _p("delivery_id:uuid, lease_token:uuid"),
            _ROWCOUNT,
            ResultKind.ROWCOUNT,
        ),
        Procedure(
            "wq_retry",
            _p("delivery_id:uuid, lease_token:uuid, delay_seconds:int, error:text"),
            _ROWCOUNT,
            ResultKind.ROWCOUNT,
        ),
        Procedure(
            "wq_dead_letter",
            _p("delivery_id:uuid, lease_token:uuid, reason:text, error:text"),
            _ROWCOUNT,
            ResultKind.ROWCOUNT,
        ),
        Procedure(
            "wq_release", _p("delivery_id:uuid, lease_token:uuid"), _ROWCOUNT, ResultKind.ROWCOUNT
        ),
        Procedure(
            "wq_acknowledge_cancel",
            _p("delivery_id:uuid, lease_token:uuid"),
            _ROWCOUNT,
            ResultKind.ROWCOUNT,
        ),
        # Operators
        Procedure(
            "wq_subscription_stats",
            _p("subscription_id:uuid, cap:int"),
            _c(
                "pending:int, in_flight:int, dead_lettered:int, blocked_keys:int, "
                "oldest_pending_age_seconds:int, completed_last_hour:int, as_of:timestamp, "
                "capped:bool"
            ),
            ResultKind.MANY,
            Grant.OPERATOR,
        ),
        Procedure(
            "wq_queue_gauges",
            _p("subscription_id:uuid, cap:int"),
            _c(
                "pending:int, in_flight:int, dead_lettered:int, blocked_keys:int, "
                "oldest_pending_age_seconds:int"
            ),
            ResultKind.MANY,
            Grant.OPERATOR,
        ),
        Procedure(
            "wq_list_dead_letters",
            _p("subscription_id:uuid, after_delivery_id:uuid, page_size:int, with_payload:bool"),
            _c(
                "delivery_id:uuid, attempt_count:int, dead_letter_reason, last_error, "
                "dead_lettered_at:timestamp, partition_key, blocks_key:bool, message_id:uuid, "
                "topic_name, message_partition_key, attributes:json, payload, "
                "payload_ref:json, correlation_id, published_at:timestamp"
            ),
            ResultKind.MANY,
            Grant.OPERATOR,
        ),
        Procedure(
            "wq_list_partitions",
            _p("subscription_id:uuid, condition:text, after_partition_key:text, page_size:int"),
            _c("kind, partition_key, condition, head_delivery_id:uuid, waiting_items:int"),
            ResultKind.MANY,
            Grant.OPERATOR,
        ),
        Procedure(
            "wq_replay",
            _p("subscription_id:uuid, delivery_id:uuid, actor:text, note:text"),
            _ROWCOUNT,
            ResultKind.ROWCOUNT,
            Grant.OPERATOR,
        ),
        Procedure(
            "wq_resolve_dead_letters",
            _p(
                "subscription_id:uuid, action:text, reason:text, partition_key:text, "
                "dead_lettered_from:timestamp, dead_lettered_before:timestamp, "
                "error_contains:text, after_delivery_id:uuid, batch_size:int, dry_run:bool, "
                "actor:text, note:text"
            ),
            _c("examined:int, changed:int, last_delivery_id:uuid"),
            ResultKind.ONE,
            Grant.OPERATOR,
        ),
        Procedure(
            "wq_discard_pending",
            _p(
                "subscription_id:uuid, keyed:bool, partition_key:text, "
                "published_from:timestamp, published_before:timestamp, error_contains:text, "
                "after_priority:int, after_visible_at:timestamp, after_delivery_id:uuid, "
                "batch_size:int, dry_run:bool, actor:text, reason:text"
            ),
            _c(
                "examined:int, changed:int, last_priority:int, last_visible_at:timestamp, "
                "last_delivery_id:uuid"
            ),
            ResultKind.ONE,
            Grant.OPERATOR,
        ),
        Procedure(
            "wq_discard",
            _p(
                "subscription_id:uuid, delivery_id:uuid, allow_pending:bool, actor:text, "
                "reason:text"
            ),
            _ROWCOUNT,
            ResultKind.ROWCOUNT,
            Grant.OPERATOR,
        ),
        Procedure(
            "wq_cancel",
            _p("subscription_id:uuid, delivery_id:uuid, actor:text, reason:text"),
            _ROWCOUNT,
            ResultKind.ROWCOUNT,
            Grant.OPERATOR,
        ),
        Procedure(
            "wq_backlog",
            _p("subscription_id:uuid, cap:int"),
            _c("claimable:int, in_flight:int"),
            ResultKind.MANY,
            Grant.OPERATOR,
        ),
        Procedure(
            "wq_retire_discard",
            _p("subscription_id:uuid, actor:text, reason:text, batch_size:int"),
            _ROWCOUNT,
            ResultKind.ROWCOUNT,
            Grant.OPERATOR,
        ),
        Procedure(
            "wq_retire_purge",
            _p("subscription_id:uuid, batch_size:int"),
            _ROWCOUNT,
            ResultKind.ROWCOUNT,
            Grant.OPERATOR,
        ),
        Procedure(
            "wq_read_committed_snapshot_state",
            (),
            _c("snapshot_on:bool"),
            ResultKind.ONE,
            Grant.OPERATOR,
        ),
        # Sweeper
        Procedure("wq_expire_leases_all", _p("batch_size:int"), _EXPIRED, ResultKind.MANY),
        Procedure(
            "wq_purge_terminal_deliveries", _p("batch_size:int"), _ROWCOUNT, ResultKind.ROWCOUNT
        ),
        Procedure("wq_purge_orphan_messages", _p("batch_size:int"), _ROWCOUNT, ResultKind.ROWCOUNT),
        Procedure(
            "wq_purge_expired_deduplications", _p("batch_size:int"), _ROWCOUNT, ResultKind.ROWCOUNT
        ),
        Procedure("wq_try_sweep_lock", (), _c("acquired:bool"), ResultKind.ONE),
    ]
}


def granted_to(grant: Grant) -> list[str]:
    """The names of the procedures ``grant`` includes, sorted."""
    return sorted(name for name, procedure in PROCEDURES.items() if procedure.grant is grant)


def get_procedure(name: str) -> Procedure:
    try:
        return PROCEDURES[name]
    except KeyError:
        raise KeyError(f"{name} is not a registered work-queue procedure") from None
