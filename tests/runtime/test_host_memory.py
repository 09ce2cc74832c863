"""A host's memory follows what it runs, not what it has run: once a delivery is settled nothing
in the host keeps it (its execution, its payload); and the host commands take what start-up
made out of the garbage collector's full walks. Against PostgreSQL, hosts in this process.
"""

from __future__ import annotations

import contextlib
import gc
import io
import signal
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command

from tests.factories import SubscriptionFactory
from tests.support.handlers import registry
from tests.support.hosts import sub
from tests.support.waiting import wait_until
from workqueue import publish, publish_many
from workqueue.apps import FROZEN_BEFORE_THE_APPS
from workqueue.models import Delivery, Subscription
from workqueue.runtime import consumer
from workqueue.runtime.executor import DeliveryExecution
from workqueue.runtime.handlers import BaseWorkHandler, register_handler
from workqueue.runtime.host import Host
from workqueue.runtime.outcome import Outcome
from workqueue.types import ClaimedDelivery

pytestmark = pytest.mark.usefixtures("queue_db")


def _held_by_this_process(subscription: Subscription) -> tuple[int, int]:
    """(executions, claimed deliveries) of ``subscription`` still alive, cyclic garbage
    collected first: only its own, whatever an earlier test in this process left."""
    gc.collect()
    executions = deliveries = 0
    # One walk of the heap, not one a count: late in a full run the heap holds millions of
    # objects and each walk took seconds, on the handler's only slot.
    for o in gc.get_objects():
        if isinstance(o, DeliveryExecution):
            executions += o.plan.name == subscription.name
        elif isinstance(o, ClaimedDelivery):
            deliveries += o.subscription_id == str(subscription.pk)
    return executions, deliveries


class CountsWhatIsHeld(BaseWorkHandler):
    """Sleeps 2 ms; every 100th message counts its subscription's executions alive (four
    counts in a run of 400: held from the first on, the second count already saw 100).

    Counted among the executions made while the test runs (``made``, weak references), not by
    a walk of the heap: ``gc.get_objects()`` on this thread hands out references to tuples
    other threads are still building, and CPython then fails to finish them (a CI run's main
    thread raised "SystemError: Objects/tupleobject.c:927: bad argument to internal
    function" in psycopg)."""

    held: list[int] = []
    subscription: Subscription | None = None
    made: weakref.WeakSet[DeliveryExecution] = weakref.WeakSet()

    def handle(self, message: Any, context: Any) -> Outcome:
        time.sleep(0.002)
        if message.payload["n"] % 100 == 0:
            gc.collect()
            name = type(self).subscription.name
            type(self).held.append(sum(1 for e in list(type(self).made) if e.plan.name == name))
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
        wait_until(lambda: held.append(_held_by_this_process(s)) or held[-1] == (0, 0), timeout=5)
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
    made = CountsWhatIsHeld.made = weakref.WeakSet()
    real_init = DeliveryExecution.__init__

    def recorded_init(self: DeliveryExecution, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        made.add(self)

    monkeypatch.setattr(DeliveryExecution, "__init__", recorded_init)
    s = CountsWhatIsHeld.subscription = sub(handler_key="t.count-held")
    host = make_host([{"name": s.name, "concurrency": 1, "prefetch": 8}])
    count = 400
    publish_many(s.topic.name, [{"payload": {"n": n}} for n in range(count)])
    host.start()

    wait_until(
        lambda: Delivery.objects.filter(subscription=s, status="Completed").count() == count,
        timeout=60,
    )
    # One running, eight claimed ahead, and a completion batch or two on their way; at least
    # the counting handler's own (else the count saw nothing of this subscription's).
    held = CountsWhatIsHeld.held
    assert min(held) >= 1 and max(held) <= 40, f"executions alive as it ran: {held}"


#: As each probe handler saw it: (objects frozen, whether a start-up object was still walked,
#: whether the host was: it is built after the freeze, so what it makes is walked as usual).
FROZEN_AS_IT_RAN: list[tuple[int, bool, bool]] = []


@register_handler("tests.freeze-probe")
class ReportsWhatIsFrozen(BaseWorkHandler):
    def handle(self, message: Any, context: Any) -> Outcome:
        objects = gc.get_objects()
        start_up_walked = any(o is SubscriptionFactory for o in objects)
        host_walked = any(isinstance(o, Host) for o in objects)
        FROZEN_AS_IT_RAN.append((gc.get_freeze_count(), start_up_walked, host_walked))
        return Outcome.complete()


@pytest.fixture
def command_in_this_process() -> Iterator[Subscription]:
    """A subscription for a host command run in this process, with one message waiting; the
    signal handlers the command installs are put back afterwards, as is the collector."""
    get_user_model().objects.create_user("workqueue-system")
    s = SubscriptionFactory(handler_key="tests.freeze-probe")
    publish(s.topic.name, {"n": 1})
    FROZEN_AS_IT_RAN.clear()
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    frozen_before = gc.get_freeze_count()
    yield s
    signal.signal(signal.SIGTERM, handlers[0])
    signal.signal(signal.SIGINT, handlers[1])
    if frozen_before <= FROZEN_BEFORE_THE_APPS:  # nothing of this process's own was frozen
        gc.unfreeze()  # whatever the test (or a broken command) froze


def _frozen_as_it_ran() -> None:
    # Django's apps, models and settings live as long as the process, yet every full
    # collection walked them: about a tenth of a busy host's CPU (bench/drain.py).
    [(frozen, start_up_walked, host_walked)] = FROZEN_AS_IT_RAN
    assert frozen > 10_000, f"{frozen} objects frozen while the handler ran"
    assert not start_up_walked, "a start-up object was still in the collector's walks"
    assert host_walked, "the host was frozen with start-up: its cycles would never be collected"
    # Handed back at the end: a command run inside another program leaves it as it was.
    assert gc.get_freeze_count() == 0


def test_a_one_shot_run_works_with_start_up_objects_frozen_and_hands_them_back(
    command_in_this_process,
):
    call_command("workqueue_work", "-s", command_in_this_process.name, "--once")

    _frozen_as_it_ran()


def test_a_host_works_with_start_up_objects_frozen_and_hands_them_back(command_in_this_process):
    original_handler = signal.getsignal(signal.SIGTERM)

    def stop_the_host() -> None:
        # What SIGTERM does to a host process: the command's own handler, called here rather
        # than through a real signal, which after the command has put back the handler it
        # found would end this test process.
        with contextlib.suppress(AssertionError):  # the command must return for the test to fail
            wait_until(lambda: FROZEN_AS_IT_RAN, timeout=60)
        handler = signal.getsignal(signal.SIGTERM)
        if callable(handler) and handler is not original_handler:
            handler(signal.SIGTERM, None)

    stopper = threading.Thread(target=stop_the_host, daemon=True)
    stopper.start()
    call_command("workqueue_host", "-s", command_in_this_process.name, stdout=io.StringIO())
    stopper.join(timeout=70)

    _frozen_as_it_ran()


def test_a_process_that_froze_objects_itself_keeps_them_frozen_after_a_command(
    command_in_this_process,
):
    gc.freeze()
    frozen = gc.get_freeze_count()

    call_command("workqueue_work", "-s", command_in_this_process.name, "--once")

    # Not one more frozen, nor unfrozen (frozen objects freed meanwhile leave the count).
    assert FROZEN_AS_IT_RAN[0][0] <= frozen
    assert gc.get_freeze_count() > frozen * 0.9
