"""Instructions per published message, counted by valgrind: figures the machine's load cannot move.

Usage:
    PYTHONPATH=. .venv/bin/python bench/instructions.py
    PYTHONPATH=. .venv/bin/python bench/instructions.py --quick

The rates the other scripts measure move 20-40 % within an hour on this shared 2-core machine,
more than most changes to a procedure or to the publishing path gain or lose. This script
counts instructions instead, which do not depend on the load: run it before and after a
change, and the difference is the change's.

Everything runs in a scratch embedded PostgreSQL (a temporary folder, the queue's migrations,
a topic with one subscription and one with ten), deleted at the end; ``DATABASE_URL`` is ignored.

* The database's side: the cluster is stopped and its database run in single-user mode
  (``postgres --single``) under valgrind (``--tool=cachegrind --cache-sim=no``: it counts every
  instruction run, at about a twentieth of the speed), reading a script of prepared
  statements: the calls the driver sends for a publish (``wq_publish``, or ``wq_publish_many``
  of 100 with the items as the transport writes them), the notification it sends once one
  has committed, and as floors the same rows written bare (the statement of ``bench/aims.py``'s
  floors). The publishes run again to a topic with ten subscriptions, for aim 5 of issue 12
  (a fan-out to ten costs at most twice a publish to one). Each script runs twice, with few
  and with many calls after the same warm-up; the difference of the two totals divided by the
  extra messages is what a message costs, start-up and shutdown left out. Every run works on
  its own copy of the stopped cluster, so each starts from the same database (none sees the
  rows of another), and they run side by side. Single-user mode has no network protocol and
  prints each result row, both small next to a publish and alike for any two variants compared.
* The client's side: this project's Python publishing to the cluster (``publish``, and
  ``publish_many`` of 100), run under valgrind the same way: a warm-up run, and one per
  workload with its counted messages added. Interpreter start-up and Django's set-up cancel
  out, and waiting for the server runs no instructions.

Needs valgrind (``apt-get install valgrind``) and the embedded PostgreSQL's binaries. A full
run takes a minute and a half. ``--quick`` runs every workload with a handful of calls (CI runs
it so the script stays runnable): counted the same way, but over too few calls to compare one
change with another.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a handful of calls per workload")
    # Internal: the client's side, run by this script under valgrind against its scratch cluster.
    parser.add_argument(
        "--client", choices=("warm-up", "publish", "publish_many"), help=argparse.SUPPRESS
    )
    parser.add_argument("--topic", help=argparse.SUPPRESS)
    parser.add_argument("--calls", type=int, help=argparse.SUPPRESS)
    return parser.parse_args()


# Read before Django is set up: the scratch cluster's folder decides which database it uses.
ARGS = _arguments()
if ARGS.client is None:
    os.environ["WORKQUEUE_LOCALDB_DIR"] = tempfile.mkdtemp(prefix="wq-instructions-")
    os.environ.pop("DATABASE_URL", None)
os.environ["WORKQUEUE_LOCALDB"] = "1"
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
os.environ.setdefault("DJANGO_SECRET_KEY", secrets.token_urlsafe(50))

import django  # noqa: E402

django.setup()

from django.contrib.auth import get_user_model  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402

from bench.aims import rows_floor_statement, rows_floor_tables, rows_floor_values  # noqa: E402
from bench.publish import make_topic  # noqa: E402
from workqueue import localdb, publish, publish_many  # noqa: E402
from workqueue.conf import get_settings  # noqa: E402
from workqueue.driver import get_driver  # noqa: E402
from workqueue.driver.postgresql import PostgresDriver  # noqa: E402
from workqueue.driver.procedures import get_procedure  # noqa: E402
from workqueue.publishing import OutgoingMessage, _prepare, _SizeLimit  # noqa: E402
from workqueue.transport import publish_call  # noqa: E402

BATCH = 100
FANOUT = 10  # subscriptions of the fan-out topic
#: Calls of each workload made before the counted ones, in every run alike: the procedures'
#: plans made, psycopg's statements prepared (at their fifth use) and the scripts' PREPAREd
#: statements past their first five executions, which PostgreSQL plans anew each time.
WARMUP = 6
FLOOR_MESSAGES, FLOOR_DELIVERIES = "instructions_floor_message", "instructions_floor_delivery"


@dataclass(frozen=True)
class Counts:
    """Counted calls of each kind of workload after its warm-up: the database's side in a short
    and a long run, the client's side in one run each (its warm-up run counts none)."""

    single: tuple[int, int]  # one message a call
    batches: tuple[int, int]  # BATCH messages a call
    client_single: int
    client_batches: int


