"""The host commands say when they drain and why they stopped (issue 17 §12): a signal is
reported as the reason, never ``reason=Idle``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model

from tests.factories import SubscriptionFactory
from tests.support.database import database_url
from tests.support.waiting import wait_until
from workqueue import publish
from workqueue.driver import get_driver
from workqueue.models import Delivery

pytestmark = [pytest.mark.processes, pytest.mark.usefixtures("queue_db")]

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SYSTEM_USER = "workqueue-stop-user"


@pytest.fixture
def start(tmp_path: Path) -> Iterator:
    get_user_model().objects.create_user(SYSTEM_USER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKQUEUE_")}
    env.update(
        DJANGO_SETTINGS_MODULE="project.settings",
        DATABASE_URL=database_url(),
        PYTHONPATH=str(PROJECT_ROOT),
        PYTHONUNBUFFERED="1",
        WORKQUEUE_SYSTEM_USER=SYSTEM_USER,
        WORKQUEUE_HANDLER_MODULES="tests.support.handlers",
        WORKQUEUE_SHUTDOWN_DRAIN_MS="500",
        WORKQUEUE_IDLE_POLL_MIN_MS="50",
        WORKQUEUE_SWEEPER_INTERVAL_MS="600000",
        WQ_TEST_EVENT_LOG=str(tmp_path / "events.jsonl"),
    )
    started: list[subprocess.Popen] = []

    def launch(*args: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "manage.py", *args],
            cwd=PROJECT_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        started.append(proc)
        return proc

    try:
        yield launch
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=30)
        get_driver().close()


def in_flight(message_id: str) -> bool:
    return Delivery.objects.get(message_id=message_id).status == "InFlight"


def test_workqueue_work_reports_the_signal_as_the_reason_and_says_it_drains(start):
    sub = SubscriptionFactory(handler_key="tests.record", lease_seconds=30)
    message = publish(sub.topic.name, {"sleepMs": 60_000}).message_id
    proc = start(
        "workqueue_work", "-s", sub.name, "--once", "--max", "5", "--shutdown-drain-ms", "500"
    )
    wait_until(lambda: in_flight(message), timeout=30)

    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)

    assert proc.returncode == 0, out
    # Both waits of the drain: the one for handlers to finish, the one after aborting them.
    assert (
        "Stopping (Shutdown): draining running handlers (up to 500 ms; any still running are "
        "then aborted and given 500 ms more) ..."
    ) in out
    assert "reason=Shutdown (SIGTERM)" in out
    assert "reason=Idle" not in out


def test_workqueue_host_says_it_drains_on_a_signal_and_why_it_stopped(start):
    sub = SubscriptionFactory(handler_key="tests.record", lease_seconds=30)
    message = publish(sub.topic.name, {"sleepMs": 60_000}).message_id
    proc = start("workqueue_host", "-s", sub.name)
    wait_until(lambda: in_flight(message), timeout=30)

    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)

    assert proc.returncode == 0, out
    draining = out.index(
        "SIGINT received: stopped claiming; draining running handlers (up to 500 ms; any "
        "still running are then aborted and given 500 ms more) ..."
    )
    assert out.index("Host stopped (SIGINT)") > draining, out
