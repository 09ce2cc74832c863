"""What the host commands run, as real processes: each subscription's concurrency comes from
the settings unless ``--concurrency`` overrides it (with or without ``-s``), the start-up lines
say state and concurrency, and a one-shot ``--max 1`` job always processes what it claimed.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from tests.support.processes import Processes, hello, read_events
from tests.support.waiting import wait_until
from workqueue import publish, publish_many
from workqueue.driver import get_driver
from workqueue.models import Delivery

pytestmark = [pytest.mark.processes, pytest.mark.usefixtures("queue_db")]

SLEEP_MS = 1500


def settings_env(*entries: dict[str, Any]) -> dict[str, str]:
    return {"WORKQUEUE_SUBSCRIPTIONS": json.dumps(list(entries))}


def publish_sleepers(topic: str, count: int) -> None:
    publish_many(topic, [{"payload": {"sleepMs": SLEEP_MS}} for _ in range(count)])


def most_running_at_once(processes: Processes) -> int:
    """The largest number of handler runs that overlapped, from the handlers' own log."""
    edges = sorted(
        (event["t"], 1 if event["event"] == "start" else -1)
        for event in read_events(processes.events)
        if event["event"] in {"start", "end"}
    )
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    return peak


def test_host_with_s_runs_the_subscription_at_its_configured_concurrency(processes):
    sub = hello(handler_key="tests.record")
    env = settings_env({"name": "*", "concurrency": 1}, {"name": sub.name, "concurrency": 4})
    host = processes.start("workqueue_host", "-s", sub.name, **env)
    host.wait_for_line(f"{sub.name}: Running, concurrency 4")

    publish_sleepers(sub.topic.name, 4)

    # Four handlers of 1.5 s each: only concurrency 4 has them all running at once.
    wait_until(lambda: most_running_at_once(processes) == 4 or None, timeout=SLEEP_MS / 1000 * 3)


def test_host_with_s_falls_back_to_the_wildcard_entry_then_to_one(processes):
    a, b = hello(), hello()
    host = processes.start(
        "workqueue_host", "-s", a.name, **settings_env({"name": "*", "concurrency": 3})
    )
    host.wait_for_line(f"{a.name}: Running, concurrency 3")
    other = processes.start(
        "workqueue_host", "-s", b.name, **settings_env({"name": "someone-else", "concurrency": 5})
    )
    other.wait_for_line(f"{b.name}: Running, concurrency 1")


def test_concurrency_overrides_every_subscription_given_with_s(processes):
    a, b = hello(), hello()
    env = settings_env({"name": a.name, "concurrency": 7})
    host = processes.start(
        "workqueue_host", "-s", a.name, "-s", b.name, "--concurrency", "2", **env
    )

    host.wait_for_line(f"{a.name}: Running, concurrency 2")
    host.wait_for_line(f"{b.name}: Running, concurrency 2")


def test_concurrency_without_s_overrides_the_settings_for_every_subscription(processes):
    sub = hello(handler_key="tests.record")
    env = settings_env({"name": "*", "concurrency": 1})
    host = processes.start("workqueue_host", "--concurrency", "3", **env)
    host.wait_for_line(f"{sub.name}: Running, concurrency 3")

    publish_sleepers(sub.topic.name, 3)

    wait_until(lambda: most_running_at_once(processes) == 3 or None, timeout=SLEEP_MS / 1000 * 3)


def test_host_refuses_a_concurrency_below_one(processes):
    done = processes.run("workqueue_host", "--concurrency", "0", timeout=20)

    assert done.returncode == 2  # an argument error, before anything starts
    assert "argument --concurrency: '0' is not a concurrency from 1 to 1,000" in done.stderr


def test_work_once_takes_its_concurrency_from_the_settings(processes):
    sub = hello(handler_key="tests.record")
    publish_sleepers(sub.topic.name, 3)
    env = settings_env({"name": sub.name, "concurrency": 3})

    done = processes.run(
        "workqueue_work", "-s", sub.name, "--once", "--max", "3", "--idle-exit-ms", "200", **env
    )

    assert done.returncode == 0, done.stderr
    assert f"{sub.name}: Running, concurrency 3" in done.stdout
    assert "processed=3 reason=MaxDeliveries" in done.stdout
    assert most_running_at_once(processes) == 3


def test_work_once_max_1_processes_exactly_one_delivery_every_time_under_a_steady_stream(
    processes,
):
    """Each run claims one delivery while more keep arriving; a run that mistook "budget spent,
    claim returned" for "done" would release its delivery and report processed=0."""
    sub = hello()
    publish_many(sub.topic.name, [{"payload": {}}] * 3)  # the first run finds work at once
    stop = threading.Event()

    def produce() -> None:
        try:
            while not stop.wait(0.05):
                publish(sub.topic.name, {})
        finally:
            get_driver().close()

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        outputs = [
            processes.run("workqueue_work", "-s", sub.name, "--once", "--max", "1")
            for _ in range(8)
        ]
    finally:
        stop.set()
        producer.join()

    for done in outputs:
        assert done.returncode == 0, done.stderr
        assert "processed=1 reason=MaxDeliveries" in done.stdout, done.stdout
    assert Delivery.objects.filter(subscription=sub, status="Completed").count() == 8
    assert not Delivery.objects.filter(subscription=sub, status="InFlight").exists()