FULL = Counts(single=(20, 220), batches=(4, 44), client_single=200, client_batches=20)
QUICK = Counts(single=(1, 3), batches=(1, 2), client_single=10, client_batches=1)


def main() -> int:
    if ARGS.client is not None:
        return run_client(ARGS.client, ARGS.topic, ARGS.calls)
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("valgrind is not installed: apt-get install valgrind (Debian, Ubuntu)")
    counts = QUICK if ARGS.quick else FULL
    print(f"scratch cluster: {localdb.data_dir()} (deleted at the end)")
    try:
        topic, announcement, fanout_topic = set_up()
        print("client instructions per message (this project's Python, under valgrind):")
        single, batched = client_instructions(valgrind, topic, counts)
        print(f"  {'publish()':<60} {single:>12,.0f}")
        print(f"  {f'publish_many() of {BATCH}':<60} {batched:>12,.0f}")
        bindir = server_bindir()
        localdb.stop()
        print("database instructions per message (postgres --single, under valgrind):")
        workloads = {
            ("told", 1): announce_workload(announcement),
            **{
                (kind, batch): workload
                for batch in (1, BATCH)
                for kind, workload in (
                    ("ours", publish_workload(topic, batch)),
                    ("fanned", publish_workload(fanout_topic, batch)),
                    ("floor", floor_workload(batch)),
                )
            },
        }
        figures = ServerRuns(valgrind, bindir, counts).per_message(workloads)
        for batch, label, rows in (
            (1, "publish: wq_publish", "a publish's rows, bare"),
            (
                BATCH,
                f"publish_many of {BATCH}: wq_publish_many",
                f"a batch's rows, bare, {BATCH} a statement",
            ),
        ):
            ours, floor = figures["ours", batch], figures["floor", batch]
            # One notification a publish, whatever it holds: a batch's is shared by its messages.
            told = figures["told", 1] / batch
            # Its announcement names ten subscriptions instead of one: a few hundred bytes more
            # to copy, next to a notification's ~60,000 instructions, so not counted again.
            fanned = figures["fanned", batch] + told
            print(f"  {label:<60} {ours:>12,.0f}")
            print(f"  {'  its announcement: pg_notify':<60} {told:>12,.0f}")
            share = f"ours {(ours + told) / floor:.2f}x of it"
            print(f"  {'  ' + rows + ' (the floor)':<60} {floor:>12,.0f}   {share}")
            fanout = f"  to {FANOUT} subscriptions, announced"
            ratio = f"{fanned / (ours + told):.2f}x of one subscription's (aim 5: 2x at most)"
            print(f"  {fanout:<60} {fanned:>12,.0f}   {ratio}")
    finally:
        localdb.destroy()
    return 0


def set_up() -> tuple[str, tuple[str, str], str]:
    """Migrate the scratch cluster and make the topics and the floor's tables: the name of the
    topic with one subscription and the announcement of a publish to it (its channel; the
    payload names its subscription), and the name of the topic with ``FANOUT``."""
    call_command("migrate", verbosity=0)
    user = get_user_model()
    user._default_manager.get_or_create(**{user.USERNAME_FIELD: get_settings().SYSTEM_USER})
    with connection.cursor() as cursor:
        for statement in rows_floor_tables(FLOOR_MESSAGES, FLOOR_DELIVERIES):
            cursor.execute(statement)
    topic = make_topic(1)
    channel = get_driver().topic_channel(str(topic.id))
    return topic.name, (channel, str(topic.subscriptions.get().id)), make_topic(FANOUT).name


