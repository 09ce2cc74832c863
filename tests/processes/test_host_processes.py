"""The host commands as real processes against this worker's test database: processing,
SIGTERM drain, kill -9 recovery, Ordered across two hosts and the exit codes of
``workqueue_work --once``.

Subprocesses get DATABASE_URL pointing at the pytest test database, so everything they do is
visible here (the tests are transactional: ``queue_db``). Every process started is killed in
teardown whatever happens.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections import defaultdict

import psycopg
import pytest
from django.utils import timezone

from tests.factories import SubscriptionFactory
from tests.support.database import psycopg_params
from tests.support.processes import DRAIN_MS, hello, read_events
from tests.support.waiting import wait_until
from workqueue import publish, publish_many, transport
from workqueue.driver import get_driver
from workqueue.models import Delivery, HostRecord
from workqueue.runtime.process import SECOND_SIGNAL_AFTER_SECONDS

pytestmark = [pytest.mark.processes, pytest.mark.usefixtures("queue_db")]


def delivery(message_id: str) -> Delivery:
    return Delivery.objects.get(message_id=message_id)


# -- workqueue_host ---------------------------------------------------------------------------


def test_a_host_process_processes_published_work_and_records_its_health(processes):
    sub = hello()
    host = processes.host(sub.name)

    ids = [r.message_id for r in publish_many(sub.topic.name, [{"payload": {}}] * 20)]

    done = Delivery.objects.filter(message_id__in=ids, status="Completed")
    wait_until(lambda: done.count() == 20)
    record = HostRecord.objects.get(pid=host.pid)
    assert HostRecord.objects.live().filter(pk=record.pk).exists()
    assert [(s["name"], s["state"]) for s in record.subscriptions] == [(sub.name, "Running")]
    assert "samples.hello" in record.handler_keys and "tests.record" in record.handler_keys


def test_a_host_process_whose_first_plan_was_cut_off_says_so_then_its_subscriptions(
    processes, pg_conn
):
    """Review helper-154: ``workqueue_host`` said its subscriptions once, after its start; a
    first plan cut off by a failover left nothing to say, and a plan that went through a
    second later said nothing either (the chaos run's restarted host never said Running)."""
    s = hello()
    with (
        psycopg.connect(autocommit=True, **psycopg_params()) as locker,
        locker.transaction(),
    ):
        locker.execute("LOCK TABLE workqueue_topic IN ACCESS EXCLUSIVE MODE")
        host = processes.start("workqueue_host", "-s", s.name, PGAPPNAME="test-host-orm")
        wait_until(
            lambda: pg_conn.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = 'test-host-orm' AND wait_event_type = 'Lock'"
            ).fetchone()[0],
            timeout=20,
        )
        host.wait_for_line("Planning failed")

    host.wait_for_line(f"{s.name}: Running")
    message = publish(s.topic.name, {"name": "cut"}).message_id
    wait_until(lambda: delivery(message).status == "Completed", timeout=10)


@pytest.mark.timing
def test_sigterm_mid_handler_releases_the_delivery_and_exits_within_the_drain_budget(processes):
    sub = hello(lease_seconds=30, max_attempts=3)
    host = processes.host(sub.name)
    message = publish(sub.topic.name, {"sleepMs": 60_000}).message_id
    wait_until(lambda: delivery(message).status == "InFlight")
    time.sleep(0.2)  # the handler is asleep

    began = time.monotonic()
    host.popen.send_signal(signal.SIGTERM)
    code = host.wait(timeout=15)
    took = time.monotonic() - began

    assert code == 0, host.stderr()
    # Two drain phases of 0.5 s (claim loop + handlers, then after the abort) plus shutdown work.
    assert took < 2 * DRAIN_MS / 1000 + 1.5, f"took {took:.2f}s"
    row = delivery(message)
    assert (row.status, row.attempt_count, row.last_error, row.lease_token) == (
        "Pending",
        0,
        None,
        None,
    )
    record = HostRecord.objects.get(pid=host.pid)
    assert record.stopped_at is not None
    assert [(s["name"], s["state"]) for s in record.subscriptions] == [(sub.name, "Paused")]


