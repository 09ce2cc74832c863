"""Process-level concerns of the host commands: stop signals, the kill switch, the metrics
port, what the garbage collector walks, and the arguments and console lines they share."""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    InterfaceError,
    OperationalError,
    ProgrammingError,
    connections,
)
from django.db import Error as DjangoDatabaseError

from workqueue import metrics
from workqueue.conf import MAX_CONCURRENCY, get_settings
from workqueue.driver.base import BaseDriver
from workqueue.exceptions import (
    DriverError,
    TransientDriverError,
    WorkQueueConfigurationError,
    one_line,
)

#: A second signal this soon after the first is the same stop delivered twice.
SECOND_SIGNAL_AFTER_SECONDS = 1.0


#: How often a wait on a StopSignal looks whether it was set: the longest a stop waits.
STOP_POLL_SECONDS = 0.02


class StopSignal:
    """Set by the first SIGTERM or SIGINT; ``received`` names that signal (``"SIGTERM"``).

    Setting it takes no lock, since a signal's handler runs in the main thread between any two
    of its bytecodes, also while that thread is inside a wait on this very object. A
    ``threading.Event`` there deadlocked: its ``set()`` waited for the lock its own ``wait()``
    held, for ever, and a second signal's handler did the same, so a one-shot job polling its
    stop 50 times a second now and then ignored SIGTERM until it was killed, with no drain.
    A wait therefore looks at a plain flag every ``STOP_POLL_SECONDS``."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the stop was set, at the latest once ``timeout`` seconds have passed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._set:
            left = STOP_POLL_SECONDS if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(left, STOP_POLL_SECONDS))
        return True


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopSignal]:
    """An event set by the first SIGTERM or SIGINT while the block runs (the host then drains).

    The handlers the process had are put back at the block's end, so a command run inside
    another program (``call_command``, a test suite) leaves Ctrl-C and SIGTERM working there
    as before, instead of setting an event nobody waits on any more."""
    stop = StopSignal()

    first_at: list[float] = []

    def handler(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        # Nothing here may take a lock (StopSignal says why).
        if not stop.is_set():
            stop.received = name
            first_at.append(time.monotonic())
            stop.set()
            return
        if time.monotonic() - first_at[0] < SECOND_SIGNAL_AFTER_SECONDS:
            # One stop, delivered twice: a terminal's Ctrl-C reaches the whole process group
            # (SIGINT), and a process manager (honcho, foreman) then sends its SIGTERM, or a
            # wrapper in the same group passes the SIGINT on.
            return
        # A second signal while the host drains: whoever sent it will not wait (Ctrl-C again,
        # a supervisor's second SIGTERM). Exit now rather than ignore it; what is still running
        # keeps its lease until it expires, then runs again (at-least-once), as after a crash.
        os.write(
            2,
            f"Second signal ({name}) during the drain: exiting now; deliveries still running "
            "are retried once their leases expire.\n".encode(),
        )
        os._exit(1)

    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    for signum in previous:
        signal.signal(signum, handler)
    try:
        yield stop
    finally:
        for signum, former in previous.items():
            if former is not None:  # None: set outside Python (an embedding server), kept as is
                signal.signal(signum, former)


@contextlib.contextmanager
def database_errors_explained() -> Iterator[None]:
    """One line naming the fix (a ``CommandError``), instead of a traceback through the ORM,
    when a command finds the database away or not migrated: a host started against a wrong
    ``DATABASE_URL`` printed 95 lines from deep inside its start, and one started before
    ``migrate`` said only that ``auth_user`` did not exist."""
    try:
        yield
    except (OperationalError, InterfaceError, TransientDriverError) as exc:
        # Django's OperationalError also covers timeouts, deadlocks and a full server, and the
        # queue's own calls raise TransientDriverError for the same: the database's own words
        # say which.
        raise CommandError(
            f"The database could not be used ({one_line(exc)}). If it is away, check that it runs "
            "and that DATABASE_URL (or DATABASES) points at it; then run the command again."
        ) from exc
    except (ProgrammingError, DriverError) as exc:
        problem = unmigrated_problem(exc)
        if problem is None:
            raise
        raise CommandError(problem) from exc
    except DjangoDatabaseError as exc:
        # A database library's own error outside the DB-API classes above (pyodbc's, for a
        # missing ODBC driver): the driver tells which mean this machine lacks a part.
        driver = _queue_driver()
        problem = driver.client_setup_problem(exc) if driver is not None else None
        if problem is None:
            raise
        raise CommandError(problem) from exc


def _queue_driver() -> BaseDriver | None:
    """The driver of the queue's database, or None when the settings give none (their own
    problem, reported elsewhere)."""
    from workqueue.driver import get_driver

    try:
        alias = get_settings().DATABASE_ALIAS
    except WorkQueueConfigurationError:
        alias = DEFAULT_DB_ALIAS
    try:
        return get_driver(alias)
    except (DatabaseError, WorkQueueConfigurationError):
        return None


def unmigrated_problem(error: BaseException) -> str | None:
    """Why ``error`` arose, naming ``migrate``, when it says a table, column or procedure is
    missing and the queue's database has migrations to apply; else None (a missing grant, say,
    or a fault: told as themselves). Asked only once something failed: it reads every
    migration file."""
    from django.db.migrations.executor import MigrationExecutor

    driver = _queue_driver()
    try:
        if driver is None or not driver.names_a_missing_object(error):
            return None
        executor = MigrationExecutor(connections[driver.alias])
        plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    except (DatabaseError, WorkQueueConfigurationError):
        return None
    if not plan:
        return None
    first = plan[0][0]
    return (
        f"The database {driver.alias!r} is not migrated: {len(plan)} migration(s) to apply, the "
        f"first {first.app_label}.{first.name}. Run `manage.py migrate`, then run the command "
        "again."
    )


def host_disabled() -> bool:
    """WORKQUEUE_DISABLE_HOST=1 makes the host commands exit 0 at once."""
    return os.environ.get("WORKQUEUE_DISABLE_HOST", "").strip().lower() in {"1", "true", "yes"}


def add_concurrency_argument(parser: CommandParser, help: str) -> None:
    """``--concurrency N``: 1 to MAX_CONCURRENCY, refused as an argument otherwise (a host
    would start and leave every subscription in Error)."""

    def concurrency(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if not 1 <= value <= MAX_CONCURRENCY:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a concurrency from 1 to {MAX_CONCURRENCY:,} (a host runs at "
                "most that many handlers of one subscription; run more hosts for more)"
            )
        return value

    parser.add_argument("--concurrency", type=concurrency, default=None, metavar="N", help=help)


def describe_drain(shutdown_drain_ms: int) -> str:
    """The console's words for a host's drain: it waits twice (for handlers to finish, then,
    having aborted those still running, for them to return)."""
    return (
        f"draining running handlers (up to {shutdown_drain_ms} ms; any still running are then "
        f"aborted and given {shutdown_drain_ms} ms more) ..."
    )


#: The exit code of a host command whose drain left work behind: a supervisor or job runner
#: can tell it from a clean stop (0), as the last console line tells a reader.
EXIT_WORK_LEFT_BEHIND = 3


def exit_now_if_work_left_behind(host: Any) -> None:
    """End the process at once, with ``EXIT_WORK_LEFT_BEHIND``, when the drain left work
    behind: handlers that did not stop, or outcomes still being recorded on a database that
    does not answer.

    Left to interpreter exit, the threads running them can keep a draining process alive past
    its termination grace period (a handler that ignores its abort signal did:
    tests/processes/test_host_processes.py). Their deliveries are left to lease expiry, as the
    drain's last line says.
    """
    if host.abandoned_handlers or host.unsettled_outcomes:
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_WORK_LEFT_BEHIND)


def describe_left_behind(host: Any) -> str:
    """What a stopped host's drain gave up on, for its last console line."""
    parts = []
    if host.abandoned_handlers:
        parts.append(f"{host.abandoned_handlers} handler(s) did not stop")
    if host.unsettled_outcomes:
        parts.append(
            f"{host.unsettled_outcomes} handler(s) returned but the database did not record "
            "their outcome in time"
        )
    if host.not_handed_back:
        parts.append(
            f"{host.not_handed_back} delivery(ies) claimed ahead and never started could not "
            "be handed back"
        )
    if host.claims_left_out:
        parts.append(
            f"{host.claims_left_out} claim(s) still waited for the database, or lost their "
            "answer, so what they took could not be handed back"
        )
    if not parts:
        return "every handler finished or was handed back."
    return "; ".join(parts) + "; their deliveries are left to lease expiry."


