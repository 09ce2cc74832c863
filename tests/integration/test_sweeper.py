"""The sweeper against PostgreSQL: one pass expires passed leases (retry, or dead letter on the
last attempt) and purges exactly what retention allows — Completed and Discarded deliveries past
their topic's retention, messages no delivery refers to any more, closed deduplication windows —
and never a dead letter or live work. Two sweepers at once: the second pass is skipped. A
sweeper that finds more than one pass may take keeps passing until it has caught up, in a host
and from ``workqueue_sweep --once``, instead of one pass an interval.
"""

from __future__ import annotations

import datetime as dt
import io
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

from tests.factories import SubscriptionFactory, TopicFactory
from tests.support.roles import acting_as_granted_role
from tests.support.waiting import wait_until
from workqueue import metrics, publish, publish_many, signals, transport
from workqueue.driver import close_all_thread_connections, get_driver
from workqueue.models import Deduplication, Delivery, HostRecord, Message, Subscription
from workqueue.models.hosts import database_now
from workqueue.runtime import sweeper
from workqueue.runtime.sweeper import Sweeper
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")

DAY = 86_400


def status(delivery_id: str) -> tuple[str, int, str | None] | None:
    row = Delivery.objects.filter(pk=delivery_id).first()
    return (row.status, row.attempt_count, row.dead_letter_reason) if row else None


@pytest.fixture
def dead_letters() -> Any:
    received: list[dict[str, Any]] = []

    def on_dead_letter(sender: Any, **kwargs: Any) -> None:
        received.append(kwargs)

    signals.dead_lettered.connect(on_dead_letter, dispatch_uid="test-sweeper")
    yield received
    signals.dead_lettered.disconnect(dispatch_uid="test-sweeper")


def test_one_pass_purges_exactly_what_retention_allows_and_expires_passed_leases(
    dead_letters, caplog
):
    topic = TopicFactory(retention_days=1)
    retry = SubscriptionFactory(topic=topic, max_attempts=3, lease_seconds=30)
    last = SubscriptionFactory(topic=topic, max_attempts=1, lease_seconds=30)
    on_retry, on_last = Receiver(retry.id, "holder"), Receiver(last.id, "holder")

    # Every message fans out to both subscriptions; each row is then settled into one status.
    done = publish(topic.name, {"n": "done"}).message_id
    dropped = publish(topic.name, {"n": "dropped"}).message_id
    poison = publish(topic.name, {"n": "poison"}).message_id
    waiting = publish(topic.name, {"n": "waiting"}, deduplication_key="order-1").message_id
    by_message = {}
    for receiver in (on_retry, on_last):
        for delivery in receiver.receive(10).deliveries:
            by_message[(receiver.subscription_id, delivery.message_id)] = delivery
    for receiver in (on_retry, on_last):
        sub = receiver.subscription_id
        assert receiver.complete(by_message[(sub, done)]).settled
        assert receiver.dead_letter(by_message[(sub, poison)], "Poison").settled
        receiver.release(by_message[(sub, dropped)])
        transport.discard_or_cancel(sub, by_message[(sub, dropped)].delivery_id, "ops", "no")
    # `waiting` stays claimed (InFlight) on both: its leases will have passed.

    get_driver().shift_time(DAY + 60, topic_id=str(topic.id))  # past retention and the leases
    fresh = publish(topic.name, {"n": "fresh"}, deduplication_key="order-2").message_id
    elsewhere = SubscriptionFactory(lease_seconds=30)
    publish(elsewhere.topic.name, {})
    (live,) = Receiver(elsewhere.id, "holder").receive(1).deliveries  # its lease has not passed

    result = Sweeper().run_once()

    assert not result.skipped
    sub_retry, sub_last = on_retry.subscription_id, on_last.subscription_id
    # Completed and Discarded past retention: gone. Dead letters: never purged.
    for sub in (sub_retry, sub_last):
        assert status(by_message[(sub, done)].delivery_id) is None
        assert status(by_message[(sub, dropped)].delivery_id) is None
        assert status(by_message[(sub, poison)].delivery_id) == ("DeadLettered", 1, "Poison")
    # Passed leases: retried with attempts left, dead-lettered on the last attempt.
    assert status(by_message[(sub_retry, waiting)].delivery_id) == ("Pending", 1, None)
    assert status(by_message[(sub_last, waiting)].delivery_id) == (
        "DeadLettered",
        1,
        "LeaseExpired",
    )
    assert [(d["delivery_id"], d["reason"]) for d in dead_letters] == [
        (by_message[(sub_last, waiting)].delivery_id, "LeaseExpired")
    ]
    (logged,) = [r for r in caplog.records if r.name == "workqueue.deliveries"]
    assert logged.levelname == "ERROR" and "LeaseExpired" in logged.getMessage()
    assert logged.delivery_id == by_message[(sub_last, waiting)].delivery_id
    # By name, as a consumer logs it (it named the subscription's id).
    assert logged.subscription == Subscription.objects.get(pk=sub_last).name
    # Live work is untouched.
    assert status(live.delivery_id) == ("InFlight", 1, None)
    assert Delivery.objects.filter(message_id=fresh, status="Pending").count() == 2
    # Messages: only those no delivery refers to any more are purged.
    assert set(Message.objects.filter(topic=topic).values_list("id", flat=True)) == {
        uuid.UUID(poison),
        uuid.UUID(waiting),
        uuid.UUID(fresh),
    }
    # No delivery outlives its message (nothing but this rule keeps them together: deliveries
    # hold their message id without a database constraint).
    assert not Delivery.objects.exclude(message_id__in=Message.objects.values("id")).exists()
    # Deduplication: the closed window goes, the open one stays.
    assert list(Deduplication.objects.filter(topic=topic).values_list("deduplication_key")) == [
        ("order-2",)
    ]
    assert (result.expired, result.expired_dead_letters) == (2, 1)
    assert result.purged["terminal_deliveries"] >= 4
    assert result.purged["orphan_messages"] >= 2
    assert result.purged["expired_deduplications"] >= 1


