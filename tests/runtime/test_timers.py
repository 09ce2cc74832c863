"""The timer thread every running delivery's heartbeats, lease horizons and time caps share.

Timers are scheduled without a lock (they queue for the thread, which wakes only for a deadline
earlier than the one it sleeps towards), so the tests race many scheduling threads against a
thread asleep towards a far deadline: a lost wake-up shows as a timer firing a minute late.
"""

from __future__ import annotations

import gc
import random
import threading
import time
import weakref

from tests.support.waiting import wait_until
from workqueue.runtime.timers import HEAP_REBUILD_MIN, SHED_EVERY, TimerQueue


def test_a_timer_due_before_the_one_the_thread_sleeps_towards_fires_on_time():
    timers = TimerQueue("test-timers")
    try:
        timers.schedule(60, lambda: None)
        time.sleep(0.05)  # the thread is asleep towards the 60 s deadline
        fired = threading.Event()
        began = time.monotonic()
        timers.schedule(0.02, fired.set)
        assert fired.wait(5), "the earlier timer did not wake the thread"
        assert time.monotonic() - began >= 0.02
    finally:
        timers.stop()


def test_cancelled_timers_never_fire_and_live_ones_behind_them_do():
    timers = TimerQueue("test-timers")
    try:
        fired: list[str] = []
        for n in range(100):
            timers.schedule(0.01, lambda n=n: fired.append(f"cancelled {n}")).cancel()
        timers.schedule(0.03, lambda: fired.append("live"))
        wait_until(lambda: fired, timeout=5)
        time.sleep(0.05)
        assert fired == ["live"]
    finally:
        timers.stop()


def test_no_timer_is_lost_while_many_threads_schedule_against_a_sleeping_thread():
    timers = TimerQueue("test-timers")
    try:
        timers.schedule(60, lambda: None)  # what the thread sleeps towards between the others
        per_thread, threads = 500, 4
        fired = threading.Semaphore(0)
        late: list[float] = []

        def schedule_many(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(per_thread):
                delay = rng.choice([0.0, 0.001, 0.005, 0.02, 30.0])
                due = time.monotonic() + delay

                def fire(due: float = due) -> None:
                    if time.monotonic() - due > 2:
                        late.append(time.monotonic() - due)
                    fired.release()

                timer = timers.schedule(delay, fire)
                if delay == 30.0:
                    timer.cancel()  # as a delivery's heartbeat is, once its handler returns
                    fired.release()
                if rng.random() < 0.05:
                    time.sleep(0.002)  # let the thread go back to sleep now and then

        workers = [threading.Thread(target=schedule_many, args=(n,)) for n in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        for _ in range(per_thread * threads):
            assert fired.acquire(timeout=10), "a timer never fired: its wake-up was lost"
        assert not late, f"timers fired late by {max(late):.1f} s"
    finally:
        timers.stop()


class _Work:
    """Stands for a running delivery: what a heartbeat's callback (a bound method) holds."""

    def tick(self) -> None:
        raise AssertionError("a cancelled timer fired")


def test_a_cancelled_timer_lets_go_of_its_callback_at_once_not_at_its_deadline():
    # A delivery's first heartbeat is due a third of the lease after it starts (20 s by
    # default) and is cancelled when its handler returns, milliseconds later. Held until the
    # deadline, every delivery a busy host ran in those 20 s stayed in memory with its payload.
    timers = TimerQueue("test-timers")
    try:
        # What the thread sleeps towards: a delivery still running, due before the others.
        timers.schedule(10, lambda: None)
        time.sleep(0.05)
        released = []
        for _ in range(2_000):
            work = _Work()
            released.append(weakref.ref(work))
            timers.schedule(20, work.tick).cancel()
        del work
        gc.collect()
        kept = sum(ref() is not None for ref in released)
        assert kept == 0, f"{kept} cancelled timers' callbacks are still held"
    finally:
        timers.stop()


def test_cancelled_timers_do_not_pile_up_while_the_thread_sleeps_towards_a_far_deadline():
    timers = TimerQueue("test-timers")
    try:
        timers.schedule(10, lambda: None)
        time.sleep(0.05)
        for _ in range(50_000):
            timers.schedule(20, lambda: None).cancel()
        # Held: the ones waiting for the thread, and those on its heap. The thread sheds the
        # cancelled ones as they come, so what it holds does not grow with what was scheduled.
        wait_until(lambda: len(timers._inbox) + len(timers._heap) <= 1_000, timeout=5)
    finally:
        timers.stop()


def test_a_fired_timer_lets_go_of_its_callback_while_the_thread_waits_for_the_next():
    timers = TimerQueue("test-timers")
    try:
        work = _FiredOnce()
        released = weakref.ref(work)
        # Kept by what it is for, as an execution keeps its timers: a cycle unless firing
        # empties the timer, and then only a garbage collection would free the two.
        work.timer = timers.schedule(0.01, work.tick)
        assert work.fired.wait(5)
        del work
        # By reference counting alone, once the thread is back asleep with nothing due.
        wait_until(lambda: released() is None, timeout=2)
    finally:
        timers.stop()


class _FiredOnce:
    def __init__(self) -> None:
        self.fired = threading.Event()
        self.timer: object = None

    def tick(self) -> None:
        self.fired.set()


class _SlowToSleep(TimerQueue):
    """A timer queue whose thread, once asked to, stops between its last look at the inbox
    and going to sleep until the test lets it go on: the moment a timer scheduled by another
    thread must not be missed in."""

    def __init__(self, name: str) -> None:
        self.stop_in_gap = False
        self.in_gap, self.leave_gap = threading.Event(), threading.Event()
        super().__init__(name)  # starts the thread, which looks at the inbox at once

    def _take_inbox(self) -> None:
        super()._take_inbox()
        if self.stop_in_gap:
            self.stop_in_gap = False
            self.in_gap.set()
            self.leave_gap.wait(5)


def test_a_timer_scheduled_while_the_thread_is_between_looking_and_sleeping_fires_on_time():
    timers = _SlowToSleep("test-timers")
    try:
        timers.stop_in_gap = True
        timers.schedule(30, lambda: None)  # wakes it: it takes this one, then stops in the gap
        assert timers.in_gap.wait(5)
        fired = threading.Event()
        timers.schedule(0.1, fired.set)  # earlier than what it is about to sleep towards
        timers.leave_gap.set()
        assert fired.wait(3), "the timer scheduled in the gap waited for the 30 s one"
    finally:
        timers.stop()


def test_the_heap_sheds_timers_cancelled_after_the_thread_took_them_and_live_ones_still_fire():
    timers = TimerQueue("test-timers")
    try:
        timers.schedule(10, lambda: None)
        time.sleep(0.05)
        fired = threading.Event()
        timers.schedule(0.5, fired.set)
        # As a busy host: each time the thread looks (every SHED_EVERY timers) the eight
        # deliveries running have live heartbeats, which go on the heap and are cancelled a
        # moment later, when their handlers return.
        running: list = []
        for _ in range(300):
            for timer in running:
                timer.cancel()
            running = [timers.schedule(20, lambda: None) for _ in range(8)]
            for _ in range(SHED_EVERY - 8):
                timers.schedule(20, lambda: None).cancel()
            while timers._inbox:
                time.sleep(0.001)
        # 2,400 went on the heap live; all but the last eight are cancelled now.
        assert len(timers._heap) <= HEAP_REBUILD_MIN + 8, len(timers._heap)
        assert fired.wait(5), "a live timer among the cancelled ones did not fire"
    finally:
        timers.stop()