def test_sigterm_lets_a_handler_that_finishes_within_the_drain_complete(processes):
    sub = SubscriptionFactory(handler_key="tests.record", lease_seconds=30, max_attempts=3)
    host = processes.host(sub.name, WORKQUEUE_SHUTDOWN_DRAIN_MS="5000")
    message = publish(sub.topic.name, {"sleepMs": 700}).message_id
    # Running, not only claimed: a delivery claimed but not yet handed to a worker when the
    # signal comes goes back to the queue unrun (attempt refunded), which a loaded machine
    # made this test see (CI, 2026-12-05).
    wait_until(lambda: [e["event"] for e in read_events(processes.events)] == ["start"])

    host.popen.send_signal(signal.SIGTERM)

    assert host.wait(timeout=15) == 0
    assert delivery(message).status == "Completed"
    assert [e["event"] for e in read_events(processes.events)] == ["start", "end"]


def test_sigterm_tells_handlers_at_once_so_a_cooperative_one_ends_the_drain_early(processes):
    sub = SubscriptionFactory(handler_key="tests.record", lease_seconds=30, max_attempts=3)
    # A drain far longer than the test allows: only the early notice can make this quick.
    host = processes.host(sub.name, WORKQUEUE_SHUTDOWN_DRAIN_MS="30000")
    message = publish(sub.topic.name, {"sleepMs": 60_000, "untilStopping": True}).message_id
    wait_until(lambda: delivery(message).status == "InFlight")
    wait_until(lambda: [e["event"] for e in read_events(processes.events)] == ["start"])

    began = time.monotonic()
    host.popen.send_signal(signal.SIGTERM)
    code = host.wait(timeout=20)
    took = time.monotonic() - began

    assert code == 0, host.stderr()
    assert took < 5, f"took {took:.1f}s"
    stopping = [e for e in read_events(processes.events) if e["event"] == "stopping"]
    assert [e["signal"] for e in stopping] == [None]  # told before any abort
    row = delivery(message)
    assert (row.status, row.attempt_count, row.last_error) == ("Pending", 0, None)


def test_sigterm_exits_within_the_drain_budget_even_if_a_handler_ignores_the_abort(processes):
    sub = SubscriptionFactory(handler_key="tests.record", lease_seconds=30)
    host = processes.host(sub.name)
    payload = {"sleepMs": 8000, "ignoreSignal": True, "failPercent": 100}
    message = publish(sub.topic.name, payload).message_id
    # Its handler running, not only its claim committed: a delivery claimed and not yet
    # started is handed back at once by the drain (CI met that: nothing "did not stop").
    wait_until(lambda: any(e["event"] == "start" for e in read_events(processes.events)))

    host.popen.send_signal(signal.SIGTERM)

    try:
        host.wait(timeout=2 * DRAIN_MS / 1000 + 2.5)
    except subprocess.TimeoutExpired:
        pytest.fail("the host was still running after twice the drain budget")
    assert "did not stop" in host.stderr()
    # Not 0, as a clean stop: a supervisor could not tell (helper-113); 3, as workqueue_work.
    assert host.popen.returncode == 3
    assert delivery(message).status == "InFlight"  # left to lease expiry


def test_a_second_signal_during_the_drain_exits_at_once_saying_what_is_left(processes):
    # An operator pressing Ctrl-C again (or a supervisor sending SIGTERM twice) must not have
    # to wait out the drain, nor find the signal silently ignored.
    sub = SubscriptionFactory(handler_key="tests.record", lease_seconds=30)
    host = processes.host(sub.name, WORKQUEUE_SHUTDOWN_DRAIN_MS="20000")
    message = publish(sub.topic.name, {"sleepMs": 30_000, "ignoreSignal": True}).message_id
    # Running, not only claimed (one claimed and not yet started would be handed back).
    wait_until(lambda: [e["event"] for e in read_events(processes.events)] == ["start"])

    host.popen.send_signal(signal.SIGINT)
    host.wait_for_line("SIGINT received: stopped claiming; draining running handlers")
    time.sleep(SECOND_SIGNAL_AFTER_SECONDS + 0.2)  # sooner, it is the same stop delivered twice
    began = time.monotonic()
    host.popen.send_signal(signal.SIGINT)
    code = host.wait(timeout=10)

    assert time.monotonic() - began < 5
    assert code == 1
    assert "Second signal (SIGINT) during the drain: exiting now" in host.stderr()
    assert delivery(message).status == "InFlight"  # left to lease expiry, as the line says