def test_a_topic_kept_as_long_as_allowed_stops_no_other_topics_retention(pg_conn):
    """Review helper-164: a topic whose retention_days an operator set to "for ever" (4,000,000
    days passed every check) took the purges' cutoff out of the database's range, and the one
    statement that purges every topic failed: nothing was purged anywhere, each pass logged an
    ERROR naming neither the topic nor the setting. The longest retention allowed purges the
    others as usual, and the database refuses a longer one whatever writes it."""
    longest = TopicFactory(retention_days=36_500)
    SubscriptionFactory(topic=longest)
    topic = TopicFactory(retention_days=1)
    receiver = Receiver(SubscriptionFactory(topic=topic).id, "holder")
    message = publish(topic.name, {}).message_id
    (delivery,) = receiver.receive(1).deliveries
    assert receiver.complete(delivery).settled
    get_driver().shift_time(2 * 86_400, topic_id=str(topic.id))

    result = Sweeper().run_once()

    assert result.failed_steps == [], result.failed_steps
    assert not Message.objects.filter(pk=message).exists()
    assert not Delivery.objects.filter(pk=delivery.delivery_id).exists()
    with pytest.raises(psycopg.errors.CheckViolation):
        pg_conn.execute(
            "UPDATE workqueue_topic SET retention_days = 4000000 WHERE id = %s", [longest.id]
        )


def test_rows_within_retention_are_kept(dead_letters):
    topic = TopicFactory(retention_days=2)
    sub = SubscriptionFactory(topic=topic)
    receiver = Receiver(sub.id, "holder")
    message = publish(topic.name, {}).message_id
    (delivery,) = receiver.receive(1).deliveries
    assert receiver.complete(delivery).settled
    get_driver().shift_time(DAY + 60, topic_id=str(topic.id))  # one day old: retention is two

    Sweeper().run_once()

    assert status(delivery.delivery_id) == ("Completed", 1, None)
    assert Message.objects.filter(pk=message).exists()


