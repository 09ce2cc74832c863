"""One thread that fires many short callbacks at their deadlines.

Heartbeat ticks, lease horizons and time caps of every running delivery share it, instead of a
thread per timer. Callbacks must return quickly (set a flag, hand work to a pool): a callback
that blocks would delay every other timer.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Timer:
    __slots__ = ("callback", "cancelled", "deadline")

    def __init__(self, deadline: float, callback: Callable[[], None]) -> None:
        self.deadline = deadline
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class TimerQueue:
    def __init__(self, name: str = "workqueue-timers") -> None:
        self._heap: list[tuple[float, int, Timer]] = []
        # Every delivery schedules a timer (its first heartbeat or its lease horizon), nearly
        # always due after the timers already waiting, and most are cancelled a moment later:
        # new timers wait here, taken without a lock, until the thread next looks, and only
        # those still live go on the heap.
        self._inbox: deque[Timer] = deque()
        # The deadline the thread is sleeping towards; -inf while it is not asleep, so a
        # timer scheduled meanwhile always wakes it (see schedule()).
        self._sleeping_until = -math.inf
        self._counter = itertools.count()
        self._condition = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def schedule(self, delay_seconds: float, callback: Callable[[], None]) -> Timer:
        timer = Timer(time.monotonic() + max(delay_seconds, 0.0), callback)
        self._inbox.append(timer)
        # Wake the thread only when it sleeps towards a later deadline. Appended before this
        # read, the timer is either taken by the thread before it next sleeps, or seen here
        # against the deadline it sleeps towards (or -inf, if it has not set it yet: then the
        # notify waits for the lock, which the thread holds until it sleeps).
        if timer.deadline < self._sleeping_until:
            with self._condition:
                self._condition.notify()
        return timer

    def stop(self) -> None:
        with self._condition:
            self._stopped = True
            self._condition.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._stopped:
                    self._take_inbox()
                    if self._heap and self._heap[0][2].cancelled:
                        heapq.heappop(self._heap)
                        continue
                    timeout = self._heap[0][0] - time.monotonic() if self._heap else None
                    if timeout is not None and timeout <= 0:
                        break
                    self._sleeping_until = self._heap[0][0] if self._heap else math.inf
                    self._condition.wait(timeout)
                    self._sleeping_until = -math.inf
                if self._stopped:
                    return
                _, _, timer = heapq.heappop(self._heap)
            if timer.cancelled:
                continue
            try:
                timer.callback()
            except Exception:  # a failing callback must not stop every other timer
                logger.exception("Timer callback failed")

    def _take_inbox(self) -> None:
        while self._inbox:
            timer = self._inbox.popleft()
            if not timer.cancelled:
                heapq.heappush(self._heap, (timer.deadline, next(self._counter), timer))