def test_ctrl_c_under_a_process_manager_drains_once_not_exits(processes):
    # A terminal's Ctrl-C reaches the whole process group, and the manager (honcho, foreman)
    # sends SIGTERM right after: one stop, which must still drain.
    sub = SubscriptionFactory(handler_key="tests.record", lease_seconds=30)
    host = processes.host(sub.name)
    message = publish(sub.topic.name, {"sleepMs": 30_000, "thenOnAbort": "retry"}).message_id
    wait_until(lambda: delivery(message).status == "InFlight")

    host.popen.send_signal(signal.SIGINT)
    time.sleep(0.01)
    host.popen.send_signal(signal.SIGTERM)
    host.popen.send_signal(signal.SIGINT)  # a wrapper in the group passing the SIGINT on
    code = host.wait(timeout=2 * DRAIN_MS / 1000 + 5)

    assert code == 0, host.stderr()
    assert "Second signal" not in host.stderr()
    row = delivery(message)
    assert (row.status, row.attempt_count) == ("Pending", 0)  # handed back by the drain


def test_a_handler_completing_after_the_drain_does_not_hang_the_host_process(processes):
    sub = SubscriptionFactory(handler_key="tests.record", lease_seconds=30)
    host = processes.host(sub.name, WORKQUEUE_SHUTDOWN_DRAIN_MS="300")
    handler_ms = 6000
    message = publish(sub.topic.name, {"sleepMs": handler_ms, "ignoreSignal": True}).message_id
    wait_until(lambda: any(e["event"] == "start" for e in read_events(processes.events)))
    signalled = time.monotonic()

    host.popen.send_signal(signal.SIGTERM)

    # Two drains of 0.3 s, then the process must end while its handler still sleeps: waiting
    # for the handler instead would take the rest of its 6 s.
    try:
        code = host.wait(timeout=handler_ms / 1000 / 2)
    except subprocess.TimeoutExpired:
        pytest.fail("the host process waited for a handler that outlived the drain")
    assert code == 3  # work left behind (EXIT_WORK_LEFT_BEHIND)
    assert time.monotonic() - signalled < handler_ms / 1000
    assert "did not stop" in host.stderr()
    # Its outcome was never recorded: the delivery is left to lease expiry, held by that host.
    held = delivery(message)
    assert (held.status, held.attempt_count) == ("InFlight", 1)
    assert f":{host.pid}:" in held.lease_owner
    assert [e["event"] for e in read_events(processes.events)] == ["start"]


def test_kill_9_mid_handler_leaves_the_delivery_to_lease_expiry_and_another_host_retries_it(
    processes,
):
    sub = SubscriptionFactory(handler_key="tests.record", lease_seconds=5, max_attempts=3)
    first = processes.host(sub.name)
    message = publish(sub.topic.name, {"sleepFirstAttemptMs": 60_000}).message_id
    wait_until(lambda: any(e["event"] == "start" for e in read_events(processes.events)))

    first.popen.kill()
    first.wait(timeout=10)

    held = delivery(message)
    assert (held.status, held.attempt_count) == ("InFlight", 1)
    assert f":{first.pid}:" in held.lease_owner
    # Stand in for waiting out the 5 s lease, then let one sweeper pass expire it.
    get_driver().shift_time(10, subscription_id=str(sub.id))
    sweep = processes.run("workqueue_sweep", "--once")
    assert sweep.returncode == 0, sweep.stderr
    assert "expired=1 dead_lettered=0" in sweep.stdout
    expired = delivery(message)
    assert (expired.status, expired.attempt_count, expired.last_error) == (
        "Pending",
        1,
        "LeaseExpired",
    )
    # Due at once: a crashed holder's delivery is retried within lease + sweeper interval,
    # whatever the subscription's backoff.
    assert expired.visible_at <= timezone.now()

    second = processes.host(sub.name)

    wait_until(lambda: delivery(message).status == "Completed")
    assert delivery(message).attempt_count == 2
    runs = [(e["event"], e["pid"], e["attempt"]) for e in read_events(processes.events)]
    assert runs == [("start", first.pid, 1), ("start", second.pid, 2), ("end", second.pid, 2)]


