"""A host whose database goes silent finishes its work over the path that replaced it.

The database fails over the way a load balancer or a cloud database's DNS does it: new
connections reach the server at a new address, while the old path forgets its connections
without closing them, so nothing sent on one is answered or refused. A handler that finishes
then must still get its result recorded while its lease lasts: the completion sent on the old
connection has to fail (the queue's own connections give up on unacknowledged writes after
30 s) and be retried on a fresh connection. Without that, it waits for as long as the kernel
retransmits (about a quarter of an hour), past the lease, and the work runs again.

The paths are real: veth pairs into a network namespace (``tests/support/silent_network.py``).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from django.db import connections

from tests.support.database import (
    delivery_of_message,
    queue_connection_settings,
)
from tests.support.handlers import probe
from tests.support.hosts import one, sub
from tests.support.silent_network import PORT, silent_network
from tests.support.waiting import wait_until
from workqueue import publish
from workqueue.driver import get_driver

pytestmark = pytest.mark.usefixtures("queue_db")

# Far longer than the detection (30 s): only the completion's retry can finish it in time.
LEASE_SECONDS = 120


def _server_socket() -> Path:
    settings = connections[get_driver().alias].settings_dict
    server_socket = Path(settings["HOST"] or "/nonexistent") / f".s.PGSQL.{settings['PORT']}"
    if not server_socket.is_socket():
        pytest.skip("the test database is not reached through a Unix socket")
    return server_socket


def test_a_completion_sent_to_a_database_that_went_silent_is_retried_over_the_new_path(
    make_host,
):
    s = sub(lease_seconds=LEASE_SECONDS)
    with (
        silent_network(_server_socket()) as network,
        queue_connection_settings(options={}, HOST=network.address("a"), PORT=PORT),
    ):
        get_driver().close_all()  # every queue connection from now on goes over path a
        host = make_host(one(s, concurrency=1))
        host.start()
        # The first opens the connections the second's completion will be sent on.
        first = publish(s.topic.name, {"then": "complete"}).message_id
        second = publish(s.topic.name, {"sleepMs": 3_000}).message_id
        probe.wait_for(1, message_id=second)
        wait_until(lambda: delivery_of_message(first) == ("Completed", 1), timeout=10)

        network.go_silent("a")
        silent_since = time.monotonic()
        with queue_connection_settings(options={}, HOST=network.address("b")):
            while delivery_of_message(second)[0] != "Completed":
                waited = time.monotonic() - silent_since
                assert waited < 90, f"still {delivery_of_message(second)} {waited:.0f} s on"
                time.sleep(0.2)
            completed_after = time.monotonic() - silent_since
            # The host's last health record is written on this thread's Django connection,
            # which its start may have opened over path a (when CONN_MAX_AGE had closed the
            # one before); Django's connections take the alias's OPTIONS only, which set no
            # TCP timeout here, so it waited out the kernel's retransmissions (a CI-like run
            # hung 5 minutes and more). Over path b, as a restarted host's would be.
            connections[get_driver().alias].close()
            host.shutdown()

    assert delivery_of_message(second) == ("Completed", 1)  # recorded, never run again
    assert completed_after < LEASE_SECONDS / 2
    assert (host.abandoned_handlers, host.unsettled_outcomes) == (0, 0)
