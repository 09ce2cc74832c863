"""The stop a SIGTERM or SIGINT sets (``stop_on_signals``) is never lost, wherever the signal
lands in the main thread.

A signal's handler runs in the main thread between two of its bytecodes, and the main thread of
a host command spends its life waiting on that very stop (``workqueue_work`` looks 50 times a
second). With a ``threading.Event`` as the stop, a signal landing inside the Event's own wait
made the handler wait for the lock that wait held: the process ignored SIGTERM (and a second
one) until it was killed, with no drain (seen once in CI as a one-shot job that did not stop).
"""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from workqueue.runtime import process

PROJECT_ROOT = Path(__file__).resolve().parents[2]

# The main thread does nothing but wait on the stop, with no timeout to sleep through: an
# Event's wait(0) holds its lock for nearly all its run, so every round lands a signal there.
SPINNING_WAITER = textwrap.dedent(
    """
    import sys
    from workqueue.runtime.process import stop_on_signals

    for round in range(int(sys.argv[1])):
        with stop_on_signals() as stop:
            print("waiting", round, flush=True)
            while not stop.wait(0):
                pass
            print("stopped by", stop.received, flush=True)
    """
)


def lines_of(proc: subprocess.Popen) -> queue.Queue[str]:
    """The process's output lines as they come (a thread reads them: a wait for the next one
    can then time out, where a blocked ``readline()`` would hang the test)."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    return lines


def next_line(lines: queue.Queue[str], timeout: float = 10) -> str:
    """The next line, or "" when none comes within ``timeout`` seconds."""
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        return ""


@pytest.mark.processes
def test_a_signal_landing_while_the_main_thread_waits_on_the_stop_sets_it():
    rounds = 5
    proc = subprocess.Popen(
        [sys.executable, "-c", SPINNING_WAITER, str(rounds)],
        cwd=PROJECT_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = lines_of(proc)
    try:
        for round in range(rounds):
            assert next_line(lines) == f"waiting {round}\n"
            time.sleep(0.05)  # deep in the loop
            proc.send_signal(signal.SIGTERM)
            line = next_line(lines)  # empty if the process died or did not answer
            assert line == "stopped by SIGTERM\n", f"round {round}: {line!r}"
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.communicate()


def test_a_wait_returns_at_its_timeout_when_nothing_stops():
    stop = process.StopSignal()
    began = time.monotonic()

    assert stop.wait(0.1) is False
    assert time.monotonic() - began >= 0.1
    assert not stop.is_set()


def test_a_stop_set_by_another_thread_ends_a_wait_without_timeout():
    stop = process.StopSignal()
    setter = threading.Timer(0.05, stop.set)
    setter.start()
    began = time.monotonic()

    assert stop.wait() is True
    # Within a poll or so of being set, not at some later timeout (there is none to reach).
    assert time.monotonic() - began < 5
    assert stop.wait(0) is True
    setter.join()


def test_a_set_stop_is_seen_at_once():
    stop = process.StopSignal()
    stop.set()

    began = time.monotonic()
    assert stop.wait(60) is True
    assert time.monotonic() - began < 5  # at once, not after a poll's sleep or the timeout
