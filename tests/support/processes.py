"""Subprocesses of the project (``manage.py`` commands, scripts, host processes) with the
suite's environment and a database URL: the test database unless a test names another."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from tests.factories import SubscriptionFactory
from tests.support.database import database_url
from tests.support.environment import project_environment
from tests.support.waiting import wait_until
from workqueue.models import Subscription

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# The user host processes run handlers as (WORKQUEUE_SYSTEM_USER); the `processes` fixture
# creates it.
SYSTEM_USER = "workqueue-proc-user"
DRAIN_MS = 500


def subprocess_environment(url: str | None = None, **settings: str) -> dict[str, str]:
    """The environment of a project subprocess: the suite's (no developer ``WORKQUEUE_*`` or
    ``DJANGO_*`` settings), the project's settings module, ``DATABASE_URL`` (``url``, else this
    worker's test database) and ``settings`` on top."""
    env = project_environment()
    env.update(
        DJANGO_SETTINGS_MODULE="project.settings",
        DATABASE_URL=url or database_url(),
        PYTHONPATH=str(PROJECT_ROOT),
        **settings,
    )
    return env


def run_python(
    *args: str, env: dict[str, str], timeout: float = 120, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in the project's folder, output captured; with ``check``, a non-zero
    exit fails the test with the output."""
    done = subprocess.run(
        [sys.executable, *args],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check:
        assert done.returncode == 0, f"{args}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def run_manage(
    *args: str, env: dict[str, str], timeout: float = 120, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """``manage.py ARGS``, as :func:`run_python` runs it."""
    return run_python("manage.py", *args, env=env, timeout=timeout, check=check)


def read_events(path: Path) -> list[dict[str, Any]]:
    """The JSON lines the ``tests.record`` handler wrote to ``path`` (WQ_TEST_EVENT_LOG)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def hello(**fields: Any) -> Subscription:
    """A subscription whose handler is the sample ``samples.hello`` unless ``fields`` say."""
    fields.setdefault("handler_key", "samples.hello")
    return SubscriptionFactory(**fields)


class Proc:
    """A ``manage.py`` subprocess whose stdout lines are collected as they arrive."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.args = args
        self.log = log
        self.lines: list[str] = []
        self._stderr = log.open("w")
        self.popen = subprocess.Popen(
            [sys.executable, "manage.py", *args],
            cwd=PROJECT_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            start_new_session=True,  # signals sent to the test run never reach it
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for_line(self, text: str, timeout: float = 20.0) -> None:
        try:
            wait_until(lambda: any(text in line for line in self.lines), timeout)
        except AssertionError:
            raise AssertionError(
                f"{self.args} never printed {text!r} (exit {self.popen.poll()}); "
                f"stdout={self.lines} stderr={self.stderr()[-3000:]}"
            ) from None

    def stderr(self) -> str:
        self._stderr.flush()
        return self.log.read_text()

    def wait(self, timeout: float) -> int:
        code = self.popen.wait(timeout)
        self._reader.join(timeout=5)
        return code

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=30)
        self._reader.join(timeout=5)
        self.popen.stdout.close()
        self._stderr.close()


class Processes:
    """Starts manage.py commands against the test database, with the test handlers loaded and
    their events logged to ``events``; kills leftovers at the end."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.events = tmp_path / "events.jsonl"
        self.started: list[Proc] = []
        self.env = subprocess_environment(
            PYTHONUNBUFFERED="1",
            WORKQUEUE_SYSTEM_USER=SYSTEM_USER,
            WORKQUEUE_HANDLER_MODULES="tests.support.handlers",
            WORKQUEUE_SHUTDOWN_DRAIN_MS=str(DRAIN_MS),
            WORKQUEUE_IDLE_POLL_MIN_MS="50",
            WORKQUEUE_IDLE_POLL_MAX_MS="500",
            WORKQUEUE_SWEEPER_INTERVAL_MS="600000",
            WQ_TEST_EVENT_LOG=str(self.events),
        )

    def start(self, *args: str, **env: str) -> Proc:
        proc = Proc(
            list(args), {**self.env, **env}, self.tmp_path / f"proc-{len(self.started)}.err"
        )
        self.started.append(proc)
        return proc

    def host(self, *names: str, concurrency: int = 2, **env: str) -> Proc:
        """``workqueue_host -s NAME ...``, returned once every subscription is Running."""
        args = ["workqueue_host", "--concurrency", str(concurrency)]
        for name in names:
            args += ["-s", name]
        proc = self.start(*args, **env)
        for name in names:
            proc.wait_for_line(f"{name}: Running")
        return proc

    def run(self, *args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
        return run_manage(*args, env={**self.env, **env}, timeout=timeout)

    def close(self) -> None:
        for proc in self.started:
            proc.stop()


def backends_of(pid: int) -> int:
    """How many server backends a workqueue process with this pid still has (its connections
    name it in their application_name)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
            [f"workqueue:{pid}"],
        )
        return cursor.fetchone()[0]
