"""A host and a publisher against a PostgreSQL that misbehaves the way it does at night, each
provoked for real on the test server: no work is lost or run twice, both recover by themselves
when the database does, and the operator is told what is wrong once.

A read-only server is what a failover leaves a client that reconnected to the old primary, now a
standby, or to a database whose DBA set ``default_transaction_read_only``. Here the database's
default is turned on and the queue's sessions are ended, as a failover ends them: the sessions
the host and the publisher open again are read-only, and stay so after the default is reset,
as a session on a standby stays one after DNS points at the new primary.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from tests.support.database import delivery_of_message, psycopg_params
from tests.support.hosts import one, states, sub
from tests.support.waiting import wait_until
from workqueue import publish
from workqueue.types import PublishErrorCode, PublishStatus

pytestmark = pytest.mark.usefixtures("queue_db")


class ReadOnly:
    """Turns the test database read-only for new sessions and back, from a session opened
    before (``pg_conn``)."""

    def __init__(self, admin: psycopg.Connection) -> None:
        self.admin = admin
        (self.database,) = admin.execute("SELECT current_database()").fetchone()

    def on(self) -> None:
        self.admin.execute(
            f'ALTER DATABASE "{self.database}" SET default_transaction_read_only = on'
        )
        # A failover ends every session; the queue's reconnect to the read-only server.
        self.admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND application_name LIKE 'workqueue:%%'"
        )

    def off(self) -> None:
        self.admin.execute(f'ALTER DATABASE "{self.database}" RESET default_transaction_read_only')


@pytest.fixture
def read_only(pg_conn) -> Iterator[ReadOnly]:
    from django.db import connection

    switch = ReadOnly(pg_conn)
    try:
        yield switch
    finally:
        switch.off()
        connection.close()  # one opened meanwhile is read-only: the test's flush needs another


def test_a_settle_refused_by_a_read_only_server_goes_through_once_it_is_writable_again(
    make_host, read_only, caplog
):
    """A completion refused with SQLSTATE 25006 failed at once ("Delivery settle failed",
    ERROR, per delivery), left to its lease to be run a second time; and the session it was
    refused on was kept, so even once the primary was back every settle, claim and publish of
    the process failed on it until a restart."""
    caplog.set_level(logging.INFO, logger="workqueue")
    s = sub(lease_seconds=60)
    host = make_host(one(s, concurrency=1))
    host.start()
    message = publish(s.topic.name, {"sleepMs": 1000}).message_id
    wait_until(lambda: delivery_of_message(message)[0] == "InFlight", timeout=10)

    read_only.on()
    wait_until(lambda: "read-only" in caplog.text, timeout=10)  # the completion was refused
    time.sleep(0.5)  # a few tries
    read_only.off()  # the sessions already open stay read-only

    wait_until(lambda: delivery_of_message(message) == ("Completed", 1), timeout=10)
    later = publish(s.topic.name, {}).message_id
    wait_until(lambda: delivery_of_message(later) == ("Completed", 1), timeout=10)
    assert "Running" in states(host)[s.name][0]
    said = [r for r in caplog.records if "read-only" in r.getMessage()]
    assert said and all(r.levelno <= logging.WARNING for r in said), [
        (r.levelname, r.getMessage()) for r in said
    ]
    assert "primary" in said[0].getMessage()  # what to do about it
    assert not [r for r in caplog.records if r.exc_info]


def test_a_publish_to_a_read_only_server_is_retryable_and_the_next_one_goes_through(
    read_only,
):
    """A publish refused as read-only raised a plain DriverError quoting the procedure's SQL
    (a 500, or a traceback, for a caller told that failures come back as TransportUnavailable),
    and the process's connection stayed read-only: every later publish failed too."""
    from tests.factories import TopicFactory

    topic = TopicFactory()
    publish(topic.name, {})  # the thread's connection is open before the failover
    read_only.on()

    refused = publish(topic.name, {})

    assert refused.status == PublishStatus.REJECTED
    assert refused.error.code == PublishErrorCode.TRANSPORT_UNAVAILABLE
    assert "read-only" in refused.error.message and "primary" in refused.error.message
    read_only.off()
    assert publish(topic.name, {}).status == PublishStatus.ACCEPTED