_ALERTS = Path(__file__).resolve().parents[2] / "docs" / "prometheus-alerts.yaml"
_HOLDER_QUERY = re.search(r"`(SELECT l\.pid.*?)`", _ALERTS.read_text(), re.S)[1]


@contextmanager
def sweep_lock_held_elsewhere(
    pg_conn: Any, seconds: float = 10, *, flushed: bool = False
) -> Iterator[int]:
    """Hold the sweep lock on another thread (another connection) for the block, or at most
    ``seconds``; yields the holding session's pid. Its row is there as `migrate` leaves it
    (an earlier test's flush emptied the table: then both sweepers only met on putting it
    back, and a lock any two could share went unseen), or, ``flushed``, gone."""
    if flushed:
        pg_conn.execute("DELETE FROM workqueue_sweep_lock")
    else:
        pg_conn.execute("INSERT INTO workqueue_sweep_lock (id) VALUES (1) ON CONFLICT DO NOTHING")
    holding, release = threading.Event(), threading.Event()
    holder_pid: list[int] = []

    def hold() -> None:
        try:
            with transport.sweep_lock() as acquired:
                assert acquired
                holder_pid.extend(
                    pg_conn.execute(
                        "SELECT pid FROM pg_stat_activity "
                        "WHERE query LIKE '%wq_try_sweep_lock%' AND pid <> pg_backend_pid() "
                        # Not another test database's sweeper (one per xdist worker).
                        "AND datname = current_database()"
                    ).fetchone()
                )
                holding.set()
                release.wait(seconds)
        finally:
            get_driver().close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(10)
        yield holder_pid[0]
    finally:
        release.set()
        holder.join(10)


def test_a_second_sweeper_skips_its_pass_while_another_holds_the_lock(pg_conn):
    with sweep_lock_held_elsewhere(pg_conn) as lock_pid:
        assert Sweeper().run_once().skipped
        # The query the alert for a held sweep lock gives finds the holder first.
        [found, *_] = pg_conn.execute(_HOLDER_QUERY).fetchall()
        assert found[0] == lock_pid
    assert not Sweeper().run_once().skipped  # and the next pass runs


def test_the_sweep_lock_outlives_a_flush_of_its_row(pg_conn):
    """`manage.py flush` (and a test run's) empties every table, the sweep lock's one row too:
    the first sweeper to miss it puts it back and holds it, and a second one meanwhile skips its
    pass at once instead of waiting for the first's to end."""
    with sweep_lock_held_elsewhere(pg_conn, seconds=30, flushed=True):
        began = time.monotonic()
        assert Sweeper().run_once().skipped
        assert time.monotonic() - began < 20  # did not wait for the holder's 30 s
    assert not Sweeper().run_once().skipped
    assert pg_conn.execute("SELECT id FROM workqueue_sweep_lock").fetchall() == [(1,)]


def test_a_frozen_sweepers_lock_is_freed_by_the_server_and_a_working_ones_kept(
    pg_conn, monkeypatch
):
    """Audit helper-128: wq_try_sweep_lock switched the server's limit on idle transactions off
    for the lock's session, which sits idle while its pass runs elsewhere, so a sweeper frozen
    mid-pass (SIGSTOP, a paused VM: its kernel still answers TCP keepalives) held the lock and
    stopped every instance's passes for as long as it stayed frozen. The session may now sit
    idle ten minutes, and a working pass touches it meanwhile."""
    pg_conn.execute("INSERT INTO workqueue_sweep_lock (id) VALUES (1) ON CONFLICT DO NOTHING")
    with pg_conn.transaction():
        assert pg_conn.execute("SELECT acquired FROM wq_try_sweep_lock()").fetchone() == (True,)
        limit = pg_conn.execute("SHOW idle_in_transaction_session_timeout").fetchone()
    assert limit == ("10min",)

    monkeypatch.setattr(transport, "SWEEP_LOCK_KEEPALIVE_SECONDS", 0.2)

    def last_touched(pid: int) -> dt.datetime:
        return pg_conn.execute(
            "SELECT state_change FROM pg_stat_activity WHERE pid = %s", [pid]
        ).fetchone()[0]

    with sweep_lock_held_elsewhere(pg_conn, seconds=3) as lock_pid:
        touched = [last_touched(lock_pid)]
        time.sleep(0.6)
        touched.append(last_touched(lock_pid))
    assert touched[1] > touched[0], "the held lock's session was left idle"


