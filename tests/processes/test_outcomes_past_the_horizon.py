"""A handler that finishes past its local lease horizon while its lease token still holds the
delivery has its outcome recorded (attack review helper-180): nobody can have run it
meanwhile, and the settle is fenced by the token. Real host processes against PostgreSQL."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from tests.factories import SubscriptionFactory
from tests.support.database import psycopg_params
from tests.support.processes import read_events
from tests.support.waiting import wait_until
from workqueue import publish
from workqueue.models import Delivery

pytestmark = [pytest.mark.processes, pytest.mark.usefixtures("queue_db")]


def delivery(message_id: str) -> Delivery:
    return Delivery.objects.get(message_id=message_id)


def test_a_handler_that_finishes_past_its_local_horizon_while_its_token_still_holds_is_recorded(
    processes,
):
    """A Manual-heartbeat handler runs 2 s past its 5 s lease and completes. Nobody took the
    delivery back meanwhile (one host, whose only slot is busy: no claim, and no sweeper pass
    in 600 s), so its token still holds and the fenced wq_complete would take effect
    (README, Guarantees: "until a claim or the sweeper takes an expired delivery back, its
    holder may still renew and settle it (nobody else can have run it)"). The runtime drops
    the outcome without asking the database; the host's next claim then expires the lease and,
    with max_attempts=1, the completed work is dead-lettered LeaseExpired (with more attempts
    left it runs a second time)."""
    sub = SubscriptionFactory(
        handler_key="tests.record",
        lease_seconds=5,
        max_attempts=1,
        heartbeat_mode="Manual",
    )
    host = processes.host(sub.name, concurrency=1)
    message = publish(sub.topic.name, {"sleepMs": 7000, "ignoreSignal": True}).message_id

    # Watch the row from here: what it was when the handler ended is what a settle would meet.
    seen: list[tuple[float, str, int]] = []
    stop = threading.Event()

    def watch() -> None:
        from django.db import connection

        try:
            while not stop.is_set():
                row = Delivery.objects.filter(message_id=message).values_list(
                    "status", "attempt_count"
                )
                for status, attempts in row:
                    seen.append((time.monotonic_ns(), status, attempts))
                time.sleep(0.05)
        finally:
            connection.close()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        wait_until(
            lambda: any(e["event"] == "end" for e in read_events(processes.events)), timeout=30
        )
        wait_until(lambda: delivery(message).status != "InFlight", timeout=30)
    finally:
        stop.set()
        watcher.join(timeout=5)

    (end,) = [e for e in read_events(processes.events) if e["event"] == "end"]
    assert end["attempt"] == 1 and end["signal"] == "LeaseLost"  # told, and finished anyway
    # When the handler ended, the row was still InFlight on its attempt: nobody else had it.
    before_end = [s for s in seen if s[0] <= end["t"]]
    assert before_end and before_end[-1][1:] == ("InFlight", 1)
    final = delivery(message)
    assert (final.status, final.dead_letter_reason) == ("Completed", None), (
        f"the finished handler's outcome was dropped: {final.status} {final.dead_letter_reason} "
        f"attempt {final.attempt_count}; host stderr tail: {host.stderr()[-1500:]}"
    )


def test_after_an_outage_longer_than_the_lease_a_finished_handlers_outcome_is_recorded(processes):
    """Default (Auto) heartbeats. The database refuses this host for 6 s, longer than the 5 s
    lease, while its handler runs (a call to another service, say); it answers again before
    the handler returns and nobody has taken the delivery back (the watcher shows it InFlight
    on attempt 1 when the handler ends). The runtime stops renewing once its local horizon
    passed and drops the outcome unasked, so the delivery is run again after every such
    outage, and a last attempt's finished work is dead-lettered LeaseExpired."""
    from django.db import connection

    sub = SubscriptionFactory(handler_key="tests.record", lease_seconds=5, max_attempts=1)
    host = processes.host(sub.name, concurrency=1)
    message = publish(sub.topic.name, {"sleepMs": 10_000, "ignoreSignal": True}).message_id
    wait_until(lambda: any(e["event"] == "start" for e in read_events(processes.events)))
    name = connection.settings_dict["NAME"]
    # From the maintenance database: a session may not close its own database.
    with psycopg.connect(**{**psycopg_params(), "dbname": "postgres"}, autocommit=True) as admin:
        admin.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
        try:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = %s",
                [f"workqueue:{host.pid}"],
            )
            time.sleep(6.5)  # past the 5 s lease: renewals refused, the horizon passes
        finally:
            admin.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true')

    wait_until(lambda: any(e["event"] == "end" for e in read_events(processes.events)), 30)
    (end,) = [e for e in read_events(processes.events) if e["event"] == "end"]
    # The handler has ended; no settle has been made yet if the row is still this attempt's.
    at_end = delivery(message)
    wait_until(lambda: delivery(message).status != "InFlight", timeout=30)
    final = delivery(message)
    assert (at_end.status, at_end.attempt_count) == ("InFlight", 1) or final.status == "Completed"
    assert end["signal"] == "LeaseLost"
    assert (final.status, final.dead_letter_reason) == ("Completed", None), (
        f"outcome dropped: {final.status} {final.dead_letter_reason}; "
        f"stderr: {host.stderr()[-1500:]}"
    )