@pytest.mark.parametrize("in_a_transaction", [False, True], ids=["call", "transaction"])
def test_a_session_refused_as_read_only_is_closed_and_the_next_call_opens_a_writable_one(
    in_a_transaction,
):
    """Both of the driver's paths: its calls (claims, settles, publishes) and its transactions
    (the sweeper's lock, operators' bulk batches). The refused session was kept."""
    from workqueue.driver import get_driver
    from workqueue.exceptions import TransientDriverError

    driver = get_driver()

    def run(sql: str) -> list[tuple]:
        if not in_a_transaction:
            return driver.execute(sql, [])
        with driver.transaction() as connection, connection.cursor() as cursor:
            cursor.execute(sql)
            return cursor.fetchall() if cursor.description else []

    run("SET default_transaction_read_only = on")  # this session only, for its life
    [(refused_on,)] = run("SELECT pg_backend_pid()")
    with pytest.raises(TransientDriverError) as caught:
        run("CREATE TEMPORARY SEQUENCE wq_read_only_probe")
    assert "read-only" in str(caught.value) and "\n" not in str(caught.value)

    [(next_on,)] = run("SELECT pg_backend_pid()")
    assert next_on != refused_on
    run("CREATE TEMPORARY SEQUENCE wq_read_only_probe")  # writable


def test_a_settle_cancelled_by_a_statement_timeout_is_tried_again_while_the_lease_lasts(
    make_host, pg_conn, caplog
):
    """A DBA's statement_timeout on the database (SQLSTATE 57014) cancelled a completion that
    waited on a row lock: it failed at once (ERROR), and the handled delivery ran again once its
    lease expired. The same call goes through a moment later."""
    caplog.set_level(logging.INFO, logger="workqueue")
    (database,) = pg_conn.execute("SELECT current_database()").fetchone()
    s = sub(lease_seconds=60)
    host = make_host(one(s, concurrency=1))
    host.start()
    message = publish(s.topic.name, {"sleepMs": 1000}).message_id
    wait_until(lambda: delivery_of_message(message)[0] == "InFlight", timeout=10)
    pg_conn.execute(f'ALTER DATABASE "{database}" SET statement_timeout = 300')
    try:
        pg_conn.execute(  # the queue's sessions open again with the DBA's timeout
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND application_name LIKE 'workqueue:%%'"
        )
        with pg_conn.transaction():  # holds the row past the timeout
            pg_conn.execute(
                "SELECT 1 FROM workqueue_delivery WHERE message_id = %s FOR UPDATE", [message]
            )
            wait_until(lambda: "statement timeout" in caplog.text, timeout=10)
    finally:
        pg_conn.execute(f'ALTER DATABASE "{database}" RESET statement_timeout')

    wait_until(lambda: delivery_of_message(message) == ("Completed", 1), timeout=10)
    said = [r for r in caplog.records if "statement timeout" in r.getMessage()]
    assert all(r.levelno <= logging.WARNING for r in said), [
        (r.levelname, r.getMessage()) for r in said
    ]
    assert "statement_timeout" in said[0].getMessage()  # which setting it was


def test_a_claim_cut_off_inside_the_procedure_is_told_in_one_line_without_its_sql(
    make_host, pg_conn, caplog
):
    """A session ended while its claim ran in the procedure (a failover, a proxy's restart, a
    DBA's pg_terminate_backend) logged "not claiming until the database answers again" with the
    server's CONTEXT: a dozen lines of the procedure's SQL in the log and in the health reason
    operators read, where every other outage message is one line (seen in the chaos run with
    the hosts' sessions cut)."""
    caplog.set_level(logging.INFO, logger="workqueue")
    s = sub()
    host = make_host(one(s, concurrency=1))
    host.start()
    wait_until(lambda: states(host)[s.name][0] == "Running", timeout=10)
    # The next claim waits inside the procedure, and is cut there. Locked from a session of
    # its own: pg_conn's reads of pg_stat_activity must each see it afresh.
    with psycopg.connect(autocommit=True, **psycopg_params()) as locker, locker.transaction():
        locker.execute("LOCK TABLE workqueue_delivery IN ACCESS EXCLUSIVE MODE")
        wait_until(
            lambda: pg_conn.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock' "
                "AND application_name LIKE 'workqueue:%%' AND query LIKE '%%wq_claim%%'"
            ).fetchone()[0],
            timeout=10,
        )
        wait_until(lambda: "not claiming until" in caplog.text, timeout=10)
        reason = states(host)[s.name][1]

    (said,) = [r.getMessage() for r in caplog.records if "not claiming until" in r.getMessage()]
    assert "terminating connection" in said and "terminating connection" in reason
    for text in (said, reason):
        assert "\n" not in text and "CONTEXT" not in text and "workqueue_delivery" not in text