@pytest.fixture
def small_passes(monkeypatch) -> int:
    """Limit a pass to 2 batches of 20 rows a step (40 rows), so a backlog of a few hundred
    rows is many passes' work; returns the limit."""
    monkeypatch.setattr(sweeper, "PURGE_BATCH", 20)
    monkeypatch.setattr(sweeper, "MAX_BATCHES", 2)
    return 40


def completed_past_retention(count: int) -> Any:
    """A topic with ``count`` deliveries completed (and published) over a day ago, beyond its
    one-day retention."""
    topic = TopicFactory(retention_days=1)
    subscription = SubscriptionFactory(topic=topic)
    publish_many(topic.name, [{"payload": {}}] * count)
    receiver = Receiver(subscription.id, "holder")
    while claimed := receiver.receive(100).deliveries:
        assert all(r.settled for r in receiver.complete_many(claimed).values())
    get_driver().shift_time(DAY + 60, topic_id=str(topic.id))
    return topic


def test_a_pass_stopped_by_its_limit_says_it_is_behind_and_one_that_finished_says_not(
    small_passes,
):
    topic = completed_past_retention(small_passes + 10)
    before = sweeper_counts()

    first, second = Sweeper().run_once(), Sweeper().run_once()

    assert first.purged["terminal_deliveries"] == small_passes and first.behind
    assert second.purged["terminal_deliveries"] == 10 and not second.behind
    assert not Delivery.objects.filter(subscription__topic=topic).exists()
    # What an operator's alert reads (WorkQueueSweeperBehind).
    after = sweeper_counts()
    assert after["behind"] - before["behind"] == 1
    assert after["caught_up"] - before["caught_up"] == 1
    assert after["terminal_deliveries"] - before["terminal_deliveries"] == small_passes + 10


def sweeper_counts() -> dict[str, float]:
    """This process's sweeper counters: passes by result, rows by step."""
    passes = {
        result: metrics.PROCESS.get_sample_value(
            "workqueue_sweeper_passes_total", {"result": result}
        )
        or 0.0
        for result in ("behind", "caught_up")
    }
    rows = metrics.PROCESS.get_sample_value(
        "workqueue_sweeper_rows_total", {"step": "terminal_deliveries"}
    )
    return {**passes, "terminal_deliveries": rows or 0.0}


def test_a_host_sweeper_behind_on_retention_keeps_passing_until_caught_up_not_once_an_interval(
    small_passes, make_host
):
    # A pass purges at most MAX_BATCHES * PURGE_BATCH rows a step (20,000 by default) and the
    # next waited a whole interval (60 s by default): past 333 settled deliveries a second the
    # tables grew for ever, whatever the database could delete.
    interval = 10.0
    topic = completed_past_retention(10 * small_passes)  # ten passes' work
    host = make_host([], sweeper_interval_ms=int(interval * 1000))
    began = time.monotonic()
    host.start()

    wait_until(lambda: not Message.objects.filter(topic=topic).exists(), timeout=120)

    # The first pass comes an interval after the start; the nine after it follow as soon as
    # the one before has finished, each a fraction of a second (one interval a pass: 100 s).
    assert time.monotonic() - began < 2 * interval
    assert not Delivery.objects.filter(subscription__topic=topic).exists()


