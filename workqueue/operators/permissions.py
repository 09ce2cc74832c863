"""Who may do what, the same for the CLI, the REST API and the admin.

Read operations need the Django permission ``workqueue.view_delivery``; replay, discard and
cancel need ``workqueue.operate_subscription``; payloads are shown only with
``workqueue.view_payload``. Operating has a permission of its own because
``workqueue.change_subscription`` edits a subscription's topic and filter, i.e. where messages
go: an operator need not be able to re-route, nor a topology editor to replay or discard. A
caller using an API key needs the key's scope too (``workqueue:read`` / ``workqueue:operate`` /
``workqueue:publish``), and a key limited to named subscriptions or topics works only on those.
A topic limit confines publishing and a subscription limit reading and operating, so a limited
key must be limited for every scope it holds (``uncovered_scope_problem``). Every check fails
closed.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from workqueue.exceptions import PermissionDeniedError

READ = "workqueue:read"
OPERATE = "workqueue:operate"
PUBLISH = "workqueue:publish"
SCOPES = (PUBLISH, READ, OPERATE)

READ_PERMISSION = "workqueue.view_delivery"
OPERATE_PERMISSION = "workqueue.operate_subscription"
PAYLOAD_PERMISSION = "workqueue.view_payload"
PUBLISH_PERMISSION = "workqueue.add_message"
CHANGE_TRANSPORT_PERMISSION = "workqueue.change_transport"
# The width of Delivery.resolved_by, where replay and discard record who acted.
MAX_ACTOR_NAME_LENGTH = 150


@dataclass(frozen=True, slots=True)
class Actor:
    """The caller of an operation. ``user`` None means a trusted local operator (the CLI,
    which has the database credentials anyway). ``scopes`` is None without an API key."""

    user: Any = None
    scopes: frozenset[str] | None = None
    subscriptions: frozenset[str] = field(default_factory=frozenset)  # empty: any
    topics: frozenset[str] = field(default_factory=frozenset)  # empty: any
    label: str = ""  # with a user: the door it came through, e.g. "API key wq_1a2b3c4d"

    @property
    def name(self) -> str:
        """Who acted, as the operator history records it: the user, followed by the API key
        when the call came with one ("alice via API key wq_1a2b3c4d"). At most
        ``MAX_ACTOR_NAME_LENGTH`` characters; a long user name is shortened, never the key."""
        if self.user is None:
            return self.label or "cli"
        username = self.user.get_username()
        suffix = f" via {self.label}" if self.label else ""
        return username[: MAX_ACTOR_NAME_LENGTH - len(suffix)] + suffix


CLI = Actor(label="cli")


def _has_perm(actor: Actor, permission: str) -> bool:
    if actor.user is None:
        return True
    return bool(actor.user.is_active and actor.user.has_perm(permission))


def _in_limit(limit: Collection[str], name: str) -> bool:
    return not limit or name.strip().lower() in limit


def uncovered_scope_problem(
    scopes: Collection[str], topics: Collection[str], subscriptions: Collection[str]
) -> str | None:
    """Why a key limited this way would still hold one of ``scopes`` unconfined, or None.

    A key limited only to topics that holds the read scope reads every subscription; one
    limited only to subscriptions that holds the publish scope publishes to every topic. Such
    a key looks confined and is not, so it is refused when issued, and refused that scope when
    used (a key issued by an earlier release)."""
    if not topics and not subscriptions:
        return None  # an unlimited key, and meant to be
    if PUBLISH in scopes and not topics:
        return (
            f"A key limited to subscriptions that holds the {PUBLISH} scope could publish to "
            "every topic: a subscription limit confines reading and operating only. Limit "
            f"its topics too (--topics), or leave {PUBLISH} out."
        )
    for scope in (READ, OPERATE):
        if scope in scopes and not subscriptions:
            return (
                f"A key limited to topics that holds the {scope} scope could use it on every "
                "subscription: a topic limit confines publishing only. Limit its subscriptions "
                f"too (--subscriptions), or leave {scope} out."
            )
    return None


def require(
    actor: Actor, scope: str, *, subscription: str | None = None, topic: str | None = None
) -> None:
    """Raise PermissionDeniedError unless ``actor`` may use ``scope`` on the resource."""
    permission = {READ: READ_PERMISSION, OPERATE: OPERATE_PERMISSION, PUBLISH: PUBLISH_PERMISSION}[
        scope
    ]
    if actor.scopes is not None:
        if scope not in actor.scopes:
            raise PermissionDeniedError(f"The API key lacks the {scope} scope.")
        if problem := uncovered_scope_problem({scope}, actor.topics, actor.subscriptions):
            raise PermissionDeniedError(problem)
        if subscription is not None and not _in_limit(actor.subscriptions, subscription):
            raise PermissionDeniedError("The API key is not allowed on this subscription.")
        if topic is not None and not _in_limit(actor.topics, topic):
            raise PermissionDeniedError("The API key is not allowed on this topic.")
    if not _has_perm(actor, permission):
        raise PermissionDeniedError(f"This needs the {permission} permission.")


def may_name_subscription(actor: Actor, name: str) -> bool:
    """Whether ``actor`` may be told that subscription ``name`` exists: an API key limited to
    some subscriptions hears no other's name (in a "did you mean" either)."""
    return actor.scopes is None or _in_limit(actor.subscriptions, name)


def may_view_payload(actor: Actor) -> bool:
    return _has_perm(actor, PAYLOAD_PERMISSION)


def may_call_the_cloud(actor: Actor) -> bool:
    """Whether a transport's cloud API may be called for ``actor`` (a provisioning dry run,
    with the server's credentials): those who may change transports, and the CLI."""
    return _has_perm(actor, CHANGE_TRANSPORT_PERMISSION)