def _start_with_reads_cut_off(
    pg_conn: psycopg.Connection, start: Any, table: str, enough: Any
) -> Any:
    """Run ``start`` on a thread while ``table`` is locked, ending each session that waits on
    it (a failover as a host starts, a proxy's restart) until ``enough(sessions_cut)``; then
    let the lock go, and return what ``start`` returned (or raised)."""
    from django.db import connections

    answer: list[Any] = []

    def run() -> None:
        try:
            answer.append(start())
        except Exception as exc:
            answer.append(exc)
        finally:
            connections.close_all()  # this thread's

    starting = threading.Thread(target=run, name="test-start")
    cut = 0
    # Locked from a session of its own: pg_conn's reads of pg_stat_activity must each see it
    # afresh, which they do not within one transaction.
    with psycopg.connect(autocommit=True, **psycopg_params()) as locker, locker.transaction():
        locker.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        starting.start()

        def cut_enough() -> bool:
            nonlocal cut
            (ended,) = pg_conn.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock' "
                "AND query LIKE %s AND pid <> pg_backend_pid()",
                [f"%{table}%"],
            ).fetchone()
            cut += ended
            return enough(cut) or not starting.is_alive()

        wait_until(cut_enough, timeout=20)
    starting.join(30)
    assert not starting.is_alive()
    return answer[0]


def test_a_host_whose_first_plan_was_cut_off_runs_as_soon_as_a_plan_goes_through(
    make_host, pg_conn, caplog
):
    """A host whose first plan was cut off (its read of the subscriptions' topics here) ran
    nothing until its next re-plan, RECONCILE_INTERVAL_MS later (30 s by default): a host
    restarted during a failover sat idle with its work waiting (seen in the chaos run with the
    hosts' sessions cut: a restarted host never reported its subscriptions Running)."""
    caplog.set_level(logging.INFO, logger="workqueue")
    s = sub()
    host = make_host(one(s, concurrency=1), reconcile_interval_ms=60_000)

    started = _start_with_reads_cut_off(
        pg_conn, host.start, "workqueue_topic", lambda _: host.planning_failure is not None
    )
    message = publish(s.topic.name, {}).message_id

    assert started is None and "Planning failed" in caplog.text
    wait_until(lambda: delivery_of_message(message)[0] == "Completed", timeout=10)
    assert states(host)[s.name] == ("Running", "")
    assert "Planning again" in caplog.text
    # Said once it runs them (review helper-169): its start said it ran no subscription, and
    # under a LOGGING that shows this the command no longer prints them itself.
    assert f"planned: {s.name}: Running, concurrency 1" in caplog.text


def test_a_host_planning_nothing_after_a_cut_plans_again_with_re_planning_off(make_host, pg_conn):
    """Review helper-154: with RECONCILE_INTERVAL_MS = 0 (no re-plans) there was no service
    to try a failed first plan again: the host ran nothing for good."""
    s = sub()
    host = make_host(one(s, concurrency=1), reconcile_interval_ms=0)

    _start_with_reads_cut_off(
        pg_conn, host.start, "workqueue_topic", lambda _: host.planning_failure is not None
    )

    wait_until(lambda: states(host).get(s.name, ("",))[0] == "Running", timeout=10)


def test_a_one_shot_run_whose_first_plan_was_cut_off_plans_again_and_runs(make_host, pg_conn):
    """A one-shot job (``workqueue_work --once``) whose first plan was cut off exited 2,
    "Could not plan the subscriptions", for a blip its claims would have been retried past."""
    s = sub()
    message = publish(s.topic.name, {}).message_id
    host = make_host(one(s, concurrency=1))

    result = _start_with_reads_cut_off(
        pg_conn,
        lambda: host.run_once(idle_exit_ms=300),
        "workqueue_topic",
        lambda _: host.planning_failure is not None,
    )

    assert result.planning_failure is None and result.could_not_run == []
    assert result.processed == 1
    assert delivery_of_message(message)[0] == "Completed"


def test_a_one_shot_run_whose_plans_keep_failing_keeps_to_its_max_duration(make_host, pg_conn):
    """A one-shot job planning again after a cut spent up to 3 s in its plan retries whatever
    its ``--max-duration-ms``: a job given one second planned three times and ended as "Idle"
    (review helper-154's leftover)."""
    host = make_host(one(sub(), concurrency=1))
    plans = 0

    def count_plans(cut: int) -> bool:
        nonlocal plans
        plans = cut
        return False

    result = _start_with_reads_cut_off(
        pg_conn,
        lambda: host.run_once(idle_exit_ms=300, max_duration_ms=1000),
        "workqueue_topic",
        count_plans,
    )

    assert result.reason == "MaxDuration"
    assert result.planning_failure is not None
    assert plans <= 2, f"planned {plans} times in a one-second run"