def test_sweep_once_keeps_passing_until_caught_up(small_passes):
    topic = completed_past_retention(3 * small_passes)
    out = io.StringIO()

    call_command("workqueue_sweep", "--once", stdout=out)

    assert not Delivery.objects.filter(subscription__topic=topic).exists()
    assert not Message.objects.filter(topic=topic).exists()
    passes = out.getvalue().splitlines()
    assert len(passes) == 4, passes  # three at the limit, one that found the rest
    assert "terminal_deliveries=40" in passes[0] and "terminal_deliveries=0" in passes[-1]


def test_sweep_once_fails_when_a_step_failed(pg_conn):
    """Each step catches its own error so the others still run; a job run by cron whose purges
    failed every time (here the role lacks EXECUTE on one, as after an upgrade whose grants
    were not run again) exited 0 while the tables grew."""
    out = io.StringIO()
    with (
        acting_as_granted_role(
            pg_conn, "wq_sweeper", "grant-runtime", revoked=["wq_purge_orphan_messages"]
        ),
        pytest.raises(CommandError, match="Sweeping failed: orphan_messages") as raised,
    ):
        call_command("workqueue_sweep", "--once", stdout=out)

    assert raised.value.returncode == 1
    assert "orphan_messages=-1" in out.getvalue() and "terminal_deliveries=0" in out.getvalue()


def test_sweep_once_fails_when_its_pass_could_not_run(pg_conn):
    """A pass that fails whole (here the sweep lock cannot be asked for) fails the job: a cron
    job whose every pass failed must not exit 0 (audit helper-107: returning instead of raising
    went unseen)."""
    with (
        acting_as_granted_role(
            pg_conn, "wq_sweeper", "grant-runtime", revoked=["wq_try_sweep_lock"]
        ),
        pytest.raises(Exception, match="permission denied"),
    ):
        call_command("workqueue_sweep", "--once", stdout=io.StringIO())


def test_a_standalone_sweeper_outlives_a_failing_pass(monkeypatch, settings, caplog):
    # It ended at the first database error (a restart, a failover), while a host's sweeper
    # logs the failure and passes again an interval later.
    settings.WORKQUEUE = {**getattr(settings, "WORKQUEUE", {}), "SWEEPER_INTERVAL_MS": 1000}
    real_pass, calls = Sweeper.run_once, []

    def failing_once(self: Sweeper) -> Any:
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise RuntimeError("the database went away")
        os.kill(os.getpid(), signal.SIGTERM)  # the command's own handler: stop after this pass
        return real_pass(self)

    monkeypatch.setattr(Sweeper, "run_once", failing_once)
    out = io.StringIO()

    call_command("workqueue_sweep", stdout=out)

    assert len(calls) == 2 and calls[1] - calls[0] >= 0.9  # an interval after the failure
    assert "expired=" in out.getvalue()
    assert any("Sweeper pass failed" in r.getMessage() for r in caplog.records)


# -- receivers that raise, a strict DBA, a restarted database (audit helper-72) ---------------


def test_a_dead_lettered_receiver_that_raises_does_not_cost_the_rest_of_the_batch(caplog):
    """The sweeper sent dead_lettered one row at a time: the first receiver that raised (the
    pager is down) ended the pass's lease expiry, and the batch's other dead letters, already
    committed, were never logged nor signalled."""
    topic = TopicFactory()
    last = SubscriptionFactory(topic=topic, max_attempts=1, lease_seconds=30)
    for n in range(3):
        publish(topic.name, {"n": n})
    assert len(Receiver(last.id, "holder").receive(10).deliveries) == 3
    get_driver().shift_time(120, topic_id=str(topic.id))  # their leases have passed
    heard: list[str] = []

    def pager(sender: Any, delivery_id: str, **kwargs: Any) -> None:
        heard.append(delivery_id)
        raise ConnectionError("the pager is down")

    signals.dead_lettered.connect(pager, dispatch_uid="test-sweeper-pager")
    try:
        result = Sweeper().run_once()
    finally:
        signals.dead_lettered.disconnect(dispatch_uid="test-sweeper-pager")

    logged = [r for r in caplog.records if r.name == "workqueue.deliveries"]
    assert (len(heard), len(logged), result.expired, result.failed_steps) == (3, 3, 3, [])