@contextlib.contextmanager
def start_up_objects_frozen() -> Iterator[None]:
    """Run the block with every object alive at its start kept out of the cyclic garbage
    collector's walks (``gc.freeze``), and hand them back to it at the block's end.

    The host commands run their host in it, entered once Django is set up and before the host
    is built. What exists by then (Django's apps, models, URL patterns and settings) lives as
    long as the process, yet every full collection walked all of it: about 90,000 objects in
    the sample project, and about a tenth of a busy host's CPU (``bench/drain.py``; see
    docs/performance.md). Frozen objects are still freed the ordinary way when nothing refers
    to them; only a cycle that takes one of them in waits for the block's end. A collection
    first, so that no garbage is frozen.

    The end of the block unfreezes them, so a command run inside another program
    (``call_command``, a test) leaves that process as it found it (on CPython 3.12, with the
    interpreter's own few hundred unfrozen too). A process that has frozen objects itself since
    Django loaded its apps (a pre-forking server, say) keeps its own arrangement: then nothing
    is frozen or unfrozen here.
    """
    from workqueue.apps import FROZEN_BEFORE_THE_APPS

    # Not merely "any": on CPython 3.12 the interpreter's own start-up count made every host
    # skip the freeze (the Django 6 leg of the suite found it).
    if gc.get_freeze_count() > FROZEN_BEFORE_THE_APPS:
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def add_metrics_arguments(parser: CommandParser, counters: str) -> None:
    """``--metrics-port`` and ``--metrics-address``; ``counters`` names what the process
    counts ("this host's counters")."""
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help=f"Also serve Prometheus metrics ({counters} and the queue's gauges) over HTTP on "
        "this port, without authentication: bind it where only your scraper reaches.",
    )
    parser.add_argument(
        "--metrics-address",
        default="127.0.0.1",
        metavar="ADDRESS",
        help="Address for --metrics-port (default 127.0.0.1).",
    )


@contextlib.contextmanager
def metrics_served(port: int | None, address: str) -> Iterator[Any]:
    """The metrics HTTP server on ``port`` (None: no server) while the block runs; stopped and
    its port released at the end, however the block ends (a host that fails to start, too)."""
    if port is None:
        yield None
        return
    try:
        server = metrics.serve(port, address)
    except OSError as exc:
        raise CommandError(
            f"Cannot serve metrics on {address}:{port}: {exc}. Choose another --metrics-port."
        ) from exc
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