def test_a_host_whose_start_up_read_was_cut_off_reads_again_and_starts(make_host, pg_conn):
    """A host's reads before it plans (the system user, the queue's tables) cut off by a
    failover ended its start with a traceback (review helper-154)."""
    s = sub()
    host = make_host(one(s, concurrency=1))

    started = _start_with_reads_cut_off(
        pg_conn, host.start, "workqueue_subscription", lambda cut: cut >= 1
    )

    assert started is None
    wait_until(lambda: states(host)[s.name][0] == "Running", timeout=10)


def test_a_host_whose_start_up_reads_keep_failing_ends_its_start(make_host, pg_conn):
    """A database that stays away, or that refuses the host the same way every time (a wrong
    password or database name reads as away too), ends the start after three tries, as it
    always did, instead of keeping a host up that runs nothing."""
    from django.db import DatabaseError

    host = make_host(one(sub(), concurrency=1))

    started = _start_with_reads_cut_off(
        pg_conn, host.start, "workqueue_subscription", lambda _: False
    )

    assert isinstance(started, DatabaseError), started


def test_settles_refused_for_a_grant_stop_the_claims_in_health_until_it_is_given_back(
    make_host, pg_conn, caplog
):
    """A DBA's REVOKE of the completion procedures (SQLSTATE 42501) from the hosts' role: the
    host went on claiming everything at full speed, ran every handler, lost every outcome (an
    ERROR each, not naming the fix), and reported itself Running and healthy while each
    delivery ran again at lease expiry until it was dead-lettered as LeaseExpired."""
    from tests.support.roles import acting_as_granted_role
    from workqueue.models import Delivery

    caplog.set_level(logging.INFO, logger="workqueue")
    s = sub(lease_seconds=5, max_attempts=3)
    with acting_as_granted_role(pg_conn, "wq_rt", "grant-runtime") as role:
        pg_conn.execute(f'GRANT SELECT ON auth_user TO "{role}"')  # the system user's lookup
        completions = _signatures(pg_conn)
        host = make_host(one(s, concurrency=2))
        host.start()
        _revoke(pg_conn, role, completions)

        first = publish(s.topic.name, {}).message_id
        wait_until(lambda: states(host)[s.name][0] == "Error", timeout=10)
        later = [publish(s.topic.name, {}).message_id for _ in range(4)]
        time.sleep(1.5)
        state, reason = states(host)[s.name]
        claimed = Delivery.objects.filter(message_id__in=later, attempt_count__gt=0).count()
        _grant(pg_conn, role, completions)

        assert state == "Error" and "permission denied" in reason, reason
        assert "grant-runtime" in reason  # the fix
        assert claimed <= 1, claimed  # one at a time, not all four run for nothing
        for message in later:
            wait_until(lambda m=message: delivery_of_message(m)[0] == "Completed", timeout=15)
        wait_until(lambda: delivery_of_message(first)[0] == "Completed", timeout=15)
        assert states(host)[s.name] == ("Running", "")
        host.shutdown()
    told = [r for r in caplog.records if getattr(r, "action", None) == "settles_refused"]
    assert len(told) == 1 and "grant-runtime" in told[0].getMessage()
    assert "outcomes are recorded again" in caplog.text


@pytest.mark.parametrize(
    ("refused", "payload"),
    [
        (("wq_complete", "wq_complete_many"), {}),
        (("wq_retry",), {"then": "retry", "delay": 0}),  # review helper-154
    ],
    ids=["completions", "retries"],
)
def test_an_idle_subscription_whose_settles_were_refused_reads_running_once_the_grant_is_back(
    make_host, pg_conn, caplog, refused, payload
):
    """With nothing left to probe settles with (the refused delivery waits out its lease, or
    was on its last attempt), a subscription read Error, "the database refuses to record
    outcomes", after the DBA had given the grant back: for the whole lease, or until new work
    arrived. An operator who fixed the grant at night saw the host still failing. It reads
    Error while any way of settling is refused, not only the completions (a grant missing for
    one procedure read as fixed after every empty claim)."""
    from tests.support.roles import acting_as_granted_role

    caplog.set_level(logging.INFO, logger="workqueue")
    s = sub(lease_seconds=120, max_attempts=3)
    with acting_as_granted_role(pg_conn, "wq_rt", "grant-runtime") as role:
        pg_conn.execute(f'GRANT SELECT ON auth_user TO "{role}"')  # the system user's lookup
        signatures = _signatures(pg_conn, refused)
        host = make_host(one(s, concurrency=1))
        host.start()
        _revoke(pg_conn, role, signatures)
        message = publish(s.topic.name, payload).message_id
        wait_until(lambda: states(host)[s.name][0] == "Error", timeout=10)
        time.sleep(1)  # several empty claims, each followed by the question
        still_refused = states(host)[s.name]
        _grant(pg_conn, role, signatures)

        assert still_refused[0] == "Error", still_refused
        wait_until(lambda: states(host)[s.name] == ("Running", ""), timeout=10)
        assert delivery_of_message(message) == ("InFlight", 1)  # nothing ran it again
        host.shutdown()
    assert "outcomes are recorded again" in caplog.text


