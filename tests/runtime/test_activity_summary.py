"""A running host says what its deliveries came to: a summary per subscription at INFO, at most
once a minute and only when something happened, echoed on the host command's console when the
project's logging would not show it (newcomer review, helper-139: a hello-world host printed
nothing when its work completed)."""

from __future__ import annotations

import logging
import uuid

import pytest

from tests.support.hosts import one, status_of, sub
from tests.support.waiting import wait_until
from workqueue import metrics, publish_many
from workqueue.runtime.activity import ActivitySummary

pytestmark = pytest.mark.usefixtures("queue_db")

ACTIVITY_LOGGER = "workqueue.runtime.activity"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def count(subscription: str, outcome: str, times: int = 1) -> None:
    metrics.labelled(metrics.DELIVERIES, subscription, outcome).inc(times)


def test_a_host_logs_what_its_deliveries_came_to_soon_after_they_ran(make_host, caplog):
    caplog.set_level(logging.INFO, logger=ACTIVITY_LOGGER)
    s = sub()
    host = make_host(one(s))
    host.start()

    results = publish_many(s.topic.name, [{"payload": {"then": "complete"}} for _ in range(3)])

    ids = [r.message_id for r in results]
    wait_until(lambda: all(status_of(i) == "Completed" for i in ids))
    wait_until(
        lambda: any(
            record.name == ACTIVITY_LOGGER
            and f"{s.name}: 3 completed in the last" in record.message
            for record in caplog.records
        ),
        timeout=10,
    )
    [record] = [r for r in caplog.records if r.name == ACTIVITY_LOGGER]
    assert record.levelno == logging.INFO
    assert record.subscription == s.name and record.outcomes == {"completed": 3}


def test_the_summary_names_each_outcome_once_an_interval_and_nothing_when_idle():
    name = f"summary-{uuid.uuid4().hex[:8]}"
    clock = Clock()
    summary = ActivitySummary(every_seconds=60, clock=clock)
    assert summary.run_once() == []  # nothing happened

    count(name, "completed", 1240)
    count(name, "retried", 3)
    count(name, "dead_lettered")
    clock.now += 12
    assert summary.run_once() == [
        f"{name}: 1,240 completed, 3 retried, 1 dead-lettered in the last 12 s"
    ]

    count(name, "completed", 5)
    clock.now += 30
    assert summary.run_once() == []  # a line 30 s ago: at most one a minute
    clock.now += 30
    assert summary.run_once() == [f"{name}: 5 completed in the last 60 s"]
    clock.now += 120
    assert summary.run_once() == []  # nothing since


def test_the_last_summary_at_shutdown_counts_what_the_interval_held_back():
    name = f"summary-{uuid.uuid4().hex[:8]}"
    clock = Clock()
    summary = ActivitySummary(every_seconds=60, clock=clock)
    count(name, "completed")
    clock.now += 1
    assert summary.run_once() == [f"{name}: 1 completed in the last 1 s"]

    count(name, "released", 2)
    clock.now += 5
    assert summary.run_once() == []
    assert summary.run_once(final=True) == [f"{name}: 2 handed back in the last 5 s"]


def test_the_summary_is_echoed_only_when_the_logging_would_not_show_it(caplog):
    name = f"summary-{uuid.uuid4().hex[:8]}"
    echoed: list[str] = []
    clock = Clock()
    summary = ActivitySummary(every_seconds=0, clock=clock, echo=echoed.append)

    caplog.set_level(logging.WARNING, logger=ACTIVITY_LOGGER)
    count(name, "completed")
    clock.now += 1
    lines = summary.run_once()
    assert echoed == lines == [f"{name}: 1 completed in the last 1 s"]

    caplog.set_level(logging.INFO, logger=ACTIVITY_LOGGER)
    count(name, "completed")
    clock.now += 1
    assert summary.run_once() and len(echoed) == 1  # logged, so not printed a second time
