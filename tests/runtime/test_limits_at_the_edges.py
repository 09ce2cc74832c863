"""The host runtime at its limits (audit helper-134): concurrency across a rename, a one-shot
budget read against its claim, what a handler returns or asks for at the edges of what Python
represents, and health after a failed rate-limit take."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from tests.support.handlers import probe, registry
from tests.support.hosts import one, states, status_of, sub
from tests.support.waiting import wait_until
from workqueue import publish
from workqueue.exceptions import TransientDriverError
from workqueue.models import Delivery, Subscription
from workqueue.runtime.consumer import Consumer
from workqueue.runtime.handlers import BaseWorkHandler
from workqueue.runtime.outcome import Outcome
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")


def test_a_renamed_subscriptions_lingering_handler_still_counts_against_its_concurrency(
    make_host,
):
    """A re-plan that gives up on a handler passes it to the subscription's next consumer as a
    predecessor, so it keeps a slot of the concurrency until it returns. The predecessor is
    looked up by the subscription's *name*: rename the subscription (allowed on the Database
    transport, and a settings edit like any other) and the new consumer, planned under the new
    name, counts nothing of it: concurrency 1 runs two handlers at once."""
    s = sub(lease_seconds=5, max_attempts=3)
    host = make_host([{"name": "*", "concurrency": 1}])  # a drain of 300 ms
    host.start()
    publish(s.topic.name, {"sleepMs": 3_000, "ignoreSignal": True})
    (lingering,) = probe.wait_for(1)

    s.name = f"{s.name}-renamed"  # an operator renames it in the admin
    s.save()
    host.reconcile()
    messages = [publish(s.topic.name, {"sleepMs": 400}).message_id for _ in range(3)]

    most_at_once = 0
    while not lingering.finished.is_set():
        most_at_once = max(most_at_once, sum(1 for r in probe.runs if not r.finished.is_set()))
        time.sleep(0.01)

    assert most_at_once == 1, (
        f"{most_at_once} handlers of a concurrency-1 subscription ran at once after a rename"
    )
    wait_until(lambda: all(status_of(m) == "Completed" for m in messages))


def test_a_one_shot_run_never_calls_its_budget_spent_while_the_claim_that_spent_it_is_out(
    make_host, monkeypatch
):
    """run_once reads "busy" (a claim pending, or deliveries in flight) and only then whether
    the budget is spent. The claim loop marks its claim pending and then takes the budget, so
    a claim that starts between the run's two reads is seen by neither: the run ends as
    MaxDeliveries while the claim that spent the budget is still out, and the drain then hands
    its delivery back unrun. Here the claim loop is slowed while it holds its lock (as among
    busy threads, or a GC pause), which is where run_once's read of ``in_flight`` waits: a
    job with --max 1 and one delivery waiting processes nothing and exits 0."""
    s = sub()
    real_room = Consumer._room

    def slow_room(self):  # called with the consumer's lock held
        if threading.current_thread().name == f"wq-{s.name}":  # the claim loop only
            time.sleep(0.05)
        return real_room(self)

    monkeypatch.setattr(Consumer, "_room", slow_room)
    host = make_host(one(s, concurrency=1), shutdown_drain_ms=2_000)
    message = None

    def publish_once_running(_host) -> None:
        nonlocal message
        message = publish(s.topic.name, {"sleepMs": 300}).message_id

    result = host.run_once(max_deliveries=1, idle_exit_ms=3_000, on_started=publish_once_running)

    assert (result.processed, result.reason, status_of(message)) == (
        1,
        "MaxDeliveries",
        "Completed",
    ), f"the job ended {result.reason} having processed {result.processed}"


def test_a_one_shot_run_never_ends_while_another_consumer_takes_the_budget_one_gave_back(
    make_host, monkeypatch
):
    """run_once calls its budget received and done when it reads it spent, then every consumer
    idle, then it spent again (helper-135). Two consumers share the budget of one: A holds it
    in a claim that comes back empty while B waits. Between the run's first read and its read
    of "busy", A gives the budget back and goes idle; between "busy" and the second read, B
    takes it and claims. All three reads agree, yet the budget read the second time is a new
    take: the run ended as MaxDeliveries with B's claim out, its delivery handed back unrun (a
    job with --max 1 and work waiting processed nothing). The interleaving is made exact by
    holding A's claim and B's loop, and by running the steps in the run's own reads."""
    from workqueue.runtime import consumer as consumer_module

    empty, waiting = sub(), sub()
    message = publish(waiting.topic.name, {"then": "complete"}).message_id
    host = make_host(
        [{"name": empty.name, "concurrency": 1}, {"name": waiting.name, "concurrency": 1}],
        # Neither loop claims again unless told to: the steps below decide every claim.
        idle_poll_min_ms=10_000,
        idle_poll_max_ms=60_000,
        shutdown_drain_ms=300,
    )
    a_claiming, a_answer = threading.Event(), threading.Event()
    step = ["waiting for A's claim"]
    receive, take = Receiver.receive, consumer_module.RunBudget.take

    def held_receive(self: Receiver, max_rows: int):
        if self.subscription_id == str(empty.id) and not a_answer.is_set():
            a_claiming.set()  # A took the whole budget for this claim
            a_answer.wait(10)
        if self.subscription_id == str(waiting.id):
            time.sleep(0.5)  # B's claim, on a loaded database: still out as the run reads on
        return receive(self, max_rows)

    def take_after_a(self, wanted: int) -> int:
        if threading.current_thread().name == f"wq-{waiting.name}":
            a_claiming.wait(10)  # B comes second: the budget is A's
        elif step[0] in ("A gave back", "B took"):
            # A's loop woken again (a kick as the host's listener connects late, on a loaded
            # machine) took the budget B was kicked to take, and B, refused, slept out its 60 s
            # poll: the run ended MaxDuration (seen once in CI). Not the interleaving tested.
            return 0
        return take(self, wanted)

    def consumer_named(name: str) -> Consumer:
        return host._consumers[name]

    failing, in_flight = Consumer.failing.fget, Consumer.in_flight.fget

    def failing_read(self: Consumer) -> bool:
        # all_empty, read between the run's first read of the budget and "busy"
        if sys._getframe(2).f_code.co_name == "run_once":
            if step[0] == "waiting for A's claim" and a_claiming.is_set():
                step[0] = "armed"  # from the next pass on, its first read saw A's claim out
            elif step[0] == "armed":
                a = consumer_named(empty.name)
                assert a.receive_pending
                a_answer.set()  # A's claim comes back empty and gives the budget back
                wait_until(lambda: not a.receive_pending, timeout=10, interval=0.001)
                step[0] = "A gave back"
        return failing(self)

    def in_flight_read(self: Consumer) -> int:
        value = in_flight(self)
        # "busy", read after B's "claim pending" (False) and before the second budget read
        if (
            sys._getframe(2).f_code.co_name == "run_once"
            and step[0] == "A gave back"
            and self.plan.name == waiting.name
        ):
            self.kick()  # B's loop claims now, taking the budget A gave back
            wait_until(lambda: host._budget.read()[0], timeout=10, interval=0.001)
            step[0] = "B took"
        return value

    monkeypatch.setattr(Receiver, "receive", held_receive)
    monkeypatch.setattr(consumer_module.RunBudget, "take", take_after_a)
    monkeypatch.setattr(Consumer, "failing", property(failing_read))
    monkeypatch.setattr(Consumer, "in_flight", property(in_flight_read))

    result = host.run_once(max_deliveries=1, idle_exit_ms=60_000, max_duration_ms=30_000)

    assert step[0] == "B took", f"the interleaving was not reached ({step[0]})"
    assert (result.processed, result.reason, status_of(message)) == (
        1,
        "MaxDeliveries",
        "Completed",
    ), f"the job ended {result.reason} having processed {result.processed}"


