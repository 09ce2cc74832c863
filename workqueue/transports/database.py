"""The Database transport: messages in this database's queue tables, every write a ``wq_*``
procedure. The procedures' typed wrappers stay in ``workqueue.transport`` (the receiver a
consumer holds is ``workqueue.transport.Receiver`` itself, unwrapped, so the claim and settle
path does exactly the work it did before the seam).

The publish procedures keep in the queue tables the messages of topics whose transport's
driver class is ``Database`` or a variant of it named ``Database.<variant>`` (a subclass that
switches capabilities off, say); for any other driver class they answer
``TOPIC_ON_OTHER_TRANSPORT`` and write nothing."""

from __future__ import annotations

from typing import Any, ClassVar

from workqueue import transport as procedures
from workqueue.conf import setting
from workqueue.transports.base import BaseTransport
from workqueue.types import Backlog, DeadLetterItem, DiscardResult, HeartbeatMode, PartitionItem


class DatabaseTransport(BaseTransport):
    """Every capability: the reference transport."""

    name: ClassVar[str] = "Database"

    supports_exclusive = True
    supports_ordered = True
    heartbeat_modes: ClassVar[frozenset[str]] = frozenset(HeartbeatMode.values)
    supports_rate_limit = True
    supports_external_consumers = False
    supports_deduplication = True
    supports_scheduled_publish = True
    supports_priority = True
    supports_enlisted_publish = True
    supports_replay = True
    supports_cancel = True
    supports_partition_listing = True
    supports_bulk_discard_pending = True
    keeps_deliveries_in_database = True

    def publish(
        self,
        topic: Any,
        messages: list[dict[str, Any]],
        *,
        publisher: str,
        enlist: bool,
        external: bool,
        chosen_message_ids: frozenset[str] = frozenset(),
    ) -> list[dict[str, Any]]:
        # ``topic`` is a name or a Topic: the procedures look the topic up themselves.
        name = topic if isinstance(topic, str) else topic.name
        return procedures.publish(
            name,
            messages,
            publisher,
            setting("DATABASE_ALIAS"),
            enlist,
            external,
            chosen_message_ids,
        )

    def receiver(self, subscription_id: str, lease_owner: str | None = None) -> procedures.Receiver:
        return procedures.Receiver(subscription_id, lease_owner)

    def subscription_stats(
        self, subscription_id: str, cap: int | None = None
    ) -> dict[str, Any] | None:
        return procedures.subscription_stats(subscription_id, cap)

    def backlog(self, subscription_id: str) -> Backlog | None:
        return procedures.backlog(subscription_id)

    def queue_gauges(self, subscription_id: str, cap: int) -> dict[str, Any] | None:
        return procedures.queue_gauges(subscription_id, cap)

    def list_dead_letters(
        self,
        subscription_id: str,
        after_delivery_id: str | None,
        page_size: int,
        *,
        with_payload: bool = True,
    ) -> list[DeadLetterItem]:
        return procedures.list_dead_letters(
            subscription_id, after_delivery_id, page_size, with_payload=with_payload
        )

    def list_partitions(
        self,
        subscription_id: str,
        condition: str | None,
        after_partition_key: str | None,
        page_size: int,
    ) -> tuple[list[PartitionItem], str | None]:
        return procedures.list_partitions(
            subscription_id, condition, after_partition_key, page_size
        )

    def replay(
        self, subscription_id: str, delivery_id: str, actor: str | None, note: str | None
    ) -> bool:
        return procedures.replay(subscription_id, delivery_id, actor, note)

    def discard(
        self, subscription_id: str, delivery_id: str, actor: str | None, reason: str | None
    ) -> DiscardResult:
        return procedures.discard_or_cancel(
            subscription_id, delivery_id, actor, reason, allow_cancel=self.supports_cancel
        )

    def resolve_dead_letters(
        self, subscription_id: str, action: str, selection: dict[str, Any], **options: Any
    ) -> dict[str, Any]:
        return procedures.resolve_dead_letters(subscription_id, action, selection, **options)

    def discard_pending(self, subscription_id: str, **options: Any) -> dict[str, Any]:
        return procedures.discard_pending(subscription_id, **options)