def test_a_claim_refused_during_a_settles_refusal_does_not_keep_an_idle_subscription_in_error(
    make_host, pg_conn, caplog
):
    """Review helper-155: a claim that failed while settles were refused (the whole grant
    taken away) left its reason in health after claims went through again, and the settle
    probe, asked only while the refusal was health's reason, was never asked again: the idle
    subscription read Error after every grant was back."""
    from tests.support.roles import acting_as_granted_role

    caplog.set_level(logging.INFO, logger="workqueue")
    s = sub(lease_seconds=120, max_attempts=3)
    with acting_as_granted_role(pg_conn, "wq_rt", "grant-runtime") as role:
        pg_conn.execute(f'GRANT SELECT ON auth_user TO "{role}"')  # the system user's lookup
        completions, claims = _signatures(pg_conn), _signatures(pg_conn, ("wq_claim",))
        host = make_host(one(s, concurrency=1))
        host.start()
        _revoke(pg_conn, role, completions)
        publish(s.topic.name, {})
        wait_until(lambda: states(host)[s.name][0] == "Error", timeout=10)
        _revoke(pg_conn, role, claims)
        wait_until(lambda: "wq_claim" in states(host)[s.name][1], timeout=20)
        _grant(pg_conn, role, [*claims, *completions])

        wait_until(lambda: states(host)[s.name] == ("Running", ""), timeout=30)
        host.shutdown()


def test_sweeper_passes_failing_through_a_read_only_spell_are_told_once_and_their_end_once(
    read_only, caplog
):
    """Each of a host's sweeper passes that failed while the database refused writes (or was
    away) logged "wq-sweeper pass failed" at ERROR with a traceback: a traceback a minute for
    as long as the spell lasted, on every host."""
    from workqueue.runtime.service import PeriodicService
    from workqueue.runtime.sweeper import Sweeper, pause_after

    caplog.set_level(logging.INFO, logger="workqueue.runtime")
    service = PeriodicService("wq-sweeper", 0.05, Sweeper().run_once, pause=pause_after)
    read_only.on()
    service.start()
    try:
        wait_until(lambda: "read-only" in caplog.text, timeout=10)
        time.sleep(0.5)  # passes go on failing
        read_only.off()
        wait_until(lambda: "passes work again" in caplog.text, timeout=10)
    finally:
        service.stop()

    said = [
        (r.levelname, r.getMessage())
        for r in caplog.records
        if r.name == "workqueue.runtime.service" and r.levelno >= logging.INFO
    ]
    assert [level for level, _ in said] == ["WARNING", "INFO"], said
    assert "read-only" in said[0][1] and "\n" not in said[0][1]
    assert not [r for r in caplog.records if r.exc_info]


def test_a_sweeper_step_whose_session_is_cut_says_so_in_a_line_and_the_next_pass_runs(
    pg_conn, caplog
):
    """A session ended under a sweeper pass (a failover, a proxy's restart, a DBA's
    pg_terminate_backend) logged "Sweeper: expiring leases failed" at ERROR with a traceback,
    where a consumer whose claim is cut the same way says so in a WARNING line: an alert on
    ERROR paged for every failover that happened to land on a pass."""
    import os

    from workqueue import transport
    from workqueue.runtime.sweeper import Sweeper

    caplog.set_level(logging.INFO, logger="workqueue")
    transport.expire_leases_all(1)  # opens this thread's session, which the pass's steps use
    (cut,) = pg_conn.execute(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = %s",
        [f"workqueue:{os.getpid()}"],
    ).fetchone()
    assert cut == 1

    sweeper = Sweeper()  # as a host's, one for every pass
    cut_off = sweeper.run_once()
    after = sweeper.run_once()

    assert cut_off.failed_steps == ["expired_leases"]  # the purges ran on a new session
    assert after.failed_steps == []
    said = [
        (r.levelname, r.getMessage())
        for r in caplog.records
        if r.name == "workqueue.runtime.sweeper" and r.levelno >= logging.WARNING
    ]
    assert len(said) == 1 and said[0][0] == "WARNING", said
    assert "expiring leases" in said[0][1] and "terminating connection" in said[0][1]
    assert "\n" not in said[0][1]
    assert not [r for r in caplog.records if r.exc_info]
    assert "Sweeper step 'expiring leases' passes work again" in caplog.text  # and its end