def test_a_cancelled_handler_that_ignores_its_signal_keeps_its_exclusive_key_until_it_returns(
    processes,
):
    # The handler ignores the cancel for 8 s: far longer than the host's drain (0.5 s) and
    # than its lease (5 s). The lease was no longer renewed once the cancel was seen: it ran
    # out, the next claim discarded the row, and the key's next delivery ran beside the first.
    sub = SubscriptionFactory(
        handler_key="tests.record", partition_mode="Exclusive", lease_seconds=5
    )
    processes.host(sub.name, concurrency=2)
    payload = {"ordinal": 1, "sleepMs": 8000, "ignoreSignal": True}
    first = publish(sub.topic.name, payload, partition_key="acct").message_id
    second = publish(sub.topic.name, {"ordinal": 2}, partition_key="acct").message_id
    wait_until(lambda: any(e["event"] == "start" for e in read_events(processes.events)))

    cancel = transport.discard_or_cancel(str(sub.id), str(delivery(first).id), "ops", "stop")

    assert cancel.cancel_requested
    wait_until(lambda: delivery(second).status == "Completed", timeout=20)
    stopped = delivery(first)
    assert (stopped.status, stopped.attempt_count) == ("Discarded", 1)
    events = sorted(read_events(processes.events), key=lambda e: e["t"])
    # The first handler saw the cancel, kept running to its end, and only then did the key's
    # next delivery start: never two handlers of the key at once.
    assert [(e["event"], e["ordinal"], e.get("signal")) for e in events] == [
        ("start", 1, None),
        ("end", 1, "Cancelled"),
        ("start", 2, None),
        ("end", 2, None),
    ]


def test_ordered_deliveries_run_strictly_in_publish_order_per_key_across_two_hosts(processes):
    # The first message of each key fails its first attempt: its retry waits out a backoff,
    # and the key's later messages must wait behind it (an Exclusive claim would run them).
    sub = SubscriptionFactory(
        handler_key="tests.record",
        partition_mode="Ordered",
        backoff_base_seconds=1,
        backoff_max_seconds=1,
    )
    hosts = [processes.host(sub.name, concurrency=2) for _ in range(2)]
    keys = [f"key-{k}" for k in range(8)]
    heads = set(range(len(keys)))
    ordinal = 0
    for _batch in range(3):
        items = []
        for _ in range(4):
            for key in keys:
                payload = {"ordinal": ordinal, "sleepMs": 10, "failFirstAttempt": ordinal in heads}
                items.append({"payload": payload, "partition_key": key})
                ordinal += 1
        publish_many(sub.topic.name, items)
    total = ordinal

    wait_until(
        lambda: Delivery.objects.filter(subscription=sub, status="Completed").count() == total,
        timeout=60,
    )

    events = read_events(processes.events)
    assert {e["pid"] for e in events} == {h.pid for h in hosts}, "both hosts took part"
    by_key: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for event in events:
        by_key[event["key"]].append((event["event"], event["ordinal"]))
    for key in keys:
        expected = sorted(o for o in range(total) if f"key-{o % len(keys)}" == key)
        # One run at a time, in order: the head's failed attempt and its retry, then start n,
        # end n, start n+1, end n+1, ...
        head, *rest = expected
        runs = [("start", head), ("fail", head), ("start", head), ("end", head)]
        assert by_key[key] == runs + [(ev, o) for o in rest for ev in ("start", "end")], key
        completed = list(
            Delivery.objects.filter(subscription=sub, partition_key=key)
            .order_by("completed_at")
            .values_list("message__publish_ordinal", flat=True)
        )
        assert completed == sorted(completed)


# -- workqueue_work --once ------------------------------------------------------------------------


