"""The queue's own connections give up on a database that stops answering without closing them.

A failover behind a load balancer, or a network path that drops, leaves a connection open with
nobody at the other end: a settle or a lease renewal sent on it would wait for an answer for as
long as the kernel retransmits (about a quarter of an hour on Linux), past the lease, instead
of failing and being retried on a fresh connection while the lease lasts. The connections set
TCP keepalives and a TCP user timeout unless the alias's ``OPTIONS`` set them. These tests check
the settings; ``tests/runtime/test_silent_database.py`` makes a database go silent for real and
checks what a host does then.
"""

from __future__ import annotations

import pytest

from tests.support.database import queue_connection_settings
from workqueue.driver import get_driver

pytestmark = pytest.mark.usefixtures("queue_db")


def _queue_connection_parameters() -> dict[str, str]:
    driver = get_driver()
    driver.execute("SELECT 1", [])
    return driver._local.raw.connection.info.get_parameters()


def test_the_queue_connections_detect_a_silent_database_within_half_a_minute():
    get_driver().close()  # a connection opened now, with the project's settings as they are

    parameters = _queue_connection_parameters()

    assert {
        name: parameters.get(name)
        for name in ("keepalives", "keepalives_idle", "keepalives_interval", "keepalives_count")
    } == {
        "keepalives": "1",
        "keepalives_idle": "10",
        "keepalives_interval": "5",
        "keepalives_count": "3",
    }
    assert parameters.get("tcp_user_timeout") == "30000"


def test_the_connection_that_holds_the_sweepers_lock_detects_one_too():
    """The sweeper holds its lock in a transaction for a whole pass: its commit must not wait
    a quarter of an hour for a database that is gone."""
    driver = get_driver()
    driver.close()
    with driver.transaction() as connection:
        parameters = connection.connection.info.get_parameters()

    assert (parameters.get("keepalives_idle"), parameters.get("tcp_user_timeout")) == (
        "10",
        "30000",
    )


def test_the_alias_options_set_their_own_detection():
    driver = get_driver()
    with queue_connection_settings(options={"keepalives_idle": 120, "tcp_user_timeout": 0}):
        driver.close()
        try:
            parameters = _queue_connection_parameters()
        finally:
            driver.close()

    assert (parameters.get("keepalives_idle"), parameters.get("tcp_user_timeout")) == ("120", "0")
    assert parameters.get("keepalives_count") == "3"  # what they leave out keeps its default
