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


#: Every this many timers scheduled, the thread is woken to shed those already cancelled, even
#: though none is due: a delivery's first heartbeat is due a third of its lease ahead, and a
#: busy host schedules and cancels thousands of them before the thread next wakes.
SHED_EVERY = 256
#: The heap is rebuilt without its cancelled timers once it has grown to twice its size after
#: the last rebuild (and past this): timers still live when the thread took them are cancelled
#: later, and otherwise wait on the heap until their deadlines.
HEAP_REBUILD_MIN = 1024


class Timer:
    __slots__ = ("callback", "deadline")

    def __init__(self, deadline: float, callback: Callable[[], None]) -> None:
        self.deadline = deadline
        self.callback: Callable[[], None] | None = callback

    @property
    def cancelled(self) -> bool:
        return self.callback is None

    def cancel(self) -> None:
        # The callback goes at once: it holds what the timer was for (a bound method of a
        # delivery's execution, and with it the delivery and its payload), which would
        # otherwise stay in memory, and in every full garbage collection, until the deadline.
        self.callback = None


class TimerQueue:
    def __init__(self, name: str = "workqueue-timers") -> None:
        self._heap: list[tuple[float, int, Timer]] = []
        # Every delivery schedules a timer (its first heartbeat or its lease horizon), nearly
        # always due after the timers already waiting, and most are cancelled a moment later:
        # new timers wait here, taken without a lock, until the thread next looks, and only
        # those still live go on the heap.
        self._inbox: deque[Timer] = deque()
        # The deadline the thread is sleeping towards; -inf while it is awake, when it looks at
        # the inbox again before it sleeps (see _next_due()).
        self._sleeping_until = -math.inf
        self._rebuild_heap_at = HEAP_REBUILD_MIN
        self._counter = itertools.count()
        self._condition = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def schedule(self, delay_seconds: float, callback: Callable[[], None]) -> Timer:
        timer = Timer(time.monotonic() + max(delay_seconds, 0.0), callback)
        self._inbox.append(timer)
        # Wake the thread only when it sleeps towards a later deadline. The timer is appended
        # before this read, and the thread sets the deadline before it looks at the inbox a
        # last time and sleeps: so either the thread finds the timer then, or this read sees
        # the deadline it sleeps towards (the notify then waits for the lock, which the thread
        # holds until it sleeps). And now and then to shed the cancelled ones (SHED_EVERY; a
        # count two threads both pass is caught at the next multiple).
        if timer.deadline < self._sleeping_until or len(self._inbox) % SHED_EVERY == 0:
            with self._condition:
                self._condition.notify()
        return timer

    def stop(self) -> None:
        with self._condition:
            self._stopped = True
            self._condition.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while (callback := self._next_due()) is not None:
            try:
                callback()
            except Exception:  # a failing callback must not stop every other timer
                logger.exception("Timer callback failed")
            del callback  # not kept while the thread waits for the next timer

    def _next_due(self) -> Callable[[], None] | None:
        """Wait for the earliest live timer's deadline and return its callback, taken from the
        timer (a fired timer holds nothing, as a cancelled one); None once stopped."""
        with self._condition:
            while not self._stopped:
                self._take_inbox()
                if self._heap and self._heap[0][2].cancelled:
                    heapq.heappop(self._heap)
                    continue
                timeout = self._heap[0][0] - time.monotonic() if self._heap else None
                if timeout is not None and timeout <= 0:
                    timer = heapq.heappop(self._heap)[2]
                    callback, timer.callback = timer.callback, None
                    if callback is not None:  # else cancelled since the look above
                        return callback
                    continue
                self._sleeping_until = self._heap[0][0] if self._heap else math.inf
                if self._inbox:
                    # Scheduled since _take_inbox, by a thread that may have read "awake"
                    # (-inf) and not notified: take it before sleeping.
                    self._sleeping_until = -math.inf
                    continue
                self._condition.wait(timeout)
                self._sleeping_until = -math.inf
            return None

    def _take_inbox(self) -> None:
        while self._inbox:
            timer = self._inbox.popleft()
            if not timer.cancelled:
                heapq.heappush(self._heap, (timer.deadline, next(self._counter), timer))
        if len(self._heap) >= self._rebuild_heap_at:
            self._heap = [entry for entry in self._heap if not entry[2].cancelled]
            heapq.heapify(self._heap)
            self._rebuild_heap_at = max(HEAP_REBUILD_MIN, 2 * len(self._heap))
