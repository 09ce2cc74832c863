"""Transports: where a topic's messages live (STYLE.md §7).

``Transport.driver_class`` names a transport class through this registry, the way Django maps
``CACHES[...]["BACKEND"]`` to a module: ``transport_class("Database")`` is
``workqueue.transports.database.DatabaseTransport``. Callers read the class's capability flags
(``supports_ordered``, ...) instead of comparing names; nothing above this package names a
transport.
"""

from __future__ import annotations

from functools import cache

from django.utils.module_loading import import_string

from workqueue.exceptions import WorkQueueConfigurationError
from workqueue.transports.base import BaseTransport, TransportReceiver

__all__ = [
    "BaseTransport",
    "TransportReceiver",
    "directory_transport",
    "driver_names",
    "register_transport",
    "transport_class",
    "transport_for",
    "unregister_transport",
]

_REGISTRY: dict[str, str | type[BaseTransport]] = {
    "Database": "workqueue.transports.database.DatabaseTransport",
    # Loaded on first use: boto3 is the optional extra "aws".
    "AWS": "workqueue.transports.aws.AwsTransport",
}


def driver_names() -> list[str]:
    """The names ``Transport.driver_class`` may hold."""
    return sorted(_REGISTRY)


def register_transport(name: str, transport: str | type[BaseTransport]) -> None:
    """Make ``driver_class=name`` mean ``transport`` (a class or its dotted path)."""
    _REGISTRY[name] = transport
    _load.cache_clear()


def unregister_transport(name: str) -> None:
    _REGISTRY.pop(name, None)
    _load.cache_clear()


@cache
def _load(name: str) -> type[BaseTransport]:
    entry = _REGISTRY[name]
    found = import_string(entry) if isinstance(entry, str) else entry
    if not (isinstance(found, type) and issubclass(found, BaseTransport)):
        raise WorkQueueConfigurationError(
            f"Transport {name!r} maps to {entry!r}, which is not a BaseTransport subclass."
        )
    return found


def transport_class(driver_class: str) -> type[BaseTransport]:
    """The transport class ``driver_class`` names; unknown names raise, listing the known."""
    if driver_class not in _REGISTRY:
        raise WorkQueueConfigurationError(
            f"No transport is registered as {driver_class!r}; known: {', '.join(driver_names())}."
        )
    return _load(driver_class)


def transport_for(driver_class: str) -> BaseTransport:
    """An instance of the transport ``driver_class`` names (transports hold no state)."""
    return transport_class(driver_class)()


def directory_transport() -> BaseTransport:
    """The transport to hand a publish by topic name: the Database transport's procedures
    know every topic, publish a Database topic's messages in the same round trip, and answer
    ``TOPIC_ON_OTHER_TRANSPORT`` for a topic of any other transport."""
    return transport_for("Database")
