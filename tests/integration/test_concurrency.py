"""The queue's guarantees under real concurrency: threads (each driver call on the thread's own
private connection) and separate OS processes, all hitting the same test database at once.

Every check here can fail: single flight per key is checked three ways (the table sampled from
another connection while claimers run, the claimers' own "definitely held" intervals, and the
final row states), and publish races assert the exact outcome of every publisher.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from django.db import connections, transaction

from tests.factories import SubscriptionFactory, TopicFactory
from tests.support.database import edited_procedures, psycopg_params
from tests.support.processes import PROJECT_ROOT, subprocess_environment
from tests.support.sampling import InFlightSampler
from workqueue import publish, publish_many
from workqueue.driver import get_driver
from workqueue.exceptions import TransientDriverError
from workqueue.models import Deduplication, Delivery, Message
from workqueue.transport import Receiver, discard_or_cancel

pytestmark = pytest.mark.usefixtures("queue_db")

DRAIN_DEADLINE_S = 60.0


# -- helpers shared by threads and worker processes ------------------------------------------


def _should_retry(message_id: str, attempt: int) -> bool:
    """About one message in eight is retried once (delay 0), so keys also change hands
    through Pending → InFlight → Pending → InFlight, not only through completions."""
    return attempt == 1 and uuid.UUID(message_id).int % 8 == 0


def drain(
    subscription_ids: list[str],
    owner: str,
    hold_ms: float,
    batch: int = 5,
    go: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Claim and settle until the subscriptions have nothing Pending or InFlight.

    Runs in a thread of the test process or in a worker process. Returns one event per claim:
    ``[subscription_id, partition_key, delivery_id, message_id, attempt, lease_token,
    held_from_ns, held_until_ns, outcome]``. ``held_from`` is taken after ``receive`` returned
    and ``held_until`` before the settle call, so the interval lies inside the real lease: two
    overlapping intervals of one key would prove two holders at once.
    """
    receivers = [Receiver(s, lease_owner=owner) for s in subscription_ids]
    events: list[list[Any]] = []
    errors: list[str] = []
    transient: list[str] = []

    def attempt(call: Callable[[], Any]) -> Any:
        # A transient error (a deadlock: see CLAIM_DEADLOCK below) rolled the statement back,
        # so the call is simply made again, as the consumer runtime would.
        for _ in range(20):
            try:
                return call()
            except TransientDriverError as exc:
                transient.append(str(exc).splitlines()[0])
        raise RuntimeError("20 transient errors in a row")

    try:
        if go is not None:
            go()
        deadline = time.monotonic() + DRAIN_DEADLINE_S
        while time.monotonic() < deadline:
            claimed_any = False
            for receiver in receivers:
                claimed = attempt(lambda r=receiver: r.receive(batch).deliveries)
                if not claimed:
                    continue
                claimed_any = True
                held_from = time.monotonic_ns()
                keys = [d.partition_key for d in claimed if d.partition_key is not None]
                if len(keys) != len(set(keys)):
                    errors.append(f"one receive returned two deliveries of one key: {keys}")
                time.sleep(hold_ms / 1000)
                for d in claimed:
                    held_until = time.monotonic_ns()
                    if _should_retry(d.message_id, d.attempt):
                        outcome = "retry"
                        result = attempt(lambda r=receiver, d=d: r.retry(d, 0, "test retry"))
                    else:
                        outcome = "complete"
                        result = attempt(lambda r=receiver, d=d: r.complete(d))
                    if not result.settled:
                        errors.append(f"{outcome} of {d.delivery_id} lost its lease")
                    events.append(
                        [
                            d.subscription_id,
                            d.partition_key,
                            d.delivery_id,
                            d.message_id,
                            d.attempt,
                            d.lease_token,
                            held_from,
                            held_until,
                            outcome,
                        ]
                    )
            if claimed_any:
                continue
            if not Delivery.objects.filter(
                subscription_id__in=subscription_ids, status__in=["Pending", "InFlight"]
            ).exists():
                break
            time.sleep(0.002)
        else:
            errors.append(f"{owner} did not drain within {DRAIN_DEADLINE_S}s")
    except Exception as exc:  # reported to the test, which fails on it
        errors.append(f"{owner}: {type(exc).__name__}: {exc}")
    finally:
        get_driver().close()
        connections.close_all()
    return {"owner": owner, "events": events, "errors": errors, "transient": transient}


