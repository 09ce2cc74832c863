"""PostgreSQL errors, provoked for real, reach callers as the right class: what is worth retrying
(deadlock, lock timeout, a terminated backend, a lost connection, a full disk) is a
TransientDriverError; a unique violation is a UniqueViolationError; a value the database cannot
store (a NUL character, a lone surrogate, any SQLSTATE class 22 data exception, a value past a
server limit) is an UnstorableValueError; other failures that would happen again (bad SQL) are a
plain DriverError. Only the transient ones are ever retried."""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
import uuid
from pathlib import Path

import psycopg
import pytest

from tests.support.database import psycopg_params, queue_connection_settings
from workqueue.driver import get_driver
from workqueue.exceptions import (
    DeadlockError,
    DriverError,
    LockTimeoutError,
    SerializationFailureError,
    TransientDriverError,
    UniqueViolationError,
    UnstorableValueError,
    one_line,
)

pytestmark = pytest.mark.usefixtures("queue_db")


@pytest.fixture
def tables(pg_conn):
    pg_conn.execute("CREATE TABLE wq_test_errors (id int PRIMARY KEY, v text)")
    pg_conn.execute("INSERT INTO wq_test_errors VALUES (1, 'a'), (2, 'b')")
    yield
    get_driver().close()
    pg_conn.execute("DROP TABLE wq_test_errors")


def raised(sql: str, values: list | None = None) -> DriverError:
    with pytest.raises(DriverError) as caught:
        get_driver().execute(sql, values or [])
    return caught.value


def test_a_unique_violation_is_a_unique_violation_error(tables):
    error = raised("INSERT INTO wq_test_errors VALUES (1, 'again')")
    assert type(error) is UniqueViolationError


def test_a_lock_timeout_is_transient_and_named_as_one(tables, pg_conn):
    with pg_conn.transaction():
        pg_conn.execute("SELECT * FROM wq_test_errors WHERE id = 1 FOR UPDATE")
        get_driver().execute("SET lock_timeout = '100ms'", [])
        error = raised("UPDATE wq_test_errors SET v = 'x' WHERE id = 1")
    assert type(error) is LockTimeoutError and "lock timeout" in str(error)
    assert isinstance(error, TransientDriverError)


def test_a_deadlock_between_two_connections_is_transient_and_named_as_one(tables):
    """Two transactions lock rows 1 and 2 in opposite orders; PostgreSQL kills one of them
    (a DeadlockError: the topology sync runs again on it)."""
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def worker(first: int, second: int) -> None:
        driver = get_driver()
        try:
            with driver.transaction() as conn, conn.cursor() as cursor:
                cursor.execute("UPDATE wq_test_errors SET v = 'x' WHERE id = %s", [first])
                barrier.wait(timeout=10)
                cursor.execute("UPDATE wq_test_errors SET v = 'y' WHERE id = %s", [second])
        except DriverError as exc:
            errors.append(exc)
        finally:
            driver.close()

    threads = [threading.Thread(target=worker, args=pair) for pair in ((1, 2), (2, 1))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    (error,) = errors
    assert type(error) is DeadlockError and "deadlock" in str(error)
    assert isinstance(error, TransientDriverError)


def test_a_serialization_failure_is_transient_and_named_as_one(tables, pg_conn):
    """A REPEATABLE READ transaction updating a row changed since its snapshot: what an enlisted
    completion meets after a lease renewal, which the executor names (its own class)."""
    driver = get_driver()
    try:
        with (
            pytest.raises(DriverError) as caught,
            driver.transaction() as conn,
            conn.cursor() as cursor,
        ):
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            cursor.execute("SELECT v FROM wq_test_errors WHERE id = 1")
            pg_conn.execute("UPDATE wq_test_errors SET v = 'elsewhere' WHERE id = 1")
            cursor.execute("UPDATE wq_test_errors SET v = 'here' WHERE id = 1")
    finally:
        driver.close()
    error = caught.value
    assert type(error) is SerializationFailureError and "serialize" in str(error)
    assert isinstance(error, TransientDriverError)


def test_a_terminated_backend_is_transient_and_the_next_call_reconnects(tables):
    driver = get_driver()
    (pid,) = driver.execute("SELECT pg_backend_pid()", [])[0]
    with psycopg.connect(autocommit=True, **psycopg_params()) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])

    error = raised("SELECT 1")

    assert isinstance(error, TransientDriverError)
    assert driver.execute("SELECT 1", []) == [(1,)]  # a fresh connection


@pytest.mark.parametrize("after_a_call", [False, True], ids=["first-call", "after-a-call"])
def test_a_server_that_cannot_be_reached_is_transient(tmp_path, after_a_call):
    # A database restarting: the thread's connection cannot be made at all (no socket), which
    # hosts retry until it is back. Seen failing with an AttributeError from the driver's
    # prepared-statement recovery, which looked at a connection that was never made.
    driver = get_driver()
    if after_a_call:
        driver.execute("SELECT 1", [])
        driver._local.raw.connection.close()  # what a restart leaves behind
    else:
        driver.close()
    with queue_connection_settings(HOST=str(tmp_path), options={}):
        error = raised("SELECT 1")

    assert isinstance(error, TransientDriverError)
    assert driver.execute("SELECT 1", []) == [(1,)]  # reconnects once the server is back


@pytest.mark.parametrize(
    ("sql", "values"),
    [
        ("SELEKT 1", []),  # a syntax error (42601)
        ("SELECT * FROM wq_no_such_table", []),  # 42P01
    ],
    ids=["syntax", "missing-table"],
)
def test_errors_that_would_fail_again_are_not_transient(tables, sql, values):
    error = raised(sql, values)
    assert type(error) is DriverError