def server_bindir() -> Path:
    """The running server's own binaries: single-user mode must be the same PostgreSQL."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT setting FROM pg_config WHERE name = 'BINDIR'")
        return Path(cursor.fetchone()[0])


# -- the client's side --------------------------------------------------------------------------


def client_instructions(valgrind: str, topic: str, counts: Counts) -> tuple[float, float]:
    """Instructions per message of this project's Python: ``publish()``, ``publish_many()``."""
    # A fixed hash seed: string hashing, and with it dictionaries' probing, alike in every run.
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    runs = {"warm-up": 0, "publish": counts.client_single, "publish_many": counts.client_batches}
    with tempfile.TemporaryDirectory(prefix="wq-instructions-") as folder:
        outs = {workload: Path(folder) / f"client-{workload}.cachegrind" for workload in runs}
        commands = [
            [
                valgrind,
                "--tool=cachegrind",
                "--cache-sim=no",
                f"--cachegrind-out-file={outs[workload]}",
                sys.executable,
                __file__,
                "--client",
                workload,
                "--topic",
                topic,
                "--calls",
                str(calls),
            ]
            for workload, calls in runs.items()
        ]
        # All at once: what else the machine runs moves no instruction count.
        with ThreadPoolExecutor(len(commands)) as pool:
            list(pool.map(lambda command: _run(command, env=env), commands))
        warm_up, single, batched = (_total_instructions(outs[workload]) for workload in runs)
    return (
        (single - warm_up) / counts.client_single,
        (batched - warm_up) / (counts.client_batches * BATCH),
    )


def run_client(workload: str, topic: str, calls: int) -> int:
    """Warm both workloads up, then make ``calls`` more calls of ``workload`` (the warm-up run
    makes none), inside valgrind."""
    for n in range(WARMUP):
        publish(topic, {"n": n})
    for _ in range(WARMUP):
        publish_many(topic, [{"payload": {"n": n}} for n in range(BATCH)])
    for call in range(calls):
        if workload == "publish":
            publish(topic, {"n": call})
        else:
            publish_many(topic, [{"payload": {"n": n}} for n in range(BATCH)])
    return 0