def test_health_reports_refused_as_read_only_are_told_once_and_recorded_again_after(
    make_host, read_only, caplog
):
    """A host's health report refused as read-only (Django's InternalError, not the
    OperationalError of a database away) logged "Recording host health failed" at ERROR with
    a traceback every 10 s, and its read-only connection was kept for later reports."""
    from django.db import connection

    host = make_host(one(sub()))
    host.start()
    for service in host._services:
        service.stop()  # only this test's reports
    caplog.set_level(logging.INFO, logger="workqueue.runtime.host")
    read_only.on()
    connection.close()  # the next report opens a session on the read-only database

    for _ in range(3):
        host.record_health()
    read_only.off()  # the session stays read-only: only a new one can record
    (writable_since,) = read_only.admin.execute("SELECT now()").fetchone()
    host.record_health()

    said = [(r.levelname, r.getMessage()) for r in caplog.records if "health" in r.getMessage()]
    assert [level for level, _ in said] == ["WARNING", "INFO"], said
    assert "read-only" in said[0][1] and "\n" not in said[0][1]
    assert not [r for r in caplog.records if r.exc_info]
    (seen,) = read_only.admin.execute(
        "SELECT last_seen_at FROM workqueue_hostrecord WHERE instance_id = %s", [host.instance_id]
    ).fetchone()
    assert seen >= writable_since


def test_a_host_out_of_connection_slots_settles_what_it_ran_once_slots_free(
    make_host, pg_conn, caplog
):
    """Connection slots exhausted (SQLSTATE 53300, here the role's CONNECTION LIMIT reached)
    after a failover ended the host's sessions: the host cannot reconnect, and a publish is
    TransportUnavailable (retryable); the finished handler's completion is tried again while
    its lease lasts, and goes through at its attempt once a slot frees. Held before this
    suite: a connection refused at its start is a lost connection to the driver."""
    from tests.support.roles import acting_as_granted_role

    caplog.set_level(logging.INFO, logger="workqueue")
    s = sub(lease_seconds=60)
    with acting_as_granted_role(pg_conn, "wq_rt", "grant-runtime") as role:
        pg_conn.execute(f'GRANT SELECT ON auth_user TO "{role}"')  # the system user's lookup
        host = make_host(one(s, concurrency=1))
        host.start()
        message = publish(s.topic.name, {"sleepMs": 1000}).message_id
        wait_until(lambda: delivery_of_message(message)[0] == "InFlight", timeout=10)
        pg_conn.execute(f'ALTER ROLE "{role}" CONNECTION LIMIT 0')
        try:
            pg_conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                [role],
            )
            refused = publish(s.topic.name, {})
            wait_until(lambda: "too many connections" in caplog.text, timeout=10)
        finally:
            pg_conn.execute(f'ALTER ROLE "{role}" CONNECTION LIMIT -1')

        assert refused.error.code == PublishErrorCode.TRANSPORT_UNAVAILABLE
        assert "too many connections" in refused.error.message
        wait_until(lambda: delivery_of_message(message) == ("Completed", 1), timeout=10)
        host.shutdown()
    assert not [r for r in caplog.records if r.exc_info]


def test_a_handlers_orm_session_refused_as_read_only_is_closed_after_the_handler(read_only):
    """A handler's ORM session opened while the server was read-only stayed read-only: Django's
    health check (SELECT 1) passes it, and CONN_MAX_AGE (60 s here) kept it, so every handler
    on that worker thread failed its writes for a minute after the primary was back. It is
    closed after the handler that met the refusal (what the executor runs after each one)."""
    from django.contrib.auth import get_user_model
    from django.db import DatabaseError, connection

    from workqueue.runtime.executor import (
        close_old_connections_of_this_thread,
        ready_connections_of_this_thread,
    )

    users = get_user_model().objects
    read_only.on()
    connection.close()  # the handler's first query opens a session on the read-only server
    ready_connections_of_this_thread()
    with pytest.raises(DatabaseError, match="read-only"):
        users.create(username="written-while-read-only")
    read_only.off()
    close_old_connections_of_this_thread()

    ready_connections_of_this_thread()  # the next handler on this thread
    users.create(username="written-once-writable")
    close_old_connections_of_this_thread()
    assert users.filter(username="written-once-writable").exists()