class _Unprintable:
    """What a handler may return by mistake: an object whose repr fails (a model instance whose
    __str__ follows a relation that is not there, say)."""

    def __repr__(self) -> str:
        raise AttributeError("'NoneType' object has no attribute 'name'")


class _ReturnsTheWrongThing(BaseWorkHandler):
    def handle(self, message, context):
        return _Unprintable()  # meant: return Outcome.complete()


registry.register("t.returns-unprintable", _ReturnsTheWrongThing)


def test_a_handler_returning_an_object_whose_repr_fails_is_retried_at_once_saying_why(make_host):
    """README: a handler that returns anything but an Outcome "has failed that attempt, and its
    delivery is retried ... the error recorded and logged says what was returned and what to
    return instead". The error text is built with repr() of the returned value, outside any
    guard: when that repr raises, the execution crashes, nothing is settled, and the delivery
    sits InFlight until its lease expires (60 s here; the attempt is spent with no error
    recorded, and on a last attempt it becomes a LeaseExpired dead letter)."""
    s = sub(handler_key="t.returns-unprintable", max_attempts=3, lease_seconds=60)
    message = publish(s.topic.name, {}).message_id
    host = make_host(one(s, concurrency=1))

    host.run_once(max_deliveries=1, idle_exit_ms=300)

    row = Delivery.objects.get(message_id=message)
    assert (row.status, row.lease_owner) == ("Pending", None), (
        f"left {row.status} (lease owner {row.lease_owner}) until its lease expires"
    )
    assert "no valid outcome" in (row.last_error or "")


