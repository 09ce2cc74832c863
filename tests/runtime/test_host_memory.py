"""A host's memory follows what it runs, not what it has run: once a delivery is settled nothing
in the host keeps it (its execution, its payload); and the host commands take what start-up
made out of the garbage collector's full walks. Against PostgreSQL, hosts in this process.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import signal
import threading
import time
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command

from tests.factories import SubscriptionFactory
from tests.support.handlers import registry
from tests.support.hosts import sub
from tests.support.waiting import wait_until
from workqueue import publish_many
from workqueue.models import Delivery
from workqueue.runtime import consumer
from workqueue.runtime.executor import DeliveryExecution
from workqueue.runtime.handlers import BaseWorkHandler
from workqueue.runtime.outcome import Outcome
from workqueue.types import ClaimedDelivery

pytestmark = pytest.mark.usefixtures("queue_db")


def _held_by_this_process() -> tuple[int, int]:
    """(executions, claimed deliveries) still alive, cyclic garbage collected first."""
    gc.collect()
    objects = gc.get_objects()
    return (
        sum(isinstance(o, DeliveryExecution) for o in objects),
        sum(isinstance(o, ClaimedDelivery) for o in objects),
    )


class CountsWhatIsHeld(BaseWorkHandler):
    """Sleeps 2 ms; every 50th message counts the executions alive in the process."""

    held: list[int] = []

    def handle(self, message: Any, context: Any) -> Outcome:
        time.sleep(0.002)
        if message.payload["n"] % 50 == 0:
            type(self).held.append(_held_by_this_process()[0])
        return Outcome.complete()


registry.register("t.count-held", CountsWhatIsHeld)


def test_a_host_lets_go_of_each_delivery_once_settled_not_when_its_first_heartbeat_was_due(
    make_host,
):
    # Every delivery schedules its first heartbeat a third of its lease ahead (20 s here) and
    # cancels it when the handler returns. The cancelled timers kept their deliveries until
    # that deadline: a host draining thousands a second held tens of thousands of payloads,
    # and every full garbage collection walked them all.
    s = sub(lease_seconds=60)
    host = make_host([{"name": s.name, "concurrency": 4}])
    host.start()
    count = 400
    publish_many(s.topic.name, [{"payload": {"then": "complete", "pad": "x" * 2_000}}] * count)

    wait_until(
        lambda: Delivery.objects.filter(subscription=s, status="Completed").count() == count,
        timeout=60,
    )
    # The last completion batch may still be on its way back; nothing else holds a delivery.
    held: list[tuple[int, int]] = []
    with contextlib.suppress(AssertionError):
        wait_until(lambda: held.append(_held_by_this_process()) or held[-1] == (0, 0), timeout=5)
    executions, deliveries = held[-1]
    assert (executions, deliveries) == (0, 0), (
        f"{executions} executions and {deliveries} claimed deliveries of {count} settled ones "
        "are still held"
    )


def test_a_slot_that_keeps_passing_on_to_deliveries_claimed_ahead_keeps_none_it_ran(
    make_host, monkeypatch
):
    # A slot whose handler returns while deliveries claimed ahead wait runs the next one on the
    # same thread, and so on for as long as they keep coming: each execution named the next,
    # and the first was held for the whole run, so every delivery of a steady stream stayed.
    monkeypatch.setattr(consumer, "PREFETCH_HANDLER_SECONDS", 60.0)
    monkeypatch.setattr(consumer, "PREFETCH_WINDOW_SECONDS", 60.0)
    CountsWhatIsHeld.held = []
    s = sub(handler_key="t.count-held")
    host = make_host([{"name": s.name, "concurrency": 1, "prefetch": 8}])
    count = 400
    publish_many(s.topic.name, [{"payload": {"n": n}} for n in range(count)])
    host.start()

    wait_until(
        lambda: Delivery.objects.filter(subscription=s, status="Completed").count() == count,
        timeout=60,
    )
    # One running, eight claimed ahead, and a completion batch or two on their way.
    assert max(CountsWhatIsHeld.held) <= 40, f"executions alive as it ran: {CountsWhatIsHeld.held}"


@pytest.fixture
def unfrozen_afterwards():
    yield
    gc.unfreeze()  # back to how the rest of the test process runs


def test_a_one_shot_run_freezes_what_start_up_made_before_it_claims(unfrozen_afterwards):
    # Django's apps, models and settings live as long as the process, yet every full
    # collection walked them: about a tenth of a busy host's CPU (bench/drain.py).
    get_user_model().objects.create_user("workqueue-system")
    s = SubscriptionFactory()
    gc.unfreeze()

    call_command("workqueue_work", "-s", s.name, "--once", "--idle-exit-ms", "100")

    frozen = gc.get_freeze_count()
    assert frozen > 10_000, f"{frozen} objects frozen"
    assert not any(o is SubscriptionFactory for o in gc.get_objects()), "start-up left unfrozen"


def test_a_host_process_freezes_what_start_up_made_before_it_claims(unfrozen_afterwards):
    get_user_model().objects.create_user("workqueue-system")
    s = SubscriptionFactory()
    gc.unfreeze()
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    returned = threading.Event()

    def stop_the_host() -> None:
        # What stops a host process, once the command handles it (sent earlier, it would end
        # this test process): the command then drains and returns.
        wait_until(lambda: signal.getsignal(signal.SIGTERM) != handlers[0], timeout=60)
        time.sleep(0.5)
        if not returned.is_set():
            os.kill(os.getpid(), signal.SIGTERM)

    stopper = threading.Thread(target=stop_the_host, daemon=True)
    stopper.start()
    try:
        call_command("workqueue_host", "-s", s.name, stdout=io.StringIO())
    finally:
        returned.set()
        stopper.join(timeout=70)  # a signal it is sending still finds the command's handler
        signal.signal(signal.SIGTERM, handlers[0])
        signal.signal(signal.SIGINT, handlers[1])

    frozen = gc.get_freeze_count()
    assert frozen > 10_000, f"{frozen} objects frozen"
    assert not any(o is SubscriptionFactory for o in gc.get_objects()), "start-up left unfrozen"
