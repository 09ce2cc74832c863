"""Runs every command of workqueue_samples/README.md, in order, on a fresh database, and checks
what they print: the walkthrough cannot go stale."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from tests.support.environment import project_environment

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "workqueue_samples" / "README.md"


def _shell_blocks() -> list[str]:
    return re.findall(r"```sh\n(.*?)```", README.read_text(), re.S)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_walkthrough_has_commands_for_every_step():
    script = "\n".join(_shell_blocks())
    for command in (
        "workqueue publish",
        "workqueue stats",
        "workqueue_work",
        "failUntilAttempt",
        "replay",
        "discard",
        "partitions",
        "--dedup-key",
        "X-API-Key",
        "dashboard",
        "greet.enqueue",
        "samples.guestbook",
    ):
        assert command in script


def test_every_walkthrough_command_runs_and_prints_what_the_page_says(scratch_database):
    env = project_environment()
    env.update(
        DATABASE_URL=scratch_database,
        PORT=str(_free_port()),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        PYTHONUNBUFFERED="1",
    )
    script = "set -euo pipefail\n" + "\n".join(_shell_blocks())

    done = subprocess.run(
        ["bash", "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = done.stdout
    assert done.returncode == 0, f"{out}\n{done.stderr}"

    assert "system user workqueue-system" in out
    assert out.count("Accepted ") >= 5
    assert "processed=3 reason=Idle" in out
    # The retry step: each of Flaky's three deliveries fails once, waits out its backoff and
    # completes on attempt 2, all in one job.
    assert "processed=6 reason=Idle" in out
    for name in ("samples.hello-log", "samples.hello-exclusive", "samples.hello-ordered"):
        for attempt in (1, 2):
            greeting = rf"Hello, Flaky! subscription={re.escape(name)} .* attempt={attempt}/3 "
            assert re.search(greeting, done.stderr), (name, attempt)
    assert re.search(r"venue-3\s+Blocked", out)
    assert "Replayed" in out
    assert "SUCCESSFUL Hello, Ada!" in out  # a Tasks API task, its result read in a new process
    # The guestbook: the failed attempt's entry rolled back with its completion.
    assert "guestbook: [('Grace', 2)]" in out
    assert "Discarded" in out and "Cancel requested" in out
    published = re.findall(r"^(Accepted|Duplicate) ([0-9a-f-]{36})$", out, re.M)
    duplicate = next(n for n, (status, _) in enumerate(published) if status == "Duplicate")
    first, second = published[duplicate - 1 : duplicate + 1]
    assert (first[0], second[0]) == ("Accepted", "Duplicate") and first[1] == second[1]
    assert '"status":"Accepted"' in out.replace(" ", "")
    assert "without a key: 401" in out
    assert "dashboard without login: 302" in out

    with psycopg.connect(scratch_database) as conn:
        states = dict(
            conn.execute(
                """SELECT s.name, d.status FROM workqueue_delivery d
                     JOIN workqueue_subscription s ON s.id = d.subscription_id
                     JOIN workqueue_message m ON m.id = d.message_id
                    WHERE m.payload ->> 'name' = %s""",
                ["Sleepy"],
            ).fetchall()
        )
        flaky = conn.execute(
            """SELECT d.status, d.attempt_count, d.last_error FROM workqueue_delivery d
                 JOIN workqueue_message m ON m.id = d.message_id
                WHERE m.payload ->> 'name' = 'Flaky'"""
        ).fetchall()
        eve = conn.execute(
            """SELECT d.status FROM workqueue_delivery d
                 JOIN workqueue_subscription s ON s.id = d.subscription_id
                 JOIN workqueue_message m ON m.id = d.message_id
                WHERE m.payload ->> 'name' = 'Eve' AND s.name = 'samples.hello-ordered'"""
        ).fetchone()
    assert states["samples.hello-exclusive"] == "Discarded"
    assert eve == ("Completed",)
    assert len(flaky) == 3
    for status, attempts, last_error in flaky:
        assert (status, attempts) == ("Completed", 2)
        assert "Failing until attempt 2 (this is attempt 1)" in last_error