class _BacksOffByItself(BaseWorkHandler):
    """Its own exponential backoff, as a handler on a subscription that retries for a long time
    might do: ``2 ** context.attempt`` seconds, which passes a float's range at attempt 1024."""

    def handle(self, message, context):
        return Outcome.retry("upstream busy", delay_seconds=2 ** (context.attempt + 1023))


registry.register("t.backs-off-by-itself", _BacksOffByItself)


def test_a_requested_retry_delay_too_large_for_a_float_is_clamped_not_a_crash(make_host):
    """README: "a delay the handler asks for is used as given" within backoff_max_seconds, and
    ``retry_delay_seconds`` says a finite requested delay is "rounded up and clamped to
    [0, max_seconds]". An int (or Fraction) past a float's range is accepted by Outcome and
    TransientWorkError (numbers.Real), then ``math.isfinite`` raises OverflowError in the
    settle: the execution crashes, nothing is recorded, and the delivery waits InFlight for
    its lease to expire (each such attempt spent unrecorded, the last one a LeaseExpired dead
    letter)."""
    s = sub(
        handler_key="t.backs-off-by-itself",
        max_attempts=5000,
        backoff_max_seconds=3600,
        lease_seconds=60,
    )
    message = publish(s.topic.name, {}).message_id
    host = make_host(one(s, concurrency=1))

    host.run_once(max_deliveries=1, idle_exit_ms=300)

    row = Delivery.objects.get(message_id=message)
    assert (row.status, row.attempt_count) == ("Pending", 1), (
        f"left {row.status} (lease owner {row.lease_owner}) until its lease expires"
    )
    assert row.last_error == "upstream busy"


def test_a_rate_limited_subscription_is_running_again_once_the_database_answers(
    make_host, monkeypatch
):
    """A failed take of rate-limit tokens marks the consumer failing (health: Error, "taking
    rate-limit tokens failed"), and only a claim that goes through clears it. A take that goes
    through but grants nothing (the bucket is empty: a low rate, or other hosts took the
    tokens) does not: the subscription reads Error, and /work-queue/health degraded, for as
    long as the next token takes, though the database answers again (here 50 s, after a blip
    of one failed call). In a one-shot job, three such failures in a row read as a
    subscription that cannot run (exit 2)."""
    s, takes = _waiting_for_a_token_after_failed_takes(monkeypatch, failures=1)
    host = make_host(one(s, concurrency=1))  # polls at most every 200 ms
    host.start()
    wait_until(lambda: takes["answered"] >= 3, timeout=20)  # nothing granted yet

    state, reason = states(host)[s.name]
    assert state == "Running", f"still {state} ({reason}) though every take since was answered"


def test_a_one_shot_job_whose_token_takes_failed_then_answered_is_not_a_job_that_cannot_run(
    make_host, monkeypatch
):
    """The one-shot side of the same: three failed takes in a row (a database restart of a few
    seconds), then takes that are answered but grant nothing yet. The consumer still counts
    as failing when the run ends (here at its --max-duration-ms, the next token being 50 s
    away), so the run reports the subscription as one that could not run: `workqueue_work`
    exits 2 ("Could not run: ... Error (Not claiming: taking rate-limit tokens failed ...)")
    although the database answers and the work merely waits for its rate."""
    s, takes = _waiting_for_a_token_after_failed_takes(monkeypatch, failures=3)
    host = make_host(one(s, concurrency=1))

    result = host.run_once(max_deliveries=1, idle_exit_ms=2_000, max_duration_ms=5_000)

    assert takes["failures_left"] == 0 and takes["answered"] > 0
    assert result.could_not_run == [], f"ended {result.reason}: {result.could_not_run}"


@pytest.mark.parametrize("change", ["paused", "renamed and paused"])
def test_a_paused_subscriptions_handler_that_runs_on_is_counted_in_its_health(make_host, change):
    """Review helper-135: matched by the plan's id, a subscription with no plan (Paused,
    Disabled, a host shutting down) counted its handlers still running as 0 in /health and
    the host records; by name, a renamed one did."""
    s = sub(lease_seconds=5, max_attempts=3)
    host = make_host([{"name": "*", "concurrency": 1}])  # a drain of 300 ms
    host.start()
    publish(s.topic.name, {"sleepMs": 3_000, "ignoreSignal": True})
    (lingering,) = probe.wait_for(1)
    if change == "renamed and paused":
        s.name = f"{s.name}-renamed"
    s.status = "Paused"
    s.save()

    host.reconcile()

    assert not lingering.finished.is_set()
    [entry] = [e for e in host.health()["subscriptions"] if e["name"] == s.name]
    assert (entry["state"], entry["in_flight"]) == ("Paused", 1), entry


