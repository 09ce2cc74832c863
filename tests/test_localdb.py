"""The embedded PostgreSQL (``workqueue.localdb``): reuse, single start under concurrency, recovery.

Every test runs its own throwaway cluster (``WORKQUEUE_LOCALDB_DIR``) so that nothing here stops
or kills the shared cluster the rest of the suite uses.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import environ
import psycopg
import pytest
from django.core.exceptions import ImproperlyConfigured

from workqueue import localdb

REPO = Path(__file__).resolve().parents[1]
READY_LINE = "database system is ready to accept connections"


@pytest.fixture
def cluster_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    # Not tmp_path: pytest's temp root is private (0700), and as root the server runs as the
    # 'postgres' OS user, which must be able to reach the folder.
    path = Path(tempfile.mkdtemp(prefix="wq-localdb-test-", dir="/tmp"))
    monkeypatch.setenv("WORKQUEUE_LOCALDB_DIR", str(path))
    try:
        yield path
    finally:
        localdb.destroy()


def postmaster_pid(cluster: Path) -> int:
    return int((cluster / "data" / "postmaster.pid").read_text().split()[0])


def starts_logged(cluster: Path) -> int:
    return (cluster / "server.log").read_text().count(READY_LINE)


def select_one(url: str) -> tuple[str, str]:
    with psycopg.connect(url, connect_timeout=10) as conn:
        row = conn.execute("SELECT current_database(), current_user").fetchone()
    assert row is not None
    return row[0], row[1]


def wait_dead(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while localdb._process_alive(pid):
        assert time.monotonic() < deadline, f"pid {pid} still alive"
        time.sleep(0.05)


@pytest.mark.timing
def test_second_call_reuses_the_running_server(cluster_dir: Path) -> None:
    first = localdb.ensure_running()
    pid = postmaster_pid(cluster_dir)

    started = time.perf_counter()
    second = localdb.ensure_running()
    elapsed = time.perf_counter() - started

    assert second == first == localdb.url()
    assert postmaster_pid(cluster_dir) == pid
    assert starts_logged(cluster_dir) == 1
    # The fast path reads a few files; a generous bound that still catches any restart.
    assert elapsed < 0.1
    # The settings parse it with django-environ; psycopg connects with it as it is.
    config = environ.Env.db_url_config(first)
    assert config["ENGINE"] == "django.db.backends.postgresql"
    assert (config["HOST"], config["NAME"]) == ("127.0.0.1", "workqueue")
    assert select_one(first) == ("workqueue", config["USER"])


def test_concurrent_first_calls_start_one_server(cluster_dir: Path) -> None:
    code = "from workqueue import localdb; print(localdb.ensure_running())"
    env = {**os.environ, "WORKQUEUE_LOCALDB_DIR": str(cluster_dir)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    results = [proc.communicate(timeout=120) for proc in procs]

    for proc, (_out, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err
    urls = {out.strip() for out, _err in results}
    assert len(urls) == 1
    assert starts_logged(cluster_dir) == 1
    assert localdb.url() == urls.pop()


def test_restarts_after_the_postmaster_is_killed(cluster_dir: Path) -> None:
    url = localdb.ensure_running()
    pid = postmaster_pid(cluster_dir)
    socket_dir = Path((cluster_dir / "data" / "postmaster.pid").read_text().splitlines()[4])

    # A crash plus a cleaned /tmp: the pid file stays behind (naming a zombie, on machines whose
    # init does not reap) and the socket folder is gone.
    os.kill(pid, signal.SIGKILL)
    wait_dead(pid)
    for leftover in socket_dir.iterdir():
        leftover.unlink()
    socket_dir.rmdir()
    assert localdb.url() is None

    restarted = localdb.ensure_running()

    assert postmaster_pid(cluster_dir) != pid
    assert restarted == url  # the port is kept when still free, so old URLs keep working
    assert socket_dir.is_dir()
    assert select_one(restarted)[0] == "workqueue"


def test_stop_then_start_keeps_the_url(cluster_dir: Path) -> None:
    url = localdb.ensure_running()
    localdb.stop()
    assert localdb.url() is None
    assert not (cluster_dir / "data" / "postmaster.pid").exists()

    assert localdb.ensure_running() == url
    assert starts_logged(cluster_dir) == 2


def test_missing_server_binaries_say_how_to_fix_it(
    cluster_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(localdb, "_candidate_bindirs", list)
    with pytest.raises(ImproperlyConfigured) as excinfo:
        localdb.ensure_running()
    message = str(excinfo.value)
    assert "apt-get install postgresql" in message
    assert "DATABASE_URL" in message