# -- the database's side ------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """One kind of call in a single-user script: its PREPARE, ``calls(n)`` making ``n`` fresh
    EXECUTEs of it (new message ids and ordinals each time), and the messages a call stands
    for."""

    prepare: str
    calls: Callable[[int], list[str]]
    per_call: int


class ServerRuns:
    """Single-user runs under valgrind, each on its own copy of the stopped scratch cluster."""

    def __init__(self, valgrind: str, bindir: Path, counts: Counts) -> None:
        self.valgrind, self.bindir, self.counts = valgrind, bindir, counts
        self.folder = localdb.data_dir()
        owner = (self.folder / "data").stat()
        # As root, the server's own account: postgres refuses to run as root.
        self.account: dict[str, Any] = (
            {"user": owner.st_uid, "group": owner.st_gid, "extra_groups": []}
            if os.geteuid() == 0 and owner.st_uid != 0
            else {}
        )
        self.runs = itertools.count(1)

    def per_message(self, workloads: dict[Any, Workload]) -> dict[Any, float]:
        """Instructions per message of each workload: its script with few and with many calls
        after the same warm-up, the difference divided by the extra messages."""

        def calls(workload: Workload) -> tuple[int, int]:
            return self.counts.single if workload.per_call == 1 else self.counts.batches

        runs = [(key, count) for key, workload in workloads.items() for count in calls(workload)]

        def total(run: tuple[Any, int]) -> int:
            workload = workloads[run[0]]
            return self.total([workload.prepare, *workload.calls(WARMUP + run[1])])

        # Every run starts from the same database, so none sees another's rows, and they can
        # run side by side: what else the machine runs moves no instruction count.
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            try:
                totals = dict(zip(runs, pool.map(total, runs), strict=True))
            except BaseException:
                pool.shutdown(cancel_futures=True)  # not the other runs first, minutes each
                raise
        figures = {}
        for key, workload in workloads.items():
            short, long = calls(workload)
            extra = (long - short) * workload.per_call
            figures[key] = (totals[key, long] - totals[key, short]) / extra
        return figures

    def total(self, statements: list[str]) -> int:
        """Instructions of one single-user run of ``statements`` on a copy of the cluster."""
        run = next(self.runs)
        data = self.folder / f"data-{run}"
        script = self.folder / f"script-{run}.sql"
        out = self.folder / f"script-{run}.cachegrind"
        # cp -a keeps the files' owner and modes, which the server checks.
        _run(["cp", "-a", str(self.folder / "data"), str(data)])
        script.write_text("".join(f"{statement}\n" for statement in statements))
        try:
            with script.open() as commands:
                finished = _run(
                    [
                        self.valgrind,
                        "--tool=cachegrind",
                        "--cache-sim=no",
                        f"--cachegrind-out-file={out}",
                        str(self.bindir / "postgres"),
                        "--single",
                        "-D",
                        str(data),
                        "workqueue",
                    ],
                    stdin=commands,
                    cwd=self.folder,
                    **self.account,
                )
        finally:
            shutil.rmtree(data)
        # Single-user mode reports an error on its standard error and goes on with the next
        # statement: a script that failed would otherwise be counted as a cheap one.
        if "ERROR:" in finished.stderr:
            problem = next(line for line in finished.stderr.splitlines() if "ERROR:" in line)
            raise SystemExit(f"a statement of {script} failed: {problem.strip()}")
        try:
            return _total_instructions(out)
        finally:
            # Not left in the cluster's folder, which localdb.destroy() deletes only while it
            # holds nothing but its own files.
            script.unlink()
            out.unlink(missing_ok=True)


def publish_workload(topic: str, batch: int) -> Workload:
    """Publishes of ``batch`` new messages to ``topic``, as the driver sends them on its own
    connection (prepared, announcing afterwards itself)."""
    driver = get_driver()
    procedure = get_procedure("wq_publish_many" if batch > 1 else "wq_publish")
    limit = _SizeLimit.of(None)

    def calls(count: int) -> list[str]:
        statements = []
        for _ in range(count):
            items = [_prepare(OutgoingMessage(payload={"n": n}), limit) for n in range(batch)]
            _name, params = publish_call(topic, items, "workqueue-system", external=False)
            values = driver.bind(procedure, {**params, "caller_announces": True})
            statements.append(f"EXECUTE publish({', '.join(map(_literal, values))})")
        return statements

    # With the columns that say what to announce, as the driver's own connection calls it.
    call = _numbered(driver.render_announcing_call(procedure))
    return Workload(f"PREPARE publish AS {call}", calls, batch)


def announce_workload(announcement: tuple[str, str]) -> Workload:
    """The announcement the driver sends after a publish: a bare notification on the topic's
    channel, with the payload a publish returned."""
    channel, payload = map(_literal, announcement)
    return Workload(
        f"PREPARE announce AS {PostgresDriver._announce_sql.decode()}",
        lambda count: [f"EXECUTE announce({channel}, {payload})"] * count,
        1,
    )


def floor_workload(batch: int) -> Workload:
    """The floors' statement, ``batch`` messages a call."""
    statement = rows_floor_statement(FLOOR_MESSAGES, FLOOR_DELIVERIES)
    topic, subscription = uuid.uuid4(), uuid.uuid4()

    def calls(count: int) -> list[str]:
        # Ordinals from 0 in every run: each starts from the same database.
        executions = []
        for n in range(count):
            values = rows_floor_values(n, batch, topic, subscription)
            executions.append(f"EXECUTE floor({', '.join(map(_literal, values))})")
        return executions

    return Workload(f"PREPARE floor AS {_numbered(statement)}", calls, batch)


def _numbered(sql: str) -> str:
    """``sql`` on one line (single-user mode ends a statement at a newline), its ``%s``
    placeholders numbered as PREPARE takes them."""
    pieces = " ".join(sql.split()).split("%s")
    return "".join(f"{piece}${n}" for n, piece in enumerate(pieces[:-1], 1)) + pieces[-1]


def _literal(value: Any) -> str:
    """A value as SQL text (the statements' casts give it its type)."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        # An array's literal, each element quoted inside it: the parameter's cast types it.
        value = "{" + ",".join(f'"{_array_escaped(str(element))}"' for element in value) + "}"
    return "'" + str(value).replace("'", "''") + "'"


def _array_escaped(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


# -- valgrind -----------------------------------------------------------------------------------


def _run(command: list[str], **options: Any) -> subprocess.CompletedProcess[str]:
    run = subprocess.run(command, capture_output=True, text=True, check=False, **options)
    if run.returncode:
        raise SystemExit(
            f"{' '.join(command[:6])} ... failed (exit {run.returncode}):\n{run.stderr[-3000:]}"
        )
    return run


def _total_instructions(cachegrind_out: Path) -> int:
    found = re.search(r"^summary: (\d+)", cachegrind_out.read_text(), re.MULTILINE)
    if found is None:
        raise SystemExit(f"no instruction total in {cachegrind_out}")
    return int(found.group(1))


if __name__ == "__main__":
    sys.exit(main())