def _waiting_for_a_token_after_failed_takes(
    monkeypatch: pytest.MonkeyPatch, failures: int
) -> tuple[Subscription, dict[str, int]]:
    """A subscription with a delivery waiting and its one token taken by another host (the next
    is due in 50 s), whose next ``failures`` takes of tokens fail as in an outage; its takes
    counted (``failures_left``, ``answered``)."""
    s = sub(rate_limit_per_second=0.02, rate_limit_burst=1)
    Receiver(s.id, "another-host").take_rate_tokens(1)
    real_take = Receiver.take_rate_tokens
    takes = {"failures_left": failures, "answered": 0}

    def take(self: Receiver, wanted: int) -> tuple[int, float]:
        if takes["failures_left"]:
            takes["failures_left"] -= 1
            raise TransientDriverError("server closed the connection unexpectedly (test)")
        answer = real_take(self, wanted)
        takes["answered"] += 1
        return answer

    monkeypatch.setattr(Receiver, "take_rate_tokens", take)
    publish(s.topic.name, {"then": "complete"})
    return s, takes


def test_a_renamed_subscription_listed_under_both_names_counts_its_handler_once_in_health(
    make_host,
):
    """SUBSCRIPTIONS may name a subscription under its old and its new name across a rename
    (the old entry then reads Error, not found). Health matched a re-plan's lingering handler
    by id to the new name's entry and, the old entry having no id any more, by name to the old
    one: one running handler counted twice in /health and the host records. It is counted once,
    under the subscription it runs for."""
    s = sub(lease_seconds=5, max_attempts=3)
    old, new = s.name, f"{s.name}-renamed"
    host = make_host(
        [{"name": old, "concurrency": 1}, {"name": new, "concurrency": 1}]
    )  # a drain of 300 ms
    host.start()
    publish(s.topic.name, {"sleepMs": 3_000, "ignoreSignal": True})
    (lingering,) = probe.wait_for(1)
    s.name = new  # an operator renames it in the admin
    s.save()

    host.reconcile()

    assert not lingering.finished.is_set()
    counted = {e["name"]: (e["state"], e["in_flight"]) for e in host.health()["subscriptions"]}
    assert counted == {old: ("Error", 0), new: ("Running", 1)}, counted


def test_a_failed_rate_token_call_does_not_spend_the_one_shot_budget(make_host, monkeypatch):
    """Review helper-171: the budget was taken before the rate-limit tokens were asked for,
    and a call that raised something other than a WorkQueueError (the loop restarts for it)
    kept it taken: the job ended MaxDeliveries, processed 0, exit 0, its work still queued."""
    s = sub(rate_limit_per_second=100)
    message = publish(s.topic.name, {"then": "complete"}).message_id
    take = Receiver.take_rate_tokens
    failures = [1]

    def fails_once(self: Receiver, wanted: int) -> object:
        if failures:
            failures.pop()
            raise RuntimeError("an unexpected error from the driver")
        return take(self, wanted)

    monkeypatch.setattr(Receiver, "take_rate_tokens", fails_once)
    host = make_host(one(s, concurrency=1))

    result = host.run_once(max_deliveries=1, idle_exit_ms=3000, max_duration_ms=10_000)

    assert not failures  # the failure happened
    assert (result.processed, result.reason, status_of(message)) == (
        1,
        "MaxDeliveries",
        "Completed",
    ), (
        f"the run ended {result.reason} with processed={result.processed} and could_not_run="
        f"{result.could_not_run} (a job exit 0) while its one delivery is {status_of(message)}"
    )


def test_a_payload_this_python_cannot_decode_is_dead_lettered_at_once(make_host):
    """Review helper-178: PostgreSQL stores a number of 5,001 digits in jsonb that json.loads
    refuses (sys.get_int_max_str_digits()), and a caller of wq_publish itself can store one.
    Each attempt crashed the execution before the handler ran, held the delivery a lease, and
    the last was dead-lettered LeaseExpired, "its holder stopped renewing"."""
    from django.db import connection

    s = sub(lease_seconds=5, max_attempts=2)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT message_id FROM wq_publish(%s, gen_random_uuid(), NULL, '{}'::jsonb, "
            "'{\"n\": 1e5000}'::jsonb, NULL, NULL, NULL, NULL, 100, false, 'ext', NULL, NULL, "
            "NULL, NULL)",
            [s.topic.name],
        )
        (unreadable,) = cursor.fetchone()
    fine = publish(s.topic.name, {"then": "complete"}).message_id
    host = make_host(one(s, concurrency=2))
    host.start()

    wait_until(lambda: status_of(fine) == "Completed")
    wait_until(lambda: status_of(unreadable) == "DeadLettered", timeout=4)  # within a lease
    row = Delivery.objects.get(message_id=unreadable)
    assert (row.dead_letter_reason, row.attempt_count) == ("InvalidPayload", 1)
    assert "cannot be decoded" in row.last_error
    assert [r.message_id for r in probe.runs] == [fine]  # no handler saw it