def process_main() -> None:
    """Entry point of a worker process (see ``_start_worker_process``)."""
    args = json.loads(sys.argv[1])
    # Connect before announcing readiness, so start-up cost is not part of the race: Django's
    # connection and the queue's own (a claim of nothing also prepares the claim's statement).
    # Left to the race, a process on a loaded machine could find the work gone before its
    # first claim (seen once in CI: "process-1 claimed nothing").
    Delivery.objects.exists()
    for subscription_id in args["subscription_ids"]:
        Receiver(subscription_id, lease_owner=args["owner"]).receive(0)
    print("ready", flush=True)

    def wait_for_go() -> None:
        if sys.stdin.readline().strip() != "go":
            raise RuntimeError("parent went away")

    result = drain(args["subscription_ids"], args["owner"], args["hold_ms"], go=wait_for_go)
    print("RESULT " + json.dumps(result), flush=True)


_PROCESS_SCRIPT = (
    "import django; django.setup(); "
    "from tests.integration.test_concurrency import process_main; process_main()"
)


def _start_worker_process(subscription_ids: list[str], owner: str, hold_ms: float):
    env = subprocess_environment(PYTHONWARNINGS="ignore")
    args = {"subscription_ids": subscription_ids, "owner": owner, "hold_ms": hold_ms}
    return subprocess.Popen(
        [sys.executable, "-c", _PROCESS_SCRIPT, json.dumps(args)],
        cwd=PROJECT_ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _await_ready(proc: subprocess.Popen) -> None:
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        _, err = proc.communicate(timeout=10)
        pytest.fail(f"worker process failed to start: {line!r}\n{err}")


def _collect(proc: subprocess.Popen) -> dict[str, Any]:
    out, err = proc.communicate(timeout=DRAIN_DEADLINE_S + 30)
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    pytest.fail(f"worker process exited {proc.returncode} without a result\n{out}\n{err}")


class _Threads:
    """Start functions on threads; ``join`` re-raises the first exception in the test."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.results: dict[int, Any] = {}
        self.failures: list[BaseException] = []

    def start(self, fn: Callable[..., Any], *args: Any) -> None:
        index = len(self.threads)

        def run() -> None:
            try:
                self.results[index] = fn(*args)
            except BaseException as exc:
                self.failures.append(exc)
            finally:
                # This thread's private driver connection and its Django connections.
                get_driver().close()
                connections.close_all()

        thread = threading.Thread(target=run, daemon=True)
        self.threads.append(thread)
        thread.start()

    def join(self, timeout: float = DRAIN_DEADLINE_S + 30) -> list[Any]:
        for thread in self.threads:
            thread.join(timeout)
            assert not thread.is_alive(), "a worker thread hung"
        if self.failures:
            raise self.failures[0]
        return [self.results[i] for i in range(len(self.threads))]


def _overlaps(events: list[list[Any]]) -> list[tuple[Any, ...]]:
    """Pairs of claims of one (subscription, key) whose held intervals overlap."""
    by_key: dict[tuple[str, str], list[list[Any]]] = defaultdict(list)
    for e in events:
        by_key[(e[0], e[1])].append(e)
    found = []
    for key, items in by_key.items():
        items.sort(key=lambda e: e[6])
        for before, after in itertools.pairwise(items):
            if after[6] < before[7]:
                found.append((key, before[2], after[2]))
    return found


# -- None subscriptions ------------------------------------------------------------------------


def test_concurrent_claimers_on_an_unpartitioned_subscription_claim_every_delivery_exactly_once():
    sub = SubscriptionFactory()
    results = publish_many(sub.topic.name, [{"payload": {"n": n}} for n in range(500)])
    assert {r.status for r in results} == {"Accepted"}
    expected = {
        str(i) for i in Delivery.objects.filter(subscription=sub).values_list("id", flat=True)
    }
    assert len(expected) == 500

    go = threading.Barrier(6)

    def claimer(index: int) -> dict[str, Any]:
        receiver = Receiver(sub.id, lease_owner=f"thread-{index}")
        claimed: list[tuple[str, str]] = []
        lost: list[str] = []
        go.wait()
        try:
            while True:
                batch = receiver.receive(5).deliveries
                if not batch:
                    if not Delivery.objects.filter(subscription=sub, status="Pending").exists():
                        break
                    time.sleep(0.001)
                    continue
                claimed += [(d.delivery_id, d.lease_token) for d in batch]
                results = receiver.complete_many(batch)
                lost += [i for i, r in results.items() if not r.settled]
        finally:
            receiver.driver.close()
        return {"claimed": claimed, "lost": lost}

    threads = _Threads()
    for index in range(6):
        threads.start(claimer, index)
    outcomes = threads.join()

    claimed_ids = [delivery_id for o in outcomes for delivery_id, _ in o["claimed"]]
    tokens = [token for o in outcomes for _, token in o["claimed"]]
    assert len(claimed_ids) == len(set(claimed_ids)), "a delivery was claimed twice"
    assert set(claimed_ids) == expected
    assert len(set(tokens)) == len(tokens)
    assert [o["lost"] for o in outcomes] == [[]] * 6
    assert sum(1 for o in outcomes if o["claimed"]) >= 2, "only one thread ever claimed"
    rows = Delivery.objects.filter(subscription=sub)
    assert set(rows.values_list("status", flat=True)) == {"Completed"}
    assert set(rows.values_list("attempt_count", flat=True)) == {1}


# -- Exclusive and Ordered subscriptions -------------------------------------------------------

KEYS = [f"key-{k:02d}" for k in range(20)]
PER_KEY = 10


def _publish_keyed(topic_name: str) -> None:
    # Keys interleaved, so a key's messages are spread over the whole publish order.
    messages = [
        {"partition_key": key, "payload": {"key": key, "seq": seq}}
        for seq in range(PER_KEY)
        for key in KEYS
    ]
    assert {r.status for r in publish_many(topic_name, messages)} == {"Accepted"}


def _drain_race(sub: Any) -> tuple[list[dict[str, Any]], InFlightSampler]:
    """Three threads and two worker processes drain ``sub`` at once while a sampler watches
    the InFlight rows; returns every claimer's result (owner, events, errors, transient) and
    the sampler."""
    sub_ids = [str(sub.id)]
    params = psycopg_params()

    processes = [_start_worker_process(sub_ids, f"process-{i}", hold_ms=2) for i in range(2)]
    try:
        for proc in processes:
            _await_ready(proc)
        start = threading.Event()
        threads = _Threads()
        with InFlightSampler(params, sub_ids) as sampler:
            for i in range(3):
                threads.start(drain, sub_ids, f"thread-{i}", 2, 5, start.wait)
            for proc in processes:
                proc.stdin.write("go\n")
                proc.stdin.flush()
            start.set()
            thread_results = threads.join()
            process_results = [_collect(proc) for proc in processes]
    finally:
        for proc in processes:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()

    return thread_results + process_results, sampler


def _hand_overs(results: list[dict[str, Any]]) -> dict[str, int]:
    """Per key, how often it passed from one claimer to another (in held order)."""
    by_key: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for r in results:
        for e in r["events"]:
            by_key[e[1]].append((e[6], r["owner"]))
    return {
        key: sum(1 for (_, a), (_, b) in itertools.pairwise(sorted(held)) if a != b)
        for key, held in by_key.items()
    }


@pytest.mark.parametrize("mode", ["Exclusive", "Ordered"])
@pytest.mark.processes
def test_threads_and_processes_never_hold_two_deliveries_of_one_key_at_once(mode):
    sub = SubscriptionFactory(partition_mode=mode)
    _publish_keyed(sub.topic.name)

    results, sampler = _drain_race(sub)

    process_results = results[3:]
    assert [r["errors"] for r in results] == [[]] * len(results)
    events = [e for r in results for e in r["events"]]
    # Transient errors were retried by the harness; they are reported, never swallowed: only
    # deadlocks or lock timeouts, and few of them.
    transient = [t for r in results for t in r["transient"]]
    assert all("deadlock" in t or "lock timeout" in t for t in transient), transient
    assert len(transient) <= len(events) // 20, f"{len(transient)} transient errors: {transient}"
    assert sampler.error is None
    assert sampler.violations == []
    assert _overlaps(events) == []
    # The run was really concurrent: several keys and several claimers in flight together,
    # and both worker processes took part.
    assert sampler.samples > 20
    assert sampler.max_keys_in_flight >= 2
    assert sampler.max_owners_in_flight >= 2
    for r in process_results:
        assert r["events"], f"{r['owner']} claimed nothing"
    # Contention really happened: keys passed between claimers, most of them more than once.
    hand_overs = _hand_overs(results)
    assert sum(1 for n in hand_overs.values() if n >= 2) >= len(KEYS) // 2, hand_overs
    assert sum(hand_overs.values()) >= 2 * len(KEYS), hand_overs

    rows = Delivery.objects.filter(subscription=sub)
    assert rows.count() == len(KEYS) * PER_KEY
    assert set(rows.values_list("status", flat=True)) == {"Completed"}
    completes = [e for e in events if e[8] == "complete"]
    assert sorted(e[2] for e in completes) == sorted(
        str(i) for i in rows.values_list("id", flat=True)
    )

    if mode == "Ordered":
        ordinal = dict((str(i), o) for i, o in Message.objects.values_list("id", "publish_ordinal"))
        expected = defaultdict(list)
        for message_id, key in Message.objects.values_list("id", "partition_key"):
            expected[key].append(ordinal[str(message_id)])
        claims_by_key: dict[str, list[list[Any]]] = defaultdict(list)
        for e in events:
            claims_by_key[e[1]].append(e)
        for key, claims in claims_by_key.items():
            claims.sort(key=lambda e: e[6])  # held intervals do not overlap: a total order
            held = [ordinal[e[3]] for e in claims]
            assert held == sorted(held), f"{key} was claimed out of publish order"
            done = [ordinal[e[3]] for e in claims if e[8] == "complete"]
            assert done == sorted(expected[key]), f"{key} completed out of publish order"
        # The database agrees: completion times per key follow the publish ordinals.
        for key in KEYS:
            by_time = list(
                rows.filter(partition_key=key)
                .order_by("completed_at")
                .values_list("message__publish_ordinal", flat=True)
            )
            assert by_time == sorted(by_time)


#: A claim that forgets single flight: it no longer skips a key with a delivery in flight, and
#: the unique index that backs it up is dropped. (Text edits of the current claim.sql.)
BROKEN_CLAIM_EDITS = [
    ("ELSIF NOT EXISTS (", "ELSIF true OR NOT EXISTS ("),
    ("AND f.partition_key = d.partition_key AND f.status = 'InFlight')", "AND false)"),
]


@pytest.fixture
def broken_claim():
    """Install the broken claim in this worker's test database; put the real one back after."""
    from django.db import connection

    text = edited_procedures("claim", BROKEN_CLAIM_EDITS)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_get_indexdef('wq_delivery_inflight_key_uq'::regclass)")
        (index,) = cursor.fetchone()
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("DROP INDEX wq_delivery_inflight_key_uq")
            cursor.execute(text)
        yield
    finally:
        get_driver().close()
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("DROP INDEX IF EXISTS wq_delivery_inflight_key_uq")
            cursor.execute(index)
            get_driver().install_procedures(connection)


@pytest.mark.processes
def test_the_single_flight_harness_catches_a_claim_that_forgets_the_key(broken_claim):
    """Negative control: the same race against a broken claim is seen by every check."""
    sub = SubscriptionFactory(partition_mode="Exclusive")
    _publish_keyed(sub.topic.name)

    results, sampler = _drain_race(sub)

    events = [e for r in results for e in r["events"]]
    assert sampler.error is None
    assert sampler.violations, "the sampler saw no key held twice"
    assert _overlaps(events), "no two held intervals of one key overlapped"


def test_concurrent_claimers_of_an_ordered_subscription_never_deadlock():
    """Keys keep changing hands (every claim is retried with no delay) while six receivers claim
    batches at once; none of their calls may fail."""
    sub = SubscriptionFactory(partition_mode="Ordered")
    publish_many(
        sub.topic.name,
        [{"partition_key": f"k{k}", "payload": {"i": i}} for i in range(2) for k in range(20)],
    )
    stop = threading.Event()
    failures: list[str] = []
    lost: list[str] = []
    calls = [0]
    deadline = time.monotonic() + 8

    def churn(index: int) -> None:
        receiver = Receiver(sub.id, f"churn-{index}")
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                for d in receiver.receive(10).deliveries:
                    calls[0] += 1
                    if not receiver.retry(d, 0, "churn").settled:
                        lost.append(d.delivery_id)
            except TransientDriverError as exc:
                failures.append(str(exc).splitlines()[0])
                stop.set()

    threads = _Threads()
    for index in range(6):
        threads.start(churn, index)
    threads.join()

    assert failures == []
    assert lost == []
    assert calls[0] > 20, "the receivers hardly claimed anything"


# -- fencing -----------------------------------------------------------------------------------


def reclaimed_after_expiry() -> tuple[Any, Receiver, Receiver, Any, Any]:
    """A delivery whose lease ran out in the old holder's hands and that a new holder claimed:
    (subscription, old holder, new holder, the old claim, the new claim)."""
    sub = SubscriptionFactory(lease_seconds=30)
    publish(sub.topic.name, {"n": 1})
    old_holder, new_holder = Receiver(sub.id, "old-holder"), Receiver(sub.id, "new-holder")
    (stale,) = old_holder.receive(1).deliveries
    get_driver().shift_time(31, subscription_id=str(sub.id))
    (fresh,) = new_holder.receive(1).deliveries
    return sub, old_holder, new_holder, stale, fresh


def test_a_stale_lease_token_changes_nothing_after_expiry_and_reclaim():
    _, old_holder, new_holder, stale, fresh = reclaimed_after_expiry()
    assert fresh.delivery_id == stale.delivery_id
    assert fresh.lease_token != stale.lease_token
    assert fresh.attempt == 2

    assert old_holder.complete(stale).outcome == "LeaseLost"
    assert old_holder.retry(stale, 0, "stale retry").outcome == "LeaseLost"
    assert old_holder.dead_letter(stale, "stale", "stale dead letter").outcome == "LeaseLost"
    assert old_holder.release(stale).outcome == "LeaseLost"
    assert old_holder.extend_lease(stale, {"stale": True}).state == "Lost"
    assert old_holder.complete_many([stale])[stale.delivery_id].outcome == "LeaseLost"

    row = Delivery.objects.get(pk=stale.delivery_id)
    assert (row.status, str(row.lease_token), row.lease_owner) == (
        "InFlight",
        fresh.lease_token,
        "new-holder",
    )
    assert (row.attempt_count, row.last_error, row.dead_letter_reason, row.progress) == (
        2,
        "LeaseExpired",
        None,
        None,
    )
    assert new_holder.extend_lease(fresh).state == "Held"
    assert new_holder.complete(fresh).settled
    assert old_holder.complete(stale).outcome == "LeaseLost"
    assert Delivery.objects.get(pk=stale.delivery_id).status == "Completed"


def test_a_stale_lease_token_cannot_acknowledge_a_cancel_meant_for_the_new_holder():
    """The cancel acknowledgement is a settle too (it discards the delivery), and the stale
    holder test above never tried it (helper-103)."""
    sub, old_holder, new_holder, stale, fresh = reclaimed_after_expiry()
    discard_or_cancel(str(sub.id), fresh.delivery_id, "ops", "stop it")  # the running one

    assert old_holder.acknowledge_cancel(stale).outcome == "LeaseLost"
    row = Delivery.objects.get(pk=stale.delivery_id)
    assert (row.status, str(row.lease_token)) == ("InFlight", fresh.lease_token)
    assert new_holder.acknowledge_cancel(fresh).settled
    assert Delivery.objects.get(pk=stale.delivery_id).status == "Discarded"


def test_a_batched_complete_fences_each_row_by_its_own_token():
    """One wq_complete_many call mixing a stale holder's delivery with held ones completes only
    the held ones, reports LeaseLost for the stale one, and never accepts a token that belongs to
    another row of the batch."""
    sub = SubscriptionFactory(lease_seconds=30)
    publish_many(sub.topic.name, [{"payload": {"n": n}} for n in range(4)])
    old_holder, new_holder = Receiver(sub.id, "old-holder"), Receiver(sub.id, "new-holder")
    (stale,) = old_holder.receive(1).deliveries
    get_driver().shift_time(31, subscription_id=str(sub.id))
    held = new_holder.receive(4).deliveries
    fresh = next(d for d in held if d.delivery_id == stale.delivery_id)
    first, second, third = (d for d in held if d is not fresh)

    # Ids and tokens that are each valid, but paired with the wrong row.
    crossed = [
        dataclasses.replace(first, lease_token=second.lease_token),
        dataclasses.replace(second, lease_token=first.lease_token),
    ]
    results = new_holder.complete_many(crossed)
    assert [results[d.delivery_id].outcome for d in crossed] == ["LeaseLost", "LeaseLost"]

    results = old_holder.complete_many([stale, first, third])
    assert {k: r.outcome for k, r in results.items()} == {
        stale.delivery_id: "LeaseLost",
        first.delivery_id: "Settled",
        third.delivery_id: "Settled",
    }
    statuses = dict(Delivery.objects.filter(subscription=sub).values_list("id", "status"))
    assert {str(k): v for k, v in statuses.items()} == {
        fresh.delivery_id: "InFlight",
        first.delivery_id: "Completed",
        second.delivery_id: "InFlight",
        third.delivery_id: "Completed",
    }
    assert new_holder.complete(fresh).settled


ROUNDS = 24


def test_a_stale_holder_racing_the_new_holder_never_wins():
    """After the lease ran out, the old holder settles while a new holder takes the deliveries
    back, both at once, round after round: for every delivery exactly one side wins (the old
    holder's work counts only if it landed before the take-back), and never both."""
    stale_ops: list[Callable[[Receiver, Any], bool]] = [
        lambda holder, d: holder.complete(d).settled,
        lambda holder, d: holder.retry(d, 3600, "stale").settled,
        lambda holder, d: holder.dead_letter(d, "stale").settled,
    ]  # not release: a released delivery is Pending again, and claiming it is its purpose
    wins = {"stale": 0, "new": 0}
    for round_number in range(ROUNDS):
        # A subscription per round: what one round settles cannot be claimed in the next.
        sub = SubscriptionFactory(lease_seconds=30)
        old_holder, new_holder = Receiver(sub.id, "old-holder"), Receiver(sub.id, "new-holder")
        publish_many(sub.topic.name, [{"payload": {"n": n}} for n in range(4)])
        stale = old_holder.receive(4).deliveries
        assert len(stale) == 4
        get_driver().shift_time(31, subscription_id=str(sub.id))
        op = stale_ops[round_number % len(stale_ops)]
        barrier = threading.Barrier(2)

        def stale_side(
            barrier: threading.Barrier, holder: Receiver, op: Callable, stale: list
        ) -> set[str]:
            barrier.wait()
            return {d.delivery_id for d in stale if op(holder, d)}

        def new_side(barrier: threading.Barrier, holder: Receiver) -> dict[str, Any]:
            barrier.wait()
            return {d.delivery_id: d for d in holder.receive(4).deliveries}

        threads = _Threads()
        threads.start(stale_side, barrier, old_holder, op, stale)
        threads.start(new_side, barrier, new_holder)
        stale_won, retaken = threads.join()

        for delivery in stale:
            assert (delivery.delivery_id in stale_won) != (delivery.delivery_id in retaken)
        for delivery in retaken.values():
            row = Delivery.objects.get(pk=delivery.delivery_id)
            assert (row.status, str(row.lease_token)) == ("InFlight", delivery.lease_token)
            assert new_holder.complete(delivery).settled
        wins["stale"] += len(stale_won)
        wins["new"] += len(retaken)
    assert wins["stale"] + wins["new"] == ROUNDS * 4
    assert wins["stale"] and wins["new"], f"no real race: {wins}"  # both sides did win some


# -- publish races -----------------------------------------------------------------------------


def _race(n: int, fn: Callable[[int], Any]) -> list[Any]:
    barrier = threading.Barrier(n)

    def run(i: int) -> Any:
        barrier.wait()
        try:
            return fn(i)
        finally:
            get_driver().close()

    threads = _Threads()
    for i in range(n):
        threads.start(run, i)
    return threads.join()


def test_concurrent_publishers_of_one_deduplication_key_get_one_accepted_and_duplicates():
    topic = TopicFactory()
    subs = [SubscriptionFactory(topic=topic), SubscriptionFactory(topic=topic)]
    ids = [str(uuid.uuid4()) for _ in range(8)]

    results = _race(
        8,
        lambda i: publish(
            topic.name, {"publisher": i}, message_id=ids[i], deduplication_key="order-42"
        ),
    )

    accepted = [r for r in results if r.status == "Accepted"]
    assert len(accepted) == 1
    owner = accepted[0].message_id
    # Reserve, insert and confirm commit together, so a rival never sees a bare reservation:
    # every loser waits for the owner's commit and reports a Duplicate naming the owner.
    assert [(r.status, r.message_id, r.error) for r in results if r is not accepted[0]] == [
        ("Duplicate", owner, None)
    ] * 7
    assert [str(m) for m in Message.objects.filter(topic=topic).values_list("id", flat=True)] == [
        owner
    ]
    assert list(Deduplication.objects.filter(topic=topic).values_list("message_id", "status")) == [
        (uuid.UUID(owner), "Confirmed")
    ]
    assert sorted(
        Delivery.objects.filter(message__topic=topic).values_list("subscription_id", flat=True)
    ) == sorted(s.id for s in subs)


@pytest.mark.parametrize("owner_commits", [True, False], ids=["commits", "rolls-back"])
def test_a_publisher_racing_an_open_reservation_waits_for_its_outcome(owner_commits, pg_conn):
    """The reservation window made visible: an enlisted publish holds the key uncommitted while
    a rival publishes; the rival blocks, then reports Duplicate (owner committed) or takes the
    key itself (owner rolled back), never DeduplicationPending."""
    topic = TopicFactory()
    SubscriptionFactory(topic=topic)
    owner_id, rival_id = str(uuid.uuid4()), str(uuid.uuid4())
    rival_result: list[Any] = []

    class Rollback(Exception):
        pass

    def rival() -> None:
        rival_result.append(
            publish(topic.name, {"who": "rival"}, message_id=rival_id, deduplication_key="k-1")
        )
        get_driver().close()

    threads = _Threads()
    try:
        with transaction.atomic():
            held = publish(
                topic.name,
                {"who": "owner"},
                message_id=owner_id,
                deduplication_key="k-1",
                enlist=True,
            )
            assert held.status == "Accepted"
            threads.start(rival)
            _wait_until_a_backend_waits_on_a_lock(pg_conn)
            assert rival_result == [], "the rival did not wait for the open reservation"
            if not owner_commits:
                raise Rollback
    except Rollback:
        pass
    threads.join()

    (result,) = rival_result
    if owner_commits:
        assert (result.status, result.message_id) == ("Duplicate", owner_id)
        assert [
            str(i) for i in Message.objects.filter(topic=topic).values_list("id", flat=True)
        ] == [owner_id]
    else:
        assert (result.status, result.message_id) == ("Accepted", rival_id)
        assert [
            str(i) for i in Message.objects.filter(topic=topic).values_list("id", flat=True)
        ] == [rival_id]


@pytest.mark.parametrize(
    ("held_first", "other_keys"),
    [("by a batch", ("k2", "k1")), ("alone", ("k1", "k2"))],
    ids=["batch-then-batch", "single-then-batch"],
)
def test_publishers_sharing_deduplication_keys_wait_for_each_other_instead_of_deadlocking(
    pg_conn, monkeypatch, held_first, other_keys
):
    """Audit helper-91: a batch reserved its deduplication keys in list order, so two batches
    listing shared keys in other orders deadlocked: one was retried whole and, after the
    retries, Rejected (every item). Every reservation now takes its key's lock first, a batch
    all its keys' in sorted order. Review helper-93: with only batches taking them, a
    transaction that published k1 alone and then a batch holding k2 deadlocked with a batch of
    k1 and k2 (which held k2's lock while it waited for k1's reservation)."""
    from workqueue import transport as transport_module

    monkeypatch.setattr(transport_module, "TRANSIENT_RETRIES", 0)  # a deadlock shows at once
    topic = TopicFactory()
    SubscriptionFactory(topic=topic)

    def batch(*keys: str) -> list[dict[str, Any]]:
        return [{"payload": {"key": key}, "deduplication_key": key} for key in keys]

    other: list[Any] = []

    def other_batch() -> None:
        other.extend(publish_many(topic.name, batch(*other_keys)))
        get_driver().close()

    threads = _Threads()
    with transaction.atomic():
        if held_first == "by a batch":
            first = publish_many(topic.name, batch("k1", "x"), enlist=True)
        else:
            first = [publish(topic.name, {"key": "k1"}, deduplication_key="k1", enlist=True)]
        threads.start(other_batch)
        _wait_until_a_backend_waits_on_a_lock(pg_conn)  # on k1, held by this transaction
        second = publish_many(topic.name, batch("k2", "y"), enlist=True)
    threads.join()

    assert {r.status for r in [*first, *second]} == {"Accepted"}
    owners = {"k1": first[0].message_id, "k2": second[0].message_id}
    assert [(r.status, r.message_id) for r in other] == [
        ("Duplicate", owners[key]) for key in other_keys
    ]


def _wait_until_a_backend_waits_on_a_lock(pg_conn, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        waiting = pg_conn.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        ).fetchone()[0]
        if waiting:
            return
        time.sleep(0.01)
    pytest.fail("no backend ever waited on a lock")


def test_concurrent_publishes_of_one_message_id_give_one_accepted_and_the_rest_duplicate():
    topic = TopicFactory()
    sub = SubscriptionFactory(topic=topic, partition_mode="Ordered")
    message_id = str(uuid.uuid4())

    results = _race(
        8,
        lambda i: publish(
            topic.name,
            {"same": "content"},
            message_id=message_id,
            partition_key="p-1",
            attributes={"kind": "click"},
        ),
    )

    assert sorted(r.status for r in results) == ["Accepted"] + ["Duplicate"] * 7
    assert {r.message_id for r in results} == {message_id}
    assert Message.objects.filter(topic=topic).count() == 1
    assert list(Delivery.objects.filter(subscription=sub).values_list("message_id", flat=True)) == [
        uuid.UUID(message_id)
    ]


def test_concurrent_publishes_of_one_message_id_with_different_content_conflict():
    topic = TopicFactory()
    SubscriptionFactory(topic=topic)
    message_id = str(uuid.uuid4())

    results = _race(6, lambda i: publish(topic.name, {"publisher": i}, message_id=message_id))

    statuses = sorted((r.status, r.error.code if r.error else None) for r in results)
    assert statuses == [("Accepted", None)] + [("Rejected", "MessageIDConflict")] * 5
    (stored,) = Message.objects.filter(topic=topic)
    winner = next(i for i, r in enumerate(results) if r.status == "Accepted")
    assert stored.payload == {"publisher": winner}


def test_interleaved_ordered_publishers_commit_each_keys_ordinals_in_order(monkeypatch, pg_conn):
    """Readers never see a key's ordinal N+1 before N, and Ordered claims follow ordinal order.

    Four publishers write to two keys at once: two one message at a time to key k, and two in
    two-key batches listing the keys in opposite orders (the batch takes its key locks in sorted
    order, so this must not deadlock). Transient retries are switched off so that a deadlock or
    lock timeout would show up as a rejected publish.
    """
    from workqueue import transport

    monkeypatch.setattr(transport, "TRANSIENT_RETRIES", 0)
    topic = TopicFactory()
    sub = SubscriptionFactory(topic=topic, partition_mode="Ordered")
    rounds = 25

    def single(p: int) -> list[Any]:
        return [publish(topic.name, {"p": p, "seq": s}, partition_key="k") for s in range(rounds)]

    def batched(p: int, keys: list[str]) -> list[Any]:
        out: list[Any] = []
        for s in range(rounds):
            out += publish_many(
                topic.name, [{"partition_key": k, "payload": {"p": p, "seq": s}} for k in keys]
            )
        return out

    snapshots: list[dict[str, list[int]]] = []
    stop = threading.Event()
    params = psycopg_params()

    def observe() -> None:
        with psycopg.connect(autocommit=True, **params) as conn:
            while not stop.is_set():
                rows = conn.execute(
                    "SELECT partition_key, publish_ordinal FROM workqueue_message "
                    "WHERE topic_id = %s ORDER BY publish_ordinal",
                    (topic.id,),
                ).fetchall()
                seen: dict[str, list[int]] = defaultdict(list)
                for key, ordinal in rows:
                    seen[key].append(ordinal)
                snapshots.append(dict(seen))

    observer = threading.Thread(target=observe, daemon=True)
    observer.start()
    barrier = threading.Barrier(4)
    jobs = [
        lambda: single(0),
        lambda: single(1),
        lambda: batched(2, ["k", "j"]),
        lambda: batched(3, ["j", "k"]),
    ]

    def run(job: Callable[[], list[Any]]) -> list[Any]:
        barrier.wait()
        try:
            return job()
        finally:
            get_driver().close()

    threads = _Threads()
    for job in jobs:
        threads.start(run, job)
    results = threads.join()
    stop.set()
    observer.join(10)

    assert {r.status for rs in results for r in rs} == {"Accepted"}
    messages = list(Message.objects.filter(topic=topic).order_by("publish_ordinal"))
    assert len(messages) == 2 * rounds + 2 * 2 * rounds
    final: dict[str, list[int]] = defaultdict(list)
    for m in messages:
        final[m.partition_key].append(m.publish_ordinal)
    gaps = [
        (key, seen)
        for snap in snapshots
        for key, seen in snap.items()
        if seen != final[key][: len(seen)]
    ]
    assert gaps == [], "a reader saw a later ordinal of a key before an earlier one committed"
    assert len({len(s.get("k", [])) for s in snapshots}) > 5, "the observer saw no progress"
    # Each publisher's own messages got increasing ordinals, per key.
    for key in ("k", "j"):
        for p in range(4):
            seqs = [
                m.payload["seq"] for m in messages if m.partition_key == key and m.payload["p"] == p
            ]
            assert seqs == sorted(seqs)

    # The weaker, consumer-side form: an Ordered subscription hands each key out in ordinal order.
    receiver = Receiver(sub.id, "checker")
    claimed: dict[str, list[int]] = defaultdict(list)
    ordinal = {str(m.id): m.publish_ordinal for m in messages}
    while batch := receiver.receive(10).deliveries:
        assert len({d.partition_key for d in batch}) == len(batch)
        for d in batch:
            claimed[d.partition_key].append(ordinal[d.message_id])
            assert receiver.complete(d).settled
    assert dict(claimed) == dict(final)