def test_the_sweep_lock_outlasts_a_servers_idle_in_transaction_timeout(monkeypatch):
    """The lock's transaction sits idle while the pass runs on another connection: a server
    timeout shorter than a pass (a common DBA setting) ended its session mid-pass, a second
    sweeper ran beside the first, and the first pass failed at its end."""
    from workqueue.driver.postgresql import PostgresDriver

    monkeypatch.setattr(
        PostgresDriver,
        "own_connection_options",
        {
            **PostgresDriver.own_connection_options,
            "options": "-c idle_in_transaction_session_timeout=1000",  # 1 s
        },
    )
    expire = Sweeper._expire_leases

    def slow_on_the_first(self: Sweeper, result: Any) -> None:
        if threading.current_thread().name == "first-sweeper":
            time.sleep(2.5)  # a long step: twenty full batches on a large table
        expire(self, result)

    monkeypatch.setattr(Sweeper, "_expire_leases", slow_on_the_first)
    outcome: dict[str, Any] = {}

    def first() -> None:
        try:
            outcome["first"] = Sweeper().run_once()
        except Exception as exc:  # the outcome under test
            outcome["first"] = exc
        finally:
            close_all_thread_connections()  # the driver's and Django's, as a host thread's

    thread = threading.Thread(target=first, name="first-sweeper")
    thread.start()
    time.sleep(1.8)  # the first pass is half way, its lock idle for longer than the timeout
    second = Sweeper().run_once()
    thread.join(20)

    assert second.skipped, "a second sweeper ran its pass beside the first"
    assert not isinstance(outcome["first"], Exception), outcome["first"]
    assert outcome["first"].failed_steps == []


def test_a_host_sweeper_recovers_from_a_database_restart():
    """The task-results purge reads through Django's connection on the sweeper's thread,
    which nothing closed: after a restart every pass failed on the dead connection, for the
    host's whole life."""
    from workqueue.runtime.service import PeriodicService

    passes: list[list[str]] = []

    def one_pass() -> None:
        passes.append(Sweeper().run_once().failed_steps)

    service = PeriodicService("wq-sweeper", 0.1, one_pass)
    service.start()
    try:
        wait_until(lambda: len(passes) >= 2)
        with connection.cursor() as cursor:  # what a restart does to every other session
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        after = len(passes)
        wait_until(lambda: len(passes) >= after + 3)
    finally:
        service.stop()

    assert passes[-1] == [] and passes[-2] == [], passes


def test_a_pass_deletes_the_records_of_hosts_not_seen_for_the_retention(settings):
    """Every host start wrote a record that nothing ever deleted: a one-shot job run each
    minute left half a million rows a year behind it."""
    settings.WORKQUEUE = {**getattr(settings, "WORKQUEUE", {}), "HOST_RECORD_RETENTION_DAYS": 3}
    now = database_now()

    def record(name: str, seen_days_ago: float, stopped: bool) -> None:
        seen = now - dt.timedelta(days=seen_days_ago)
        HostRecord.objects.create(
            instance_id=name,
            hostname="h",
            pid=1,
            started_at=seen,
            last_seen_at=seen,
            stopped_at=seen if stopped else None,
        )

    record("stopped-long-ago", 3.1, stopped=True)
    record("died-long-ago", 3.1, stopped=False)  # killed: never wrote its stop
    record("stopped-lately", 2.9, stopped=True)
    record("running", 0, stopped=False)

    result = Sweeper().run_once()

    assert result.purged["host_records"] == 2
    assert sorted(HostRecord.objects.values_list("pk", flat=True)) == ["running", "stopped-lately"]