@pytest.mark.timing
def test_work_once_on_an_empty_queue_exits_0_as_soon_as_it_has_been_idle(processes):
    sub = hello()
    began = time.monotonic()

    done = processes.run("workqueue_work", "-s", sub.name, "--once", "--idle-exit-ms", "200")

    assert done.returncode == 0, done.stderr
    assert "processed=0 reason=Idle" in done.stdout
    assert time.monotonic() - began < 6.0


def test_work_once_stops_after_its_budget_and_exits_0(processes):
    sub = hello()
    ids = [r.message_id for r in publish_many(sub.topic.name, [{"payload": {}}] * 5)]

    done = processes.run(
        "workqueue_work", "-s", sub.name, "--once", "--max", "2", "--idle-exit-ms", "200"
    )

    assert done.returncode == 0, done.stderr
    assert "processed=2 reason=MaxDeliveries" in done.stdout
    rows = Delivery.objects.filter(message_id__in=ids)
    assert sorted(r.status for r in rows) == ["Completed"] * 2 + ["Pending"] * 3


def test_work_once_exits_2_for_an_unknown_subscription(processes):
    done = processes.run("workqueue_work", "-s", "no.such-subscription", "--once")

    assert done.returncode == 2
    assert "no.such-subscription: Error (Subscription not found)" in done.stderr


def test_work_once_exits_2_when_no_handler_is_registered_and_leaves_the_work_pending(processes):
    sub = hello(handler_key="tests.nobody-registered-this")
    message = publish(sub.topic.name, {}).message_id

    done = processes.run("workqueue_work", "-s", sub.name, "--once", "--idle-exit-ms", "200")

    assert done.returncode == 2
    assert f"{sub.name}: HandlerNotRegistered" in done.stderr
    assert (delivery(message).status, delivery(message).attempt_count) == ("Pending", 0)


def test_work_once_on_a_paused_subscription_exits_0(processes):
    sub = hello(status="Paused")

    done = processes.run("workqueue_work", "-s", sub.name, "--once", "--idle-exit-ms", "200")

    assert done.returncode == 0, done.stderr
    assert "reason=Idle" in done.stdout


@pytest.mark.parametrize("command", ["workqueue_host", "workqueue_work"])
def test_workqueue_disable_host_exits_0_at_once_without_touching_the_queue(processes, command):
    sub = hello()
    message = publish(sub.topic.name, {}).message_id
    args = [command] if command == "workqueue_host" else [command, "-s", sub.name, "--once"]

    # A host that ignored the switch would run on until the 20 s timeout ends the test.
    done = processes.run(*args, timeout=20, WORKQUEUE_DISABLE_HOST="1")

    assert done.returncode == 0, done.stderr
    assert "WORKQUEUE_DISABLE_HOST is set" in done.stdout
    assert delivery(message).status == "Pending"
    assert not HostRecord.objects.exists()


def test_a_host_without_its_system_user_refuses_to_start_naming_the_setting(processes):
    done = processes.run("workqueue_host", timeout=20, WORKQUEUE_SYSTEM_USER="nobody-here")

    assert done.returncode != 0
    assert "WORKQUEUE['SYSTEM_USER'] is 'nobody-here'" in done.stderr


def test_work_once_that_leaves_a_handler_running_exits_3(processes):
    # It exited 0, "processed=0", with the delivery held until its lease expired: a job
    # reported successful while its work was left unfinished.
    sub = SubscriptionFactory(handler_key="tests.record", lease_seconds=30)
    message = publish(sub.topic.name, {"sleepMs": 8000, "ignoreSignal": True}).message_id

    done = processes.run(
        "workqueue_work",
        "-s",
        sub.name,
        "--once",
        "--max-duration-ms",
        "1000",
        "--shutdown-drain-ms",
        "300",
    )

    assert done.returncode == 3, (done.stdout, done.stderr)
    assert "1 handler(s) did not stop" in done.stdout
    assert delivery(message).status == "InFlight"  # left to lease expiry, as it says


@pytest.mark.parametrize("name", ["", "  "])
def test_work_once_with_a_blank_subscription_exits_2(processes, name):
    # An unset $SUBSCRIPTION in a job template ran nothing and exited 0, for ever.
    done = processes.run("workqueue_work", "-s", name, "--once")

    assert done.returncode == 2
    assert "-s/--subscription is blank" in done.stderr
