"""A second, deliberately limited transport for the seam's tests.

``LimitedTransport`` keeps its messages where the Database transport does (it inherits the
procedures) but declares fewer capabilities, so the tests see every refusal the seam promises:
the host's ``Unsupported`` plan, ``validate-bindings``' Error, and the operator surfaces' refusal.
Its receiver records that the runtime claimed through it rather than past it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

from tests.factories import TransportFactory
from workqueue.models import Transport
from workqueue.transport import Receiver
from workqueue.transports import register_transport, unregister_transport
from workqueue.transports.database import DatabaseTransport
from workqueue.types import HeartbeatMode

# A variant of the Database transport: the publish procedures keep the messages of driver
# classes named "Database.<variant>" in the queue tables.
LIMITED = "Database.limited"


class LimitedReceiver(Receiver):
    """The procedures' receiver, counting the claims made through the Limited transport."""

    receives: ClassVar[int] = 0

    def receive(self, max_rows: int) -> Any:
        type(self).receives += 1
        return super().receive(max_rows)


class LimitedTransport(DatabaseTransport):
    """No Ordered partitions, Manual heartbeats, rate limits, replay, cancel, partition
    listing or bulk discard of Pending deliveries."""

    name: ClassVar[str] = "Limited"

    supports_ordered = False
    heartbeat_modes: ClassVar[frozenset[str]] = frozenset({HeartbeatMode.AUTO})
    supports_rate_limit = False
    supports_replay = False
    supports_cancel = False
    supports_partition_listing = False
    supports_bulk_discard_pending = False

    def receiver(self, subscription_id: str, lease_owner: str | None = None) -> Receiver:
        return LimitedReceiver(subscription_id, lease_owner)


@contextmanager
def limited_transport() -> Iterator[Transport]:
    """Register ``LimitedTransport`` as driver_class "Limited" and make a Transport row for it
    (named "Limited"); unregistered on exit."""
    register_transport(LIMITED, LimitedTransport)
    LimitedReceiver.receives = 0
    try:
        yield TransportFactory(name=LIMITED, driver_class=LIMITED)
    finally:
        unregister_transport(LIMITED)