def test_an_operator_request_the_database_refuses_as_read_only_is_503_in_a_line(
    client, read_only, caplog
):
    """An operator's discard while the server refused writes answered 503, and logged "Work
    queue API request failed" at ERROR with a traceback for each request: a client retrying,
    or a dashboard polling, wrote a traceback a request for as long as the spell lasted."""
    from django.contrib.auth import get_user_model

    from tests.support.api import call
    from workqueue.models import Delivery

    s = sub()
    message = publish(s.topic.name, {}).message_id
    delivery = Delivery.objects.get(message_id=message)
    client.force_login(get_user_model().objects.create_superuser("ops", password="-"))
    read_only.on()

    path = f"/subscriptions/{s.name}/deliveries/{delivery.pk}/discard"
    answers = [call(client, "post", path, {"reason": "duplicate"}) for _ in range(2)]

    assert [a.status_code for a in answers] == [503, 503], answers[0].content
    said = [r for r in caplog.records if r.name == "workqueue.api"]
    assert said and not [r for r in said if r.exc_info], [r.getMessage() for r in said]
    assert "read-only" in said[-1].getMessage()  # the first found its session ended
    read_only.off()
    assert call(client, "post", path, {"reason": "duplicate"}).status_code == 200


def test_a_one_shot_job_whose_outcomes_are_refused_for_a_grant_exits_2_naming_it(pg_conn):
    """A container job (workqueue_work --once) whose completion the database refused for want
    of a grant ran its handler, lost the outcome and exited 0 ("processed=0"): the job read
    as a success while its delivery waited for its lease to run, and fail, again."""
    import io

    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.core.management.base import CommandError

    import tests.support.handlers  # noqa: F401  (the commands' registry: tests.noop)
    from tests.factories import SubscriptionFactory
    from tests.support.roles import acting_as_granted_role

    get_user_model().objects.create_user("workqueue-system")
    s = SubscriptionFactory()
    message = publish(s.topic.name, {}).message_id
    revoked = ["wq_complete", "wq_complete_many"]
    with acting_as_granted_role(pg_conn, "wq_rt", "grant-runtime", revoked) as role:
        pg_conn.execute(f'GRANT SELECT ON auth_user TO "{role}"')  # the system user's lookup
        with pytest.raises(CommandError) as raised:
            call_command(
                "workqueue_work",
                "-s",
                s.name,
                "--once",
                "--idle-exit-ms",
                "300",
                stdout=io.StringIO(),
            )

    assert raised.value.returncode == 2
    assert "refuses to record outcomes" in str(raised.value), str(raised.value)
    assert "grant-runtime" in str(raised.value)
    assert delivery_of_message(message) == ("InFlight", 1)  # its lease brings it back


def _revoke(pg_conn: psycopg.Connection, role: str, signatures: list[str]) -> None:
    for signature in signatures:
        pg_conn.execute(f'REVOKE EXECUTE ON FUNCTION {signature} FROM "{role}"')


def _grant(pg_conn: psycopg.Connection, role: str, signatures: list[str]) -> None:
    for signature in signatures:
        pg_conn.execute(f'GRANT EXECUTE ON FUNCTION {signature} TO "{role}"')


def _signatures(
    pg_conn: psycopg.Connection, procedures: tuple[str, ...] = ("wq_complete", "wq_complete_many")
) -> list[str]:
    """The signatures of ``procedures`` (the completions by default), for GRANT and REVOKE."""
    return [
        signature
        for (signature,) in pg_conn.execute(
            "SELECT oid::regprocedure::text FROM pg_proc WHERE proname = ANY (%s)",
            [list(procedures)],
        )
    ]


def test_the_claim_loop_waits_while_its_probe_runs_with_settles_refused(make_host, pg_conn):
    """Review helper-150: while settles were refused and a probe ran, the loop found room in
    its free slots, claimed none (one probe at a time) and went round at once: a core spun
    (a million turns a second) beside the handlers."""
    from tests.support.roles import acting_as_granted_role

    s = sub(lease_seconds=30, max_attempts=3)
    revoked = ["wq_complete", "wq_complete_many"]
    with acting_as_granted_role(pg_conn, "wq_rt", "grant-runtime", revoked) as role:
        pg_conn.execute(f'GRANT SELECT ON auth_user TO "{role}"')
        host = make_host(one(s, concurrency=4))
        host.start()
        publish(s.topic.name, {})
        wait_until(lambda: states(host)[s.name][0] == "Error", timeout=10)
        consumer = host._consumers[s.name]
        turns = [0]
        room = consumer._room

        def counted_room() -> tuple[int, int]:
            turns[0] += 1
            return room()

        consumer._room = counted_room
        publish(s.topic.name, {"sleepMs": 2500})  # the probe, once the 1 s pause ends
        time.sleep(1.5)
        turns[0] = 0
        time.sleep(1.0)  # the probe runs throughout
        counted = turns[0]
        host.shutdown()

    assert counted < 200, f"the claim loop went round {counted} times in a second"


