"""Operators, the sweeper and claimers racing on one Exclusive or Ordered subscription's keys,
each on its own PostgreSQL session, many of their calls made inside transactions held open
(and sometimes rolled back) while the others act: the attack helper-148 made on the stored
procedures.

Claimers take batches and complete, retry (at once or after a second), dead-letter, hand back,
abandon (the lease made to have run out), settle late with their old token after such an
expiry, or complete inside a transaction held open and then committed or rolled back.
Operators replay and discard dead letters one by one and in bulk, discard waiting work one by
one and in bulk (dry runs too), cancel running deliveries, run the sweeper's lease expiry, and
publish more (some scheduled a second ahead, at priorities from -5 to 5).

Each check is sound whatever the timing, so none can fail on a slow machine:

- Ordered: once a claim has returned, no earlier delivery of its key is open (Pending, InFlight
  or DeadLettered). An earlier delivery only ever goes from open to settled, never back, so one
  open after the claim was open at the claim.
- Exclusive: once a claim has returned, its delivery is the only InFlight one of its key, or it
  has already settled.
- A cancelled delivery is never claimed again after the claim its cancel landed on, and is left
  InFlight or Discarded, never Pending or dead-lettered.
- When the race stops and what is left is drained, nothing is stuck: an Exclusive subscription
  has nothing Pending, an Ordered one only deliveries behind their key's dead-lettered head.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction

from tests.factories import SubscriptionFactory, TopicFactory
from tests.support.database import edited_procedures, psycopg_params
from workqueue import publish_many
from workqueue.driver import get_driver

pytestmark = pytest.mark.usefixtures("queue_db")

KEYS = 6
RACE_SECONDS = 3.0
OPEN = "('Pending', 'InFlight', 'DeadLettered')"
ABANDON = (
    "UPDATE workqueue_delivery SET lease_expires_at = now() - interval '1 second', "
    "last_heartbeat_at = now() - interval '31 seconds' WHERE id = %s AND lease_token = %s"
)


def _session() -> psycopg.Connection:
    return psycopg.connect(autocommit=True, **psycopg_params())


class _Race:
    def __init__(self, subscription: Any, seed: int) -> None:
        self.sid = str(subscription.id)
        self.mode = subscription.partition_mode
        self.topic = subscription.topic.name
        self.seed = seed
        self.stop = threading.Event()
        self.draining = threading.Event()
        self.lock = threading.Lock()
        self.claims: list[tuple[str, float]] = []  # (delivery id, claimed at: the claim's now())
        self.violations: list[str] = []
        self.counts: Counter[str] = Counter()

    def count(self, what: str) -> None:
        with self.lock:
            self.counts[what] += 1

    # -- claimers -------------------------------------------------------------------------

    def claimer(self, index: int) -> None:
        rnd = random.Random(self.seed * 100 + index)
        with _session() as c:
            while not self.stop.is_set():
                try:
                    rows = c.execute(
                        "SELECT kind, delivery_id, lease_token, lease_expires_at, partition_key"
                        " FROM wq_claim(%s, %s, %s, NULL)",
                        (self.sid, f"claimer-{index}", rnd.randint(1, 4)),
                    ).fetchall()
                except psycopg.errors.LockNotAvailable:
                    self.count("claim lock timeout")
                    continue
                claimed = [r for r in rows if r[0] == "Claimed"]
                if not claimed:
                    time.sleep(0.005)
                for _kind, delivery_id, token, expires, key in claimed:
                    self.count("claimed")
                    self.check_claim(c, delivery_id, key)
                    with self.lock:
                        self.claims.append((str(delivery_id), expires.timestamp() - 30))
                    if self.draining.is_set():
                        c.execute("SELECT * FROM wq_complete(%s, %s)", (delivery_id, token))
                        c.execute(
                            "SELECT * FROM wq_acknowledge_cancel(%s, %s)", (delivery_id, token)
                        )
                        continue
                    time.sleep(rnd.random() * 0.01)
                    try:
                        self.settle(c, rnd, delivery_id, token)
                        c.execute(
                            "SELECT * FROM wq_acknowledge_cancel(%s, %s)", (delivery_id, token)
                        )
                    except psycopg.errors.LockNotAvailable:
                        self.count("settle lock timeout")

    def check_claim(self, c: psycopg.Connection, delivery_id: Any, key: str) -> None:
        if self.mode == "Ordered":
            earlier = c.execute(
                "SELECT count(*) FROM workqueue_delivery d, workqueue_delivery x"
                " WHERE x.id = %s AND d.subscription_id = x.subscription_id"
                f" AND d.partition_key = x.partition_key AND d.order_key < x.order_key"
                f" AND d.status IN {OPEN}",
                (delivery_id,),
            ).fetchone()[0]
            if earlier:
                self.violations.append(f"{key}: claimed with {earlier} earlier deliveries open")
        else:
            others = c.execute(
                "SELECT count(*) FROM workqueue_delivery d, workqueue_delivery x"
                " WHERE x.id = %s AND x.status = 'InFlight'"
                " AND d.subscription_id = x.subscription_id"
                " AND d.partition_key = x.partition_key AND d.status = 'InFlight'"
                " AND d.id <> x.id",
                (delivery_id,),
            ).fetchone()[0]
            if others:
                self.violations.append(f"{key}: claimed beside {others} in flight")

    def settle(
        self, c: psycopg.Connection, rnd: random.Random, delivery_id: Any, token: Any
    ) -> None:
        fence = (delivery_id, token)
        op = rnd.random()
        if op < 0.40:
            c.execute("SELECT * FROM wq_complete(%s, %s)", fence)
        elif op < 0.50:
            c.execute(
                "SELECT * FROM wq_retry(%s, %s, %s, 'again')", (*fence, rnd.choice([0, 0, 1]))
            )
        elif op < 0.57:
            c.execute("SELECT * FROM wq_dead_letter(%s, %s, 'Poison', 'no')", fence)
        elif op < 0.62:
            c.execute("SELECT * FROM wq_release(%s, %s)", fence)
        elif op < 0.72:
            # A transactional completion held open, then committed or rolled back (and the
            # rolled-back attempt retried, as the runtime would).
            rolled_back = rnd.random() < 0.4
            with c.transaction() as tx:
                c.execute("SELECT * FROM wq_complete(%s, %s)", fence)
                time.sleep(rnd.random() * 0.03)
                if rolled_back:
                    self.count("completion rolled back")
                    raise psycopg.Rollback(tx)
            if rolled_back:
                c.execute("SELECT * FROM wq_retry(%s, %s, 0, 'rolled back')", fence)
        elif op < 0.85:
            c.execute(ABANDON, fence)  # the holder stopped: its lease has run out
            self.count("abandoned")
        else:
            # The lease runs out, then the old holder renews and completes with its token,
            # racing the sweeper and the other claimers that may have taken it back.
            c.execute(ABANDON, fence)
            time.sleep(rnd.random() * 0.01)
            c.execute("SELECT * FROM wq_extend_lease(%s, %s, NULL)", fence)
            c.execute("SELECT * FROM wq_complete(%s, %s)", fence)
            self.count("late settle")

    # -- operators --------------------------------------------------------------------------

    def operator(self, index: int) -> None:
        rnd = random.Random(self.seed * 1000 + index)
        with _session() as c:
            while not self.stop.is_set() and not self.draining.is_set():
                try:
                    self.operate(c, rnd)
                except psycopg.errors.LockNotAvailable:
                    self.count("operator lock timeout")
                time.sleep(0.002)

    def pick(self, c: psycopg.Connection, status: str) -> Any:
        row = c.execute(
            "SELECT id FROM workqueue_delivery WHERE subscription_id = %s AND status = %s"
            " ORDER BY random() LIMIT 1",
            (self.sid, status),
        ).fetchone()
        return row[0] if row else None

    def operate(self, c: psycopg.Connection, rnd: random.Random) -> None:
        op = rnd.random()
        hold = rnd.random() * 0.03
        if op < 0.25:
            dead_letter = self.pick(c, "DeadLettered")
            if dead_letter is None:
                return
            replay = rnd.random() < 0.7
            with c.transaction() as tx:
                if replay:
                    c.execute(
                        "SELECT * FROM wq_replay(%s, %s, 'ops', 'n')", (self.sid, dead_letter)
                    )
                else:
                    c.execute(
                        "SELECT * FROM wq_discard(%s, %s, false, 'ops', 'n')",
                        (self.sid, dead_letter),
                    )
                time.sleep(hold)
                if rnd.random() < 0.2:
                    raise psycopg.Rollback(tx)
            self.count("replay" if replay else "discard dead letter")
        elif op < 0.40:
            running = self.pick(c, "InFlight")
            if running is not None:
                (changed,) = c.execute(
                    "SELECT * FROM wq_cancel(%s, %s, 'ops', 'stop')", (self.sid, running)
                ).fetchone()
                if changed:
                    self.count("cancel")
        elif op < 0.50:
            waiting = self.pick(c, "Pending")
            if waiting is not None:
                with c.transaction():
                    c.execute(
                        "SELECT * FROM wq_discard(%s, %s, true, 'ops', 'n')", (self.sid, waiting)
                    )
                    time.sleep(hold)
                self.count("discard waiting")
        elif op < 0.60:
            with c.transaction():
                c.execute(
                    "SELECT * FROM wq_resolve_dead_letters(%s, 'Replay', NULL, NULL, NULL, NULL,"
                    " NULL, NULL, 50, false, 'ops', 'bulk')",
                    (self.sid,),
                )
                time.sleep(hold)
            self.count("bulk replay")
        elif op < 0.65:
            with c.transaction():
                c.execute(
                    "SELECT * FROM wq_discard_pending(%s, true, %s, NULL, NULL, NULL, NULL, NULL,"
                    " NULL, 3, %s, 'ops', 'bulk')",
                    (self.sid, f"k{rnd.randrange(KEYS)}", rnd.random() < 0.5),
                )
                time.sleep(hold)
            self.count("bulk discard waiting")
        elif op < 0.80:
            with c.transaction():
                expired = c.execute("SELECT * FROM wq_expire_leases_all(50)").fetchall()
                time.sleep(hold)
            self.count("sweeper expiry")
            if expired:
                self.count("sweeper expired some")
        else:
            c.execute(
                "SELECT * FROM wq_publish(%s, gen_random_uuid(), %s, NULL, '{}'::jsonb, NULL,"
                " NULL, NULL, NULL, 10, false, 'ops', NULL, %s, %s, NULL)",
                (
                    self.topic,
                    f"k{rnd.randrange(KEYS)}",
                    rnd.choice([None, None, 1]),
                    rnd.randint(-5, 5),
                ),
            )
            self.count("publish")

    # -- the run --------------------------------------------------------------------------

    def run(self) -> None:
        threads = [threading.Thread(target=self.claimer, args=(i,), daemon=True) for i in range(3)]
        threads += [
            threading.Thread(target=self.operator, args=(i,), daemon=True) for i in range(2)
        ]
        for thread in threads:
            thread.start()
        time.sleep(RACE_SECONDS)
        # Drain: operators stop, claimers complete what they take (scheduled work, retries
        # after a second and abandoned leases the sweeper takes back included).
        self.draining.set()
        with _session() as c:
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                c.execute("SELECT * FROM wq_expire_leases_all(500)")
                (due,) = c.execute(
                    "SELECT count(*) FROM workqueue_delivery d WHERE d.subscription_id = %s"
                    " AND (d.status = 'InFlight' OR d.status = 'Pending' AND NOT EXISTS ("
                    "   SELECT 1 FROM workqueue_delivery h WHERE h.subscription_id = %s"
                    "      AND h.partition_key = d.partition_key AND h.order_key < d.order_key"
                    "      AND h.status = 'DeadLettered' AND %s))",
                    (self.sid, self.sid, self.mode == "Ordered"),
                ).fetchone()
                if due == 0:
                    break
                time.sleep(0.1)
        self.stop.set()
        for thread in threads:
            thread.join(30)
            assert not thread.is_alive()

    def check_the_end(self) -> None:
        with _session() as c:
            cancelled = dict(
                c.execute(
                    "SELECT id::text, extract(epoch FROM cancel_requested_at)::float"
                    " FROM workqueue_delivery WHERE subscription_id = %s"
                    " AND cancel_requested_at IS NOT NULL",
                    (self.sid,),
                ).fetchall()
            )
            misplaced_cancels = c.execute(
                "SELECT id, status FROM workqueue_delivery WHERE subscription_id = %s"
                " AND cancel_requested_at IS NOT NULL AND status NOT IN ('InFlight', 'Discarded')",
                (self.sid,),
            ).fetchall()
            stuck = c.execute(
                "SELECT d.partition_key, d.status FROM workqueue_delivery d"
                " WHERE d.subscription_id = %s AND d.status IN ('Pending', 'InFlight')"
                " AND NOT (%s AND EXISTS (SELECT 1 FROM workqueue_delivery h"
                "   WHERE h.subscription_id = d.subscription_id"
                "     AND h.partition_key = d.partition_key AND h.order_key < d.order_key"
                "     AND h.status = 'DeadLettered'))",
                (self.sid, self.mode == "Ordered"),
            ).fetchall()
        # The claim a cancel landed on may have begun before it (the cancel waited for the
        # claim's lock on the row): at most that one claim starts after the cancel's time.
        claimed_after_cancel = Counter(
            d for d, at in self.claims if d in cancelled and at > cancelled[d]
        )
        assert not self.violations, self.violations[:10]
        assert not misplaced_cancels, misplaced_cancels
        assert all(n <= 1 for n in claimed_after_cancel.values()), claimed_after_cancel
        assert not stuck, stuck


@pytest.mark.parametrize("mode", ["Ordered", "Exclusive"])
def test_keys_keep_their_rules_while_operators_and_the_sweeper_race_the_claimers(mode):
    topic = TopicFactory()
    sub = SubscriptionFactory(topic=topic, partition_mode=mode, max_attempts=3, lease_seconds=30)
    publish_many(
        topic.name, [{"payload": {"n": n}, "partition_key": f"k{n % KEYS}"} for n in range(240)]
    )
    race = _Race(sub, seed=148)

    race.run()

    race.check_the_end()
    # The race did race: every kind of move was made, many times over.
    for move in (
        "claimed",
        "replay",
        "cancel",
        "abandoned",
        "late settle",
        "completion rolled back",
        "sweeper expired some",
        "bulk replay",
        "discard waiting",
        "publish",
    ):
        assert race.counts[move] >= 1, (move, race.counts)


# Dead letters that no longer hold an Ordered key: its head, and the guard of the claim.
DEAD_LETTERS_DO_NOT_BLOCK = [
    (
        "AND h.status IN ('Pending', 'InFlight', 'DeadLettered')\n"
        "                     ORDER BY h.order_key\n"
        "                     LIMIT 1;\n"
        "                    IF FOUND AND v_head.status = 'Pending'",
        "AND h.status IN ('Pending', 'InFlight')\n"
        "                     ORDER BY h.order_key\n"
        "                     LIMIT 1;\n"
        "                    IF FOUND AND v_head.status = 'Pending'",
    ),
    (
        "AND h.partition_key = d.partition_key AND h.order_key < d.order_key\n"
        "                          AND h.status IN ('Pending', 'InFlight', 'DeadLettered')))",
        "AND h.partition_key = d.partition_key AND h.order_key < d.order_key\n"
        "                          AND h.status IN ('Pending', 'InFlight')))",
    ),
]


@pytest.fixture
def claim_that_ignores_dead_letters():
    """wq_claim with an Ordered key's dead-lettered head no longer holding the key, in this
    worker's test database; the real one put back after."""
    text = edited_procedures("claim", DEAD_LETTERS_DO_NOT_BLOCK)
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(text)
        yield
    finally:
        get_driver().close()
        with transaction.atomic():
            get_driver().install_procedures(connection)


def test_the_race_sees_an_ordered_key_run_past_its_dead_letter(claim_that_ignores_dead_letters):
    """Negative control: against a claim whose dead letters hold no key, the same race reports
    deliveries claimed with an earlier one of their key still open."""
    topic = TopicFactory()
    sub = SubscriptionFactory(
        topic=topic, partition_mode="Ordered", max_attempts=3, lease_seconds=30
    )
    publish_many(
        topic.name, [{"payload": {"n": n}, "partition_key": f"k{n % KEYS}"} for n in range(240)]
    )
    race = _Race(sub, seed=148)

    race.run()

    assert any("earlier deliveries open" in v for v in race.violations), race.counts
