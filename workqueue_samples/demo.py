"""What `make demo` runs: seed the sample topology, publish a handful of greetings that take
every path, run a host until the queue is quiet, and show what happened."""

from __future__ import annotations

import uuid
from collections.abc import Callable

from workqueue import publish
from workqueue.conf import get_settings
from workqueue.exceptions import WorkQueueError
from workqueue.models import Delivery
from workqueue.runtime.host import Host, HostConfig
from workqueue_samples.topology import TOPIC, seed


def _sample_messages(run: str) -> list[dict]:
    return [
        *[
            {"payload": {"name": name}, "partition_key": "greeters"}
            for name in ("Ada", "Grace", "Linus")
        ],
        {"payload": {"name": "Barbara", "failUntilAttempt": 2}, "partition_key": "retriers"},
        {"payload": {"name": "Edsger", "sleepMs": 300}, "partition_key": "sleepers"},
        # Keyless, so its dead letter blocks no Ordered key.
        {"payload": {"name": "Mallory", "fail": "fatal"}},
        {"payload": {"name": "Dedup"}, "deduplication_key": f"demo-{run}"},
        {"payload": {"name": "Dedup again"}, "deduplication_key": f"demo-{run}"},
    ]


def run_demo(write: Callable[[str], None]) -> None:
    created = seed()
    write("Sample topology: " + (", ".join(created) if created else "already seeded"))

    run = uuid.uuid4().hex[:8]
    expected: dict[str, str] = {}
    for message in _sample_messages(run):
        result = publish(TOPIC, **message)
        write(f"publish {message['payload']} -> {result.status} {result.message_id}")
        if result.accepted:
            fatal = message["payload"].get("fail") == "fatal"
            expected[result.message_id] = "DeadLettered" if fatal else "Completed"

    write("Running the host until the queue is quiet ...")
    host = Host(
        HostConfig.from_settings(
            get_settings(),
            ["*"],
            concurrency=4,
            idle_poll_min_ms=50,
            idle_poll_max_ms=500,
            sweeper_interval_ms=0,
            reconcile_interval_ms=0,
        )
    )
    # Barbara's retry waits up to backoff_base_seconds (2 s) before her second attempt.
    result = host.run_once(idle_exit_ms=3500, max_duration_ms=60_000)
    # ``processed`` counts handler runs: a delivery retried once ran twice.
    write(f"Host ran handlers {result.processed} times, then stopped ({result.reason}).")
    _check_outcomes(expected, write)


def _check_outcomes(expected: dict[str, str], write: Callable[[str], None]) -> None:
    """Every sample delivery must have ended as its payload says (fatal: dead letter)."""
    deliveries = Delivery.objects.filter(message_id__in=list(expected)).values_list(
        "message_id", "subscription__name", "status", "attempt_count"
    )
    wrong = [
        f"{name}: {message_id} is {status}, expected {expected[str(message_id)]}"
        for message_id, name, status, _ in deliveries
        if status != expected[str(message_id)]
    ]
    if wrong or len(deliveries) != 3 * len(expected):
        raise WorkQueueError("The demo did not end as expected:\n" + "\n".join(wrong))
    completed = sum(status == "Completed" for _, _, status, _ in deliveries)
    retried = sum(status == "Completed" and attempts > 1 for _, _, status, attempts in deliveries)
    # The same numbers as the host's line above: every handler run is one attempt of one delivery.
    write(
        f"All {len(deliveries)} sample deliveries ended as expected: {completed} completed "
        f"({retried} after a retry), {len(deliveries) - completed} dead-lettered on purpose; "
        f"{sum(attempts for *_, attempts in deliveries)} handler runs in all."
    )