def test_a_long_handler_from_before_a_refusal_does_not_hold_the_probe_back(make_host, pg_conn):
    """Review helper-150: the next probe waited for every running handler, those claimed
    before the refusal too, so one long (or hung) handler kept the subscription from claiming
    after the grant was given back, reading Error 'grant-runtime' all the while."""
    from tests.support.handlers import probe
    from tests.support.roles import acting_as_granted_role

    s = sub(lease_seconds=30, max_attempts=3)
    with acting_as_granted_role(pg_conn, "wq_rt", "grant-runtime") as role:
        pg_conn.execute(f'GRANT SELECT ON auth_user TO "{role}"')
        completions = _signatures(pg_conn)
        host = make_host(one(s, concurrency=3))
        host.start()
        publish(s.topic.name, {"sleepMs": 60_000})  # runs until the host stops
        probe.wait_for(1)
        _revoke(pg_conn, role, completions)
        publish(s.topic.name, {})
        wait_until(lambda: states(host)[s.name][0] == "Error", timeout=10)
        _grant(pg_conn, role, completions)

        later = [publish(s.topic.name, {}).message_id for _ in range(2)]
        wait_until(lambda: all(delivery_of_message(m)[0] == "Completed" for m in later), timeout=10)
        wait_until(lambda: states(host)[s.name] == ("Running", ""), timeout=5)
        host.shutdown()


def test_heartbeats_failing_through_a_read_only_spell_are_told_once_and_their_return_once(
    make_host, read_only, caplog
):
    """helper-149's leftover: every failed renewal of an outage logged a WARNING (a handler
    beating each 100 ms said it ten times a second, each handler of each host), where a failed
    settle says it once and then at DEBUG."""
    caplog.set_level(logging.DEBUG, logger="workqueue")
    s = sub(lease_seconds=60)
    host = make_host(one(s, concurrency=1))
    host.start()
    message = publish(s.topic.name, {"sleepMs": 4000, "heartbeatEveryMs": 100}).message_id
    wait_until(lambda: delivery_of_message(message)[0] == "InFlight", timeout=10)

    read_only.on()
    wait_until(lambda: "Heartbeat failed" in caplog.text, timeout=10)
    time.sleep(1.0)  # about ten beats more
    read_only.off()
    wait_until(lambda: delivery_of_message(message) == ("Completed", 1), timeout=15)
    host.shutdown()

    failed = [r for r in caplog.records if "Heartbeat failed" in r.getMessage()]
    assert len(failed) > 2, len(failed)
    assert [r.levelno for r in failed].count(logging.WARNING) == 1
    back = [r for r in caplog.records if "Heartbeat went through" in r.getMessage()]
    assert [r.levelno for r in back] == [logging.INFO]


def test_a_session_that_opened_read_only_and_only_read_is_not_kept_for_the_writes_after_it(
    read_only,
):
    """CI flake of round 45, a real leftover: a background thread whose session opened during a
    read-only spell only read on it (a cancel check after the listener reconnected), so it was
    never found unfit; once the primary was writable again the thread's next renewal failed on
    it, and the operator was told of a second outage that was not one."""
    from workqueue.driver import get_driver

    driver = get_driver()
    read_only.on()
    assert driver.cancel_requested(str(uuid.uuid4())) is False  # reads go through on a standby
    read_only.off()

    # The thread's next call, a renewal say, runs on a session that takes writes.
    assert driver.execute("SHOW transaction_read_only", []) == [("off",)]


def test_a_rest_request_whose_orm_read_is_refused_a_grant_is_503_in_a_line(client, pg_conn, caplog):
    """Review helper-150: a grant the queue's procedures lack answered 503 in one line, but the
    same missing grant met in Django's own reads (here the key's owner, auth_user, which
    grant-operator does not give) answered 500 with a traceback a request: one cause, two
    answers, and a traceback storm while a dashboard polls."""
    from tests.support.api import call, reader
    from tests.support.roles import acting_as_granted_role

    key = reader()
    with acting_as_granted_role(pg_conn, "wq_op", "grant-operator"):
        answers = [call(client, "get", "/health", key=key) for _ in range(2)]

    assert [a.status_code for a in answers] == [503, 503], answers[0].content
    said = [r for r in caplog.records if r.name == "workqueue.api"]
    assert said and not [r for r in said if r.exc_info], [r.getMessage() for r in said]
    assert "permission denied" in said[-1].getMessage()
    assert "grant-operator" in said[-1].getMessage()  # what to do about it
