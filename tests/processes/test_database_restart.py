"""Nothing accepted is lost across a database restart: a host keeps running while its
PostgreSQL is stopped (with deliveries Pending and InFlight) and started again mid-stream, every
message whose publish was Accepted (before or after the restart) ends Completed, and a publish
during the outage is refused (exit 1, each message TransportUnavailable) and stored nowhere.

Runs on a private throwaway cluster, so restarting it disturbs nothing else in the suite.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import psycopg
import pytest

from tests.support.processes import PROJECT_ROOT, run_manage, subprocess_environment
from workqueue import localdb

pytestmark = pytest.mark.processes

TOPOLOGY = """
from workqueue.models import Subscription, Topic, Transport
topic = Topic.objects.create(name="restart.t", transport=Transport.objects.get(name="Database"))
for mode in ("None", "Exclusive", "Ordered"):
    Subscription.objects.create(
        topic=topic, name=f"restart.{mode.lower()}", partition_mode=mode, lease_seconds=5,
        handler_key="samples.hello",
    )
"""


def _env(url: str) -> dict[str, str]:
    return subprocess_environment(
        url,
        WORKQUEUE_SWEEPER_INTERVAL_MS="1000",
        WORKQUEUE_IDLE_POLL_MAX_MS="500",
        WORKQUEUE_SHUTDOWN_DRAIN_MS="2000",
    )


def _publish(env: dict[str, str], batch: int, count: int, sleep_ms: int = 0) -> list[str]:
    """Publish ``count`` messages (keys k0..k4); the ids whose publish was Accepted."""
    done = _publish_raw(env, batch, count, sleep_ms)
    try:
        results = json.loads(done.stdout)
    except ValueError:
        return []  # the database was down for the whole call: nothing was accepted
    return [r["message_id"] for r in results if r["status"] == "Accepted"]


def _publish_raw(
    env: dict[str, str], batch: int, count: int, sleep_ms: int = 0
) -> subprocess.CompletedProcess:
    return run_manage(
        "workqueue",
        "publish",
        "--topic",
        "restart.t",
        "--count",
        str(count),
        "--partition-key",
        f"k{batch % 5}",
        "--payload",
        json.dumps({"name": f"b{batch}", "sleepMs": sleep_ms}),
        "--json",
        env=env,
    )


def _statuses(url: str) -> dict[str, int]:
    with psycopg.connect(url, autocommit=True) as conn:
        return dict(
            conn.execute("SELECT status, count(*) FROM workqueue_delivery GROUP BY 1").fetchall()
        )


def test_every_accepted_message_is_completed_across_a_database_restart(private_cluster, tmp_path):
    url = private_cluster
    log = tmp_path / "host.log"
    env = _env(url)
    for args in (("migrate", "-v0"), ("workqueue_samples", "seed"), ("shell", "-c", TOPOLOGY)):
        done = run_manage(*args, env=env)
        assert done.returncode == 0, done.stderr
    # Output to a file, not a pipe: an unread pipe fills up and blocks the host's logging.
    output = log.open("w")
    host = subprocess.Popen(
        [sys.executable, "manage.py", "workqueue_host"],
        cwd=PROJECT_ROOT,
        env=env,
        stdout=output,
        stderr=subprocess.STDOUT,
        text=True,
    )
    accepted: list[str] = []
    try:
        for batch in range(3):
            accepted += _publish(env, batch, 20, sleep_ms=400)
        # Work is both waiting and running when the database goes away under the host ...
        deadline = time.monotonic() + 20
        while not {"Pending", "InFlight"} <= set(_statuses(url)):
            assert time.monotonic() < deadline, _statuses(url)
            time.sleep(0.05)
        localdb.stop()
        # ... and a publish meanwhile is refused, saying so, rather than lost.
        during = _publish_raw(env, 3, 20)
        refused = json.loads(during.stdout)
        assert during.returncode == 1, during.stderr
        assert [(r["status"], r["error"]) for r in refused] == [
            ("Rejected", "TransportUnavailable")
        ] * 20
        time.sleep(1.0)
        assert localdb.ensure_running() == url
        for batch in range(4, 7):
            accepted += _publish(env, batch, 20)

        assert len(accepted) >= 120, "the publishes before and after the restart are accepted"
        deadline = time.monotonic() + 90
        with psycopg.connect(url, autocommit=True) as conn:
            while True:
                rows = conn.execute(
                    "SELECT d.status, count(*) FROM workqueue_delivery d "
                    "WHERE d.message_id = ANY(%s::uuid[]) GROUP BY d.status",
                    [accepted],
                ).fetchall()
                counts = dict(rows)
                if counts == {"Completed": 3 * len(accepted)}:
                    break
                if time.monotonic() > deadline:
                    pytest.fail(f"not all completed: {counts}\n{log.read_text()[-5000:]}")
                time.sleep(0.5)
            messages = conn.execute(
                "SELECT count(*) FROM workqueue_message WHERE id = ANY(%s::uuid[])", [accepted]
            ).fetchone()
            stored = conn.execute(
                "SELECT count(*) FROM workqueue_message WHERE id = ANY(%s::uuid[])",
                [[r["message_id"] for r in refused]],
            ).fetchone()
        assert messages == (len(accepted),)
        assert stored == (0,), "a refused publish must not have been stored after all"
        assert host.poll() is None, "the host must survive the database restart"
    finally:
        if host.poll() is None:
            host.send_signal(signal.SIGTERM)
        host.wait(timeout=60)
        output.close()
    assert host.returncode == 0, log.read_text()[-5000:]
