"""The container-job examples under docs/ stay deployable: each runs `manage.py workqueue_work`
with flags its --help lists and values its parser accepts, its scaler query is exactly what
`manage.py workqueue scaler-query` prints for that vendor and subscription (modulo whitespace),
and its timings follow the README's sizing rules."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# PyYAML is not a requirement of its own: it arrives with sqlfluff (requirements.txt).
import yaml

from tests.support.processes import PROJECT_ROOT, run_manage, subprocess_environment
from workqueue.management.commands.workqueue_work import Command as WorkCommand

pytestmark = pytest.mark.processes

# scaler-query and --help only render text, so a URL that selects the vendor is enough: nothing
# connects to it.
VENDOR_URLS = {
    "postgresql": "postgres://scaler@127.0.0.1:9/app",
    "mssql": "mssql://scaler@127.0.0.1:9/app",
}
# The name each KEDA trigger type gives its threshold.
TARGET_KEYS = {"postgresql": "targetQueryValue", "mssql": "targetValue"}
# Container Apps gives a stopping replica 30 s after SIGTERM before it kills it.
CONTAINER_APPS_GRACE_SECONDS = 30


@dataclass(frozen=True)
class Example:
    """What the test reads from one example file, wherever the platform keeps it."""

    container: dict[str, Any]
    trigger: dict[str, Any]
    deadline_seconds: int  # when the platform stops the job however it is doing
    grace_seconds: int  # how long it waits after SIGTERM before killing it
    scheduler_retries: int


KEDA_PATH = PROJECT_ROOT / "docs" / "keda-scaledjob.yaml"


def _keda_scaled_job() -> dict[str, Any]:
    [job] = [d for d in yaml.safe_load_all(KEDA_PATH.read_text()) if d["kind"] == "ScaledJob"]
    return job


def _keda() -> Example:
    job = _keda_scaled_job()
    target = job["spec"]["jobTargetRef"]
    pod = target["template"]["spec"]
    return Example(
        container=pod["containers"][0],
        trigger=job["spec"]["triggers"][0],
        deadline_seconds=target["activeDeadlineSeconds"],
        grace_seconds=pod["terminationGracePeriodSeconds"],
        scheduler_retries=target["backoffLimit"],
    )


def _container_apps() -> Example:
    path = PROJECT_ROOT / "docs" / "azure-container-apps-job.yaml"
    job = yaml.safe_load(path.read_text())["properties"]
    configuration = job["configuration"]
    return Example(
        container=job["template"]["containers"][0],
        trigger=configuration["eventTriggerConfig"]["scale"]["rules"][0],
        deadline_seconds=configuration["replicaTimeout"],
        grace_seconds=CONTAINER_APPS_GRACE_SECONDS,
        scheduler_retries=configuration["replicaRetryLimit"],
    )


EXAMPLES = [pytest.param(_keda, id="keda-scaledjob"), pytest.param(_container_apps, id="aca-job")]


def _manage(vendor: str, *args: str) -> str:
    env = subprocess_environment(VENDOR_URLS[vendor])
    return run_manage(*args, env=env, check=True).stdout


def _work_args(example: Example) -> list[str]:
    *_, script, command = example.container["command"]
    assert (Path(script).name, command) == ("manage.py", "workqueue_work")
    return example.container["args"]


def _options(example: Example) -> argparse.Namespace:
    # Django's parser raises CommandError on an unknown flag, a bad value or a missing --once.
    parser = WorkCommand().create_parser("manage.py", "workqueue_work")
    return parser.parse_args(_work_args(example))


@pytest.mark.parametrize("load", EXAMPLES)
def test_example_runs_workqueue_work_with_flags_its_help_lists(load):
    example = load()
    help_text = _manage(example.trigger["type"], "workqueue_work", "--help")

    flags = [arg for arg in _work_args(example) if arg.startswith("-")]

    assert "--once" in flags
    for flag in flags:
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text), flag
    _options(example)


@pytest.mark.parametrize("load", EXAMPLES)
def test_example_query_is_what_scaler_query_prints_for_its_vendor_and_subscription(load):
    example = load()
    vendor = example.trigger["type"]
    printed = _manage(vendor, "workqueue", "scaler-query", "-s", _options(example).subscription)

    query = example.trigger["metadata"]["query"]

    assert query.split() == printed.split()


@pytest.mark.parametrize("load", EXAMPLES)
def test_example_sizes_its_target_deadline_and_grace_for_the_drain(load):
    example = load()
    options = _options(example)
    drain_seconds = options.shutdown_drain_ms / 1000
    at_once = min(options.max, options.concurrency or options.max)

    target = example.trigger["metadata"][TARGET_KEYS[example.trigger["type"]]]

    # One unit of Backlog per delivery a job holds: running jobs cancel out their own work.
    assert float(target) == at_once
    # The queue owns retries; a scheduler retry would only be one more job.
    assert example.scheduler_retries == 0
    # A shutdown waits for handlers, aborts them, then waits again: up to two drains.
    assert example.grace_seconds > 2 * drain_seconds
    assert options.max_duration_ms is not None
    assert example.deadline_seconds > options.max_duration_ms / 1000 + 2 * drain_seconds


def test_keda_example_keeps_the_default_strategy_and_never_restarts_a_pod():
    job = _keda_scaled_job()

    # "default" starts Backlog minus running Jobs, and Backlog already counts their deliveries.
    assert job["spec"].get("scalingStrategy", {}).get("strategy", "default") == "default"
    assert job["spec"]["jobTargetRef"]["template"]["spec"]["restartPolicy"] == "Never"
