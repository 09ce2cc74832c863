"""The driver layer: the ONLY place that reads a connection's vendor.

``get_driver(alias)`` returns the driver for a database alias; every other module asks the
driver's methods and ``features`` flags instead of naming a vendor.
"""

from __future__ import annotations

import threading
from typing import Any

from django.db import DatabaseError, InterfaceError, OperationalError, connections

from workqueue.conf import get_settings
from workqueue.driver.base import BaseDriver
from workqueue.exceptions import (
    PrivilegeRefusedError,
    TransientDriverError,
    UnsupportedDatabaseError,
)

_DRIVER_CLASSES = {
    "postgresql": "workqueue.driver.postgresql.PostgresDriver",
    "microsoft": "workqueue.driver.sqlserver.SqlServerDriver",
}
_drivers: dict[str, BaseDriver] = {}
_lock = threading.Lock()


def driver_class_for_vendor(vendor: str) -> type[BaseDriver]:
    from django.utils.module_loading import import_string

    try:
        path = _DRIVER_CLASSES[vendor]
    except KeyError:
        raise UnsupportedDatabaseError(
            f"The work queue supports PostgreSQL and SQL Server; this database is '{vendor}'. "
            "Point DATABASES (or DATABASE_URL) at PostgreSQL or SQL Server (mssql-django)."
        ) from None
    return import_string(path)


def driver_class_for_alias(alias: str) -> type[BaseDriver]:
    """The driver class for database ``alias`` (raises UnsupportedDatabaseError)."""
    return driver_class_for_vendor(connections[alias].vendor)


def get_driver(alias: str = "default") -> BaseDriver:
    """Return the (cached, thread-safe) driver for database ``alias``."""
    driver = _drivers.get(alias)
    if driver is None:
        with _lock:
            driver = _drivers.get(alias)
            if driver is None:
                cls = driver_class_for_alias(alias)
                driver = _drivers[alias] = cls(alias)
    return driver


def close_thread_connections(**kwargs: Any) -> None:
    """Close this thread's private driver connections (connected to ``request_finished``, since
    servers may run each request on a new thread that would otherwise leave one open)."""
    for driver in list(_drivers.values()):
        driver.close()


def close_all_thread_connections() -> None:
    """Close this thread's connections, the driver's private ones and Django's, outright (not
    "if old"): for a thread about to end, which would leave a connection younger than
    ``CONN_MAX_AGE`` open for good."""
    close_thread_connections()
    connections.close_all()


def close_before_database_administration(sender: Any, connection: Any, **kwargs: Any) -> None:
    """Close every thread's private driver connections when Django opens its no-database
    connection (connected to ``connection_created``).

    Django opens that connection only to create, clone or drop a database: the test runners
    (``manage.py test``, pytest-django) through it drop the test database at the end of a run.
    PostgreSQL refuses to drop or clone a database that other sessions are connected to, and
    Django knows nothing of the queue's own connections, so they are closed here, just before.
    Each thread opens a new one at its next call.
    """
    from django.db.backends.base.base import NO_DB_ALIAS

    if connection.alias == NO_DB_ALIAS:
        for driver in list(_drivers.values()):
            driver.close_all()


def refuses_writes(connection: Any) -> bool:
    """Whether Django's open ``connection`` is a session that refuses every write for its life
    (see BaseDriver.session_refuses_writes); False for a vendor the queue does not run on."""
    try:
        # The class, not get_driver(): any alias a handler used may be asked (a project's own
        # databases too), and a driver instance is the queue's, with connections of its own.
        driver_class = driver_class_for_vendor(connection.vendor)
    except UnsupportedDatabaseError:
        return False
    return driver_class.session_refuses_writes(connection)


def in_driver_terms(exc: BaseException) -> BaseException:
    """``exc`` as the queue's driver names it: a Django ``DatabaseError`` (the ORM's own reads
    and writes) translated as the driver translates its own calls' errors (its text then says
    what to do), anything else as it is."""
    if not isinstance(exc, DatabaseError):
        return exc
    return get_driver(get_settings().DATABASE_ALIAS).translate_error(exc)


def database_away(exc: BaseException) -> bool:
    """Whether ``exc``, from the driver or the ORM, says the database is away, restarting or
    refusing writes for now: a failure that a later try, on a new connection, gets past."""
    # Django's OperationalError and InterfaceError are the ORM's connection failures; others
    # (its InternalError for a read-only server) are judged as the driver judges its own.
    if isinstance(exc, (TransientDriverError, OperationalError, InterfaceError)):
        return True
    return isinstance(in_driver_terms(exc), TransientDriverError)


def refused_a_grant(exc: BaseException) -> bool:
    """Whether ``exc``, from the driver or the ORM, is the database refusing the role a
    privilege (a missing grant): every call needing it fails alike until a DBA grants it."""
    return isinstance(in_driver_terms(exc), PrivilegeRefusedError)


def binary_collation(connection: Any) -> str:
    """The collation that makes keys compare byte for byte on ``connection``'s vendor."""
    return driver_class_for_vendor(connection.vendor).features.binary_collation


def driver_for_connection(connection: Any) -> BaseDriver:
    """The driver for an open Django connection (used by migrations, which get one)."""
    return get_driver(connection.alias)


__all__ = [
    "BaseDriver",
    "binary_collation",
    "close_before_database_administration",
    "close_thread_connections",
    "database_away",
    "driver_for_connection",
    "get_driver",
    "in_driver_terms",
    "refused_a_grant",
    "refuses_writes",
]
