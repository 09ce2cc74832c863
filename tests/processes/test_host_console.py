"""What ``manage.py workqueue_host`` prints while it runs, in a project whose logging shows no
INFO line (the sample project's root logger is at WARNING, as a project without LOGGING is)."""

from __future__ import annotations

import signal
import time

import pytest

from tests.support.hosts import status_of
from tests.support.processes import hello
from tests.support.waiting import wait_until
from workqueue import publish_many
from workqueue.runtime.activity import LOOK_EVERY_SECONDS

pytestmark = [pytest.mark.processes, pytest.mark.usefixtures("queue_db")]


def test_a_host_prints_what_its_deliveries_came_to(processes):
    """A newcomer's hello-world host printed nothing when its work completed (newcomer
    review, helper-139): the summary line is printed on the console too."""
    sub = hello()
    proc = processes.host(sub.name)

    publish_many(sub.topic.name, [{"payload": {"name": f"n{i}"}} for i in range(3)])

    proc.wait_for_line(f"{sub.name}: 3 completed in the last", timeout=20)
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


def test_a_quiet_host_prints_no_summary(processes):
    sub = hello()
    proc = processes.start("workqueue_host", "-s", sub.name, "-v", "0")

    proc.wait_for_line(f"{sub.name}: Running")  # start-up lines are printed at -v 0 too
    [result] = publish_many(sub.topic.name, [{"payload": {"name": "quiet"}}])
    wait_until(lambda: status_of(result.message_id) == "Completed")
    time.sleep(2 * LOOK_EVERY_SECONDS)  # when the summary would have been printed

    proc.popen.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert not [line for line in proc.lines if "completed in the last" in line], proc.lines
