"""The benchmark scripts stay runnable: CI runs a short, real variant of each ``bench/`` script
(the peers' scripts need the peers installed, so they are not run here).

The figures it prints are not asserted (this machine is shared and noisy); what is asserted is
that every published message was drained and that each figure is reported.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.factories import TransportFactory
from tests.processes.test_host_processes import PROJECT_ROOT
from tests.support.database import database_url

pytestmark = pytest.mark.django_db(transaction=True)


def _bench(*args: str) -> subprocess.CompletedProcess:
    TransportFactory()  # a transactional test before this one may have flushed the seeded row
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKQUEUE_")}
    env.update(
        DJANGO_SETTINGS_MODULE="project.settings",
        DATABASE_URL=database_url(),
        PYTHONPATH=str(PROJECT_ROOT),
    )
    run = subprocess.run(
        [sys.executable, *args],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr
    return run


def test_the_drain_benchmark_runs_end_to_end_in_a_short_variant():
    run = _bench("bench/drain.py", "--messages", "300", "--concurrency", "1", "4", "--pickup", "20")

    assert re.search(r"drain 300 no-op messages, concurrency 1: [\d,]+/s", run.stdout), run.stdout
    assert re.search(r"drain 300 no-op messages, concurrency 4: [\d,]+/s", run.stdout), run.stdout
    assert re.search(r"idle pickup over 20 publishes: p50 [\d.]+ ms", run.stdout), run.stdout


def test_the_hot_key_benchmark_runs_end_to_end_in_a_short_variant():
    run = _bench("bench/hot_key.py", "--backlog", "1", "300", "--mode", "Ordered", "Exclusive")

    for mode in ("Ordered", "Exclusive"):
        for backlog in (1, 300):
            assert re.search(
                rf"{mode} hot key backlog {backlog}: claim of 8 median [\d.]+ ms", run.stdout
            ), run.stdout


def test_the_metrics_scrape_benchmark_runs_end_to_end_in_a_short_variant():
    run = _bench("bench/metrics_scrape.py", "--pending", "300")

    assert re.search(r"300 pending: scrape median [\d.]+ ms", run.stdout), run.stdout
