"""A host frozen with its connections open must not fill the server's notification queue.

PostgreSQL keeps each notification until every session listening on its channel has handed it
to its client. A host process that stops reading (SIGSTOP, a paused VM, a hung wake-up thread)
keeps its listening session open (its kernel still holds the socket), the session blocks
writing to it, and the queue grows by one entry per publish until, at some hundreds of millions
(8 GB), every publish fails at its commit: one frozen host stops every publisher of the server.
The sweeper disconnects such a session once the queue is filling, and the host reconnects when
it resumes.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

import pytest

from tests.support.processes import hello
from tests.support.waiting import wait_until
from workqueue import publish, transport
from workqueue.models import Delivery
from workqueue.operators.operations import database_warnings
from workqueue.runtime.sweeper import Sweeper

pytestmark = [pytest.mark.processes, pytest.mark.usefixtures("queue_db")]

#: Announcements sent on the frozen host's channel: enough to fill the socket buffers between
#: its session and it many times over (~30 bytes of queue each).
ANNOUNCEMENTS = 200_000


def listening_session(pg_conn: Any, host_pid: int) -> tuple[int, Any]:
    """(pid, backend start) of the session a host process listens on, once it has listened."""

    def found() -> tuple[int, Any] | None:
        return pg_conn.execute(
            "SELECT pid, backend_start FROM pg_stat_activity "
            "WHERE application_name = %s AND query LIKE 'LISTEN %%'",
            [f"workqueue:{host_pid}"],
        ).fetchone()

    return wait_until(found)


def wait_event(pg_conn: Any, pid: int) -> str | None:
    row = pg_conn.execute(
        "SELECT wait_event FROM pg_stat_activity WHERE pid = %s", [pid]
    ).fetchone()
    return row[0] if row else None


def queue_usage(pg_conn: Any) -> float:
    # A notification makes the server move the queue's tail past what every listener has read.
    pg_conn.execute("SELECT pg_notify('wq_test_tail', '')")
    return pg_conn.execute("SELECT pg_notification_queue_usage()").fetchone()[0]


def test_a_frozen_hosts_listener_is_disconnected_before_it_fills_the_notification_queue(
    processes, pg_conn, monkeypatch, caplog
):
    frozen_sub = hello()
    working_sub = hello(topic=frozen_sub.topic)
    frozen = processes.host(frozen_sub.name)
    working = processes.host(working_sub.name)
    frozen_session = listening_session(pg_conn, frozen.pid)
    working_session = listening_session(pg_conn, working.pid)
    (channel,) = pg_conn.execute("SELECT wq_topic_channel(%s)", [frozen_sub.topic_id]).fetchone()
    frozen.popen.send_signal(signal.SIGSTOP)
    try:
        # Payloads that name no subscription: announcements that kick nobody.
        pg_conn.execute(
            "SELECT count(pg_notify(%s, g::text)) FROM generate_series(1, %s) g",
            [channel, ANNOUNCEMENTS],
        )
        wait_until(lambda: wait_event(pg_conn, frozen_session[0]) == "ClientWrite")
        wait_until(lambda: wait_event(pg_conn, working_session[0]) == "ClientRead")
        filled = queue_usage(pg_conn)
        assert filled > 0
        # 1 % in production; what this test sent is a few hundredths of that.
        monkeypatch.setattr(transport, "NOTIFICATION_QUEUE_WARNING_USAGE", filled / 2)
        [warning] = [w for w in database_warnings() if "notification queue" in w]
        assert "wait_event ClientWrite" in warning

        with caplog.at_level(logging.WARNING, logger="workqueue.runtime.sweeper"):
            result = Sweeper().run_once()

        assert result.released_listeners == 1, caplog.text
        assert not result.failed_steps
        wait_until(lambda: wait_event(pg_conn, frozen_session[0]) is None)
        wait_until(lambda: queue_usage(pg_conn) < filled / 2)
        [released] = [r for r in caplog.records if r.action == "stalled_listener_released"]
        assert f"session {frozen_session[0]} " in released.getMessage()
        # The host that reads its notifications keeps its session.
        assert listening_session(pg_conn, working.pid) == working_session
        assert not [w for w in database_warnings() if "notification queue" in w]
    finally:
        frozen.popen.send_signal(signal.SIGCONT)

    # Resumed, the frozen host listens again on a new session and runs what it is given.
    wait_until(lambda: listening_session(pg_conn, frozen.pid) != frozen_session, timeout=30)
    message = publish(frozen_sub.topic.name, {}).message_id
    done = Delivery.objects.filter(message_id=message, status="Completed")
    wait_until(lambda: done.count() == 2, timeout=30)


def test_a_queue_filling_with_no_stalled_session_here_is_reported_with_where_to_look(
    pg_conn, monkeypatch, caplog
):
    """Nothing of this database holds the queue (another database's listener does, or this
    test's zero threshold): nothing is disconnected, and the sweeper says where to look."""
    monkeypatch.setattr(transport, "NOTIFICATION_QUEUE_WARNING_USAGE", 0.0)

    with caplog.at_level(logging.ERROR, logger="workqueue.runtime.sweeper"):
        result = Sweeper().run_once()

    assert result.released_listeners == 0
    [report] = [r for r in caplog.records if r.action == "notification_queue_full"]
    assert "wait_event ClientWrite" in report.getMessage()