@pytest.mark.parametrize(
    ("sql", "values"),
    [
        # psycopg refuses to send these: no SQLSTATE, the server never saw them.
        ("INSERT INTO wq_test_errors VALUES (3, %s)", ["nul \x00 inside"]),
        ("INSERT INTO wq_test_errors VALUES (3, %s)", ["lone \ud800 surrogate"]),
        # The server refuses these (SQLSTATE 22P05, 22P02, 22003).
        ("SELECT %s::jsonb", ['"nul \\u0000 escaped"']),
        ("SELECT %s::jsonb", ["NaN"]),
        ("SELECT %s::integer", ["99999999999"]),
        # A value past one of the server's limits (SQLSTATE 54000): refused before anything is
        # allocated, the way a jsonb string past 256 MiB is (a Tasks API return value, say).
        ("SELECT array_fill(0, ARRAY[%s])", [200_000_000]),
    ],
    ids=[
        "nul-character",
        "lone-surrogate",
        "jsonb-nul-escape",
        "jsonb-nan",
        "out-of-range",
        "past-a-server-limit",
    ],
)
def test_a_value_the_database_cannot_store_is_an_unstorable_value_error(tables, sql, values):
    error = raised(sql, values)

    assert type(error) is UnstorableValueError
    assert not isinstance(error, TransientDriverError)
    assert error.__cause__ is not None
    assert get_driver().execute("SELECT 1", []) == [(1,)]  # the connection is still fine


def test_an_enlisted_call_translates_the_same_way(tables):
    from django.db import connection, transaction

    with transaction.atomic(), pytest.raises(UnstorableValueError):
        get_driver().execute("SELECT %s::text", ["\ud800"], connection)


@pytest.fixture
def full_tablespace(pg_conn):
    """A table in a tablespace on a 1 MiB file system of its own, filled up: the next write to
    it fails for want of disk space, as every write does when the server's disk is full."""
    data_directory = Path(pg_conn.execute("SHOW data_directory").fetchone()[0])
    if os.geteuid() != 0 or not data_directory.exists():
        pytest.skip("needs root, and the test server's data folder on this machine")
    folder = Path(tempfile.mkdtemp(prefix="wq-full-disk-", dir="/tmp"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode != 0:
        folder.rmdir()
        pytest.skip(f"cannot mount a small file system here: {mounted.stderr.decode().strip()}")
    server = data_directory.stat()
    os.chown(folder, server.st_uid, server.st_gid)
    name = f"wq_full_{uuid.uuid4().hex[:8]}"
    try:
        pg_conn.execute(f"CREATE TABLESPACE {name} LOCATION '{folder}'")
        pg_conn.execute(f"CREATE TABLE {name} (body text) TABLESPACE {name}")
        with pytest.raises(psycopg.errors.DiskFull):
            pg_conn.execute(
                f"INSERT INTO {name} SELECT repeat(md5(n::text), 100) "
                "FROM generate_series(1, 100000) n"
            )
        yield name
    finally:
        get_driver().close()
        pg_conn.execute(f"DROP TABLE IF EXISTS {name}")
        pg_conn.execute(f"DROP TABLESPACE IF EXISTS {name}")
        subprocess.run(["umount", str(folder)], check=True)
        folder.rmdir()


def test_a_full_disk_is_transient_and_says_to_free_space(full_tablespace):
    """A full disk (SQLSTATE 53100) was a plain DriverError: a host gave up settling a handled
    delivery at once and left it to its lease, to be run again, rather than trying again
    while the lease lasted; publishers could not tell it apart from a call that would fail
    forever. Space freed (the sweeper's purges, an operator), the same call succeeds."""
    error = raised(
        f"INSERT INTO {full_tablespace} SELECT repeat(md5(n::text), 100) "
        "FROM generate_series(1, 1000) n"
    )

    assert isinstance(error, TransientDriverError)
    assert "No space left on device" in str(error) and "free disk space" in str(error)


@pytest.mark.parametrize(
    ("sql", "missing"),
    [
        ("SELECT * FROM wq_no_such_table", True),  # 42P01
        ("SELECT no_such_column FROM wq_test_errors", True),  # 42703
        ("SELECT wq_no_such_function()", True),  # 42883
        ("SELEKT 1", False),  # 42601
        ("SELECT 1 / 0", False),  # 22012
    ],
    ids=["table", "column", "function", "syntax", "division"],
)
def test_only_a_missing_table_column_or_function_reads_as_not_migrated(tables, sql, missing):
    """Commands explain these as `migrate` to run (when migrations are pending); any other
    error, a missing grant or a fault, must be told as itself."""
    assert get_driver().names_a_missing_object(raised(sql)) is missing


def test_an_error_that_points_at_a_statement_line_is_told_in_one_line_without_it():
    """A CI run cut a claim's session while the procedure planned one of its statements: the
    warning and the health reason carried the server's "LINE 4: EXISTS (SELECT 1 FROM
    public.workqueue_delivery x" and its caret, SQL where every outage is told in one line."""
    with pytest.raises(DriverError) as raised:
        get_driver().execute("SELECT 1\nFROM no_such_table", [])
    assert "LINE 2:" in str(raised.value)  # what psycopg says

    told = one_line(raised.value)

    assert told.endswith('relation "no_such_table" does not exist'), told
    assert "LINE" not in told and "^" not in told and "FROM" not in told
