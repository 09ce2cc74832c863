"""The SQL Server driver without a server: call rendering, values, error mapping, installation.

The live behaviour of the procedures is the conformance suite's job (run against a real server
when WORKQUEUE_TEST_MSSQL_URL is set); these tests cover what can be decided offline.
"""

from __future__ import annotations

import datetime as dt
import re
import uuid
from contextlib import contextmanager
from typing import Any

import pyodbc
import pytest
from django.db import DatabaseError, IntegrityError, InterfaceError, OperationalError
from mssql_python import exceptions as mssql_python_errors

from tests.support.tsql import parse_tsql
from workqueue.driver.base import JsonText
from workqueue.driver.procedures import PROCEDURES, Grant, ParamType, get_procedure
from workqueue.driver.sqlserver import (
    STAMP_STATEMENT,
    SqlServerDriver,
    declared_routines,
    error_number,
    split_batches,
    stored_uuid,
)
from workqueue.exceptions import (
    DeadlockError,
    DriverError,
    LockTimeoutError,
    PrivilegeRefusedError,
    SerializationFailureError,
    TransientDriverError,
    UniqueViolationError,
)
from workqueue.sql import load_procedures


@pytest.fixture
def driver() -> SqlServerDriver:
    return SqlServerDriver("sqlserver-offline")


# -- rendering --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PROCEDURES))
def test_every_registered_procedure_renders_as_exec_with_named_parameters(driver, name):
    procedure = get_procedure(name)
    sql = driver.render_call(procedure)
    expected = f"EXEC dbo.{name}"
    if procedure.params:
        expected += " " + ", ".join(f"@{p.name} = %s" for p in procedure.params)
    assert sql == expected
    assert sql.count("%s") == len(procedure.params)


def test_a_call_without_parameters_is_a_bare_exec(driver):
    sql = driver.render_call(get_procedure("wq_read_committed_snapshot_state"))
    assert sql == "EXEC dbo.wq_read_committed_snapshot_state"


def test_rendered_calls_are_valid_tsql(driver, tmp_path):
    script = tmp_path / "calls.sql"
    calls = [driver.render_call(p).replace("%s", "NULL") + ";" for p in PROCEDURES.values()]
    script.write_text("\n".join(calls) + "\nGO\n")
    result = parse_tsql(script)
    assert result.returncode == 0, result.stderr


class _RecordingCursor:
    def __init__(self) -> None:
        self.executed: list[tuple[str, tuple[Any, ...]]] = []

    def execute(self, sql: str, params: Any = ()) -> None:
        self.executed.append((sql, params))


def test_mssql_django_turns_the_rendered_call_into_odbc_placeholders(driver):
    # The real mssql-django cursor wrapper, over a recording DB-API cursor.
    from mssql.base import CursorWrapper

    class _Connection:
        driver_charset = None

    procedure = get_procedure("wq_discard")
    raw = _RecordingCursor()
    values = [
        driver.adapt(p, v)
        for p, v in zip(
            procedure.params,
            ["0F8FAD5B-D9CB-469F-A165-70867728950E", uuid.uuid4(), True, "ops", "gone"],
            strict=True,
        )
    ]
    CursorWrapper(raw, _Connection()).execute(driver.render_call(procedure), values)
    ((sql, params),) = raw.executed
    assert sql == (
        "EXEC dbo.wq_discard @subscription_id = ?, @delivery_id = ?, @allow_pending = ?, "
        "@actor = ?, @reason = ?"
    )
    assert params[0] == uuid.UUID("0f8fad5b-d9cb-469f-a165-70867728950e")
    assert isinstance(params[1], uuid.UUID)
    assert params[2:] == (1, "ops", "gone")


# -- values -----------------------------------------------------------------------------------


def test_parameters_are_adapted_to_what_the_odbc_drivers_bind(driver):
    procedure = get_procedure("wq_publish")
    by_name = {p.name: p for p in procedure.params}
    assert driver.adapt(by_name["message_id"], "0F8FAD5B-D9CB-469F-A165-70867728950E") == (
        uuid.UUID("0f8fad5b-d9cb-469f-a165-70867728950e")
    )
    assert driver.adapt(by_name["attributes"], {"b": "2", "a": "1"}) == '{"a":"1","b":"2"}'
    # A str payload is a JSON string value, encoded like any other value.
    assert driver.adapt(by_name["payload"], "as text") == '"as text"'
    # Only JsonText, the text publishing made of a payload already, goes through as it is.
    passed = driver.adapt(by_name["payload"], JsonText('{"a":1}'))
    assert passed == '{"a":1}' and type(passed) is str
    assert driver.adapt(by_name["envelope_bytes"], "12") == 12
    assert driver.adapt(by_name["external"], 0) is False
    assert driver.adapt(by_name["partition_key"], None) is None
    with pytest.raises(ValueError):
        driver.adapt(by_name["message_id"], "not-a-uuid")


def test_results_come_back_with_lower_case_uuids_and_aware_timestamps(driver):
    procedure = get_procedure("wq_extend_lease")
    assert driver.decode_row(procedure, ("Held", dt.datetime(2030, 1, 1, 12, 0))) == {
        "lease_state": "Held",
        "lease_expires_at": dt.datetime(2030, 1, 1, 12, 0, tzinfo=dt.UTC),
    }
    claimed = get_procedure("wq_complete_many")
    upper = "0F8FAD5B-D9CB-469F-A165-70867728950E"
    assert driver.decode_row(claimed, (upper,)) == {"delivery_id": upper.lower()}
    assert driver.decode_row(claimed, (uuid.UUID(upper),)) == {"delivery_id": upper.lower()}


def test_every_uuid_result_column_is_declared_as_such():
    # decode_value lower-cases only columns typed uuid, so none may be typed text by mistake.
    ids = {"delivery_id", "message_id", "subscription_id", "topic_id", "head_delivery_id"}
    for procedure in PROCEDURES.values():
        for column in procedure.columns:
            if column.name in ids or column.name == "lease_token":
                assert column.type is ParamType.UUID, (procedure.name, column.name)


def test_stored_uuid_is_djangos_char32_form():
    assert stored_uuid("0F8FAD5B-D9CB-469F-A165-70867728950E") == "0f8fad5bd9cb469fa16570867728950e"
    assert stored_uuid(None) is None


# -- errors -----------------------------------------------------------------------------------

PYODBC_DUPLICATE_ROW = (
    "[23000] [Microsoft][ODBC Driver 18 for SQL Server][SQL Server]Cannot insert duplicate key "
    "row in object 'dbo.workqueue_delivery' with unique index 'wq_delivery_inflight_key_uq'. "
    "The duplicate key value is (0f8fad5bd9cb469fa16570867728950e, key-42). (2601) "
    "(SQLExecDirectW)"
)


def _wrapped(django_class: type[DatabaseError], cause: BaseException) -> DatabaseError:
    """A Django error the way django.db.utils.DatabaseErrorWrapper raises it."""
    error = django_class(*cause.args)
    error.__cause__ = cause
    return error


def _python_driver(cls: type, driver_error: str, message: str) -> BaseException:
    return cls(driver_error=driver_error, ddbc_error="[Microsoft][SQL Server]" + message)


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        pytest.param(
            _wrapped(IntegrityError, pyodbc.IntegrityError("23000", PYODBC_DUPLICATE_ROW)),
            UniqueViolationError,
            id="pyodbc-2601",
        ),
        pytest.param(
            _wrapped(
                IntegrityError,
                _python_driver(
                    mssql_python_errors.IntegrityError,
                    "Integrity constraint violation",
                    "Violation of PRIMARY KEY constraint 'PK__workqueu__3213E83F'. Cannot insert "
                    "duplicate key in object 'dbo.workqueue_message'. The duplicate key value is "
                    "(0f8fad5bd9cb469fa16570867728950e).",
                ),
            ),
            UniqueViolationError,
            id="mssql-python-2627",
        ),
        pytest.param(
            _wrapped(
                IntegrityError,
                _python_driver(
                    mssql_python_errors.IntegrityError,
                    "Integrity constraint violation",
                    "The INSERT statement conflicted with the FOREIGN KEY constraint "
                    '"workqueue_delivery_message_id_fk". The conflict occurred in database '
                    '"wq", table "dbo.workqueue_message", column \'id\'.',
                ),
            ),
            DriverError,
            id="foreign-key-547-is-not-unique",
        ),
        pytest.param(
            _wrapped(
                OperationalError,
                pyodbc.OperationalError(
                    "40001",
                    "[40001] [Microsoft][ODBC Driver 18 for SQL Server][SQL Server]Transaction "
                    "(Process ID 57) was deadlocked on lock resources with another process and "
                    "has been chosen as the deadlock victim. Rerun the transaction. (1205) "
                    "(SQLExecDirectW)",
                ),
            ),
            DeadlockError,
            id="pyodbc-1205",
        ),
        pytest.param(
            _wrapped(
                OperationalError,
                _python_driver(
                    mssql_python_errors.OperationalError,
                    "Serialization failure",
                    "Transaction (Process ID 61) was deadlocked on lock resources with another "
                    "process and has been chosen as the deadlock victim. Rerun the transaction.",
                ),
            ),
            DeadlockError,
            id="mssql-python-1205",
        ),
        pytest.param(
            _wrapped(
                OperationalError,
                pyodbc.OperationalError(
                    "42000",
                    "[42000] [Microsoft][ODBC Driver 18 for SQL Server][SQL Server]Snapshot "
                    "isolation transaction aborted due to update conflict. You cannot use "
                    "snapshot isolation to access table 'dbo.workqueue_delivery' directly or "
                    "indirectly in database 'wq' to update, delete, or insert the row that has "
                    "been modified or deleted by another transaction. Retry the transaction or "
                    "change the isolation level for the update/delete statement. (3960) "
                    "(SQLExecDirectW)",
                ),
            ),
            # An enlisted completion refused this way names the isolation level (executor).
            SerializationFailureError,
            id="pyodbc-3960",
        ),
        pytest.param(
            _wrapped(
                OperationalError,
                _python_driver(
                    mssql_python_errors.OperationalError,
                    "General error",
                    "Snapshot isolation transaction aborted due to update conflict.",
                ),
            ),
            SerializationFailureError,
            id="mssql-python-3960",
        ),
        pytest.param(
            _wrapped(
                OperationalError,
                _python_driver(
                    mssql_python_errors.OperationalError,
                    "General error",
                    "Lock request time out period exceeded.",
                ),
            ),
            LockTimeoutError,  # a TransientDriverError that operators report as a busy row
            id="mssql-python-1222",
        ),
        pytest.param(
            _wrapped(
                DatabaseError,
                _python_driver(
                    mssql_python_errors.ProgrammingError,
                    "Syntax error or access violation",
                    "wq_lock_publish_order: the ordered-publish lock was not granted within "
                    "5000 ms (error 51001); publish again.",
                ),
            ),
            TransientDriverError,
            id="mssql-python-51001",
        ),
        pytest.param(
            _wrapped(
                DatabaseError,
                pyodbc.ProgrammingError(
                    "42000",
                    "[42000] [Microsoft][ODBC Driver 18 for SQL Server][SQL Server]"
                    "wq_lock_publish_order: the ordered-publish lock was not granted within "
                    "5000 ms (error 51001); publish again. (51001) (SQLExecDirectW)",
                ),
            ),
            TransientDriverError,
            id="pyodbc-51001",
        ),
        pytest.param(
            _wrapped(
                OperationalError,
                pyodbc.OperationalError(
                    "42000",
                    "[42000] [Microsoft][ODBC Driver 18 for SQL Server][SQL Server]Could not "
                    "allocate space for object 'dbo.workqueue_delivery'.'PK_workqueue_delivery' "
                    "in database 'wq' because the 'PRIMARY' filegroup is full. (1105) "
                    "(SQLExecDirectW)",
                ),
            ),
            TransientDriverError,
            id="pyodbc-1105-full-filegroup",
        ),
        pytest.param(
            _wrapped(
                OperationalError,
                _python_driver(
                    mssql_python_errors.OperationalError,
                    "General error",
                    "The transaction log for database 'wq' is full due to 'LOG_BACKUP'.",
                ),
            ),
            TransientDriverError,
            id="mssql-python-9002-full-log",
        ),
        pytest.param(
            _wrapped(
                DatabaseError,
                _python_driver(
                    mssql_python_errors.ProgrammingError,
                    "Syntax error or access violation",
                    "wq_try_sweep_lock must run inside the transaction that holds the sweep "
                    "lock (error 51000).",
                ),
            ),
            DriverError,
            id="own-51000-is-not-transient",
        ),
        pytest.param(
            _wrapped(
                OperationalError,
                pyodbc.OperationalError("08S01", "[08S01] Communication link failure (10054)"),
            ),
            TransientDriverError,
            id="pyodbc-connection-lost",
        ),
        pytest.param(
            _wrapped(
                OperationalError,
                _python_driver(
                    mssql_python_errors.OperationalError,
                    "Communication link failure",
                    "TCP Provider: Error code 0x68 (104)",
                ),
            ),
            TransientDriverError,
            id="mssql-python-connection-lost",
        ),
        pytest.param(
            InterfaceError("connection already closed"),
            TransientDriverError,
            id="django-connection-closed",
        ),
        pytest.param(
            _wrapped(
                DatabaseError,
                pyodbc.ProgrammingError(
                    "42S02",
                    "[42S02] [Microsoft][ODBC Driver 18 for SQL Server][SQL Server]Could not "
                    "find stored procedure 'dbo.wq_claim'. (2812) (SQLExecDirectW)",
                ),
            ),
            DriverError,
            id="missing-procedure-2812",
        ),
        pytest.param(
            _wrapped(
                DatabaseError,
                pyodbc.ProgrammingError(
                    "42000",
                    "[42000] [Microsoft][ODBC Driver 18 for SQL Server][SQL Server]The EXECUTE "
                    "permission was denied on the object 'wq_complete_many'. (229) "
                    "(SQLExecDirectW)",
                ),
            ),
            PrivilegeRefusedError,
            id="permission-denied-229",
        ),
    ],
)
def test_sql_server_errors_map_to_the_apps_error_classes(driver, error, expected):
    translated = driver.translate_error(error)
    assert type(translated) is expected
    assert str(translated)


@pytest.mark.parametrize(
    ("message", "missing"),
    [
        ("Invalid object name 'dbo.workqueue_subscription'. (208)", True),
        ("Could not find stored procedure 'dbo.wq_publish'. (2812)", True),
        ("Invalid column name 'priority'. (207)", True),
        ("The EXECUTE permission was denied on the object 'wq_publish'. (229)", False),
    ],
    ids=["table-208", "procedure-2812", "column-207", "permission-229"],
)
def test_a_missing_table_or_procedure_is_told_from_other_errors(driver, message, missing):
    """What a database nobody migrated answers, which commands explain as `migrate` to run; a
    missing grant must not read as that. With either client library: mssql-python gives no
    error number, only the server's text (helper-116)."""
    from_pyodbc = pyodbc.ProgrammingError(
        "42S02",
        f"[42S02] [Microsoft][ODBC Driver 18 for SQL Server][SQL Server]{message} (SQLExecDirectW)",
    )
    text = message.rsplit(" (", 1)[0]
    from_mssql_python = _python_driver(
        mssql_python_errors.ProgrammingError, "Base table or view not found", text
    )
    for client_error in (from_pyodbc, from_mssql_python):
        error = _wrapped(DatabaseError, client_error)
        assert driver.names_a_missing_object(driver.translate_error(error)) is missing, error


def test_error_numbers_are_read_from_every_driver_style():
    assert error_number(pyodbc.IntegrityError("23000", PYODBC_DUPLICATE_ROW)) == 2601

    class PymssqlStyle(Exception):
        number = 1205

    assert error_number(PymssqlStyle("deadlock")) == 1205
    assert error_number(Exception(2627, b"Violation of UNIQUE KEY constraint")) == 2627
    # A number inside the duplicate key value is not mistaken for the error number.
    assert error_number(Exception("The duplicate key value is (12345).")) is None


def test_a_driver_call_raises_the_translated_error_with_the_cause_kept(driver, monkeypatch):
    cause = pyodbc.IntegrityError("23000", PYODBC_DUPLICATE_ROW)

    class _FailingCursor:
        def __enter__(self) -> _FailingCursor:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def execute(self, sql: str, params: Any) -> None:
            raise _wrapped(IntegrityError, cause)

    class _Connection:
        def cursor(self) -> _FailingCursor:
            return _FailingCursor()

    with pytest.raises(UniqueViolationError) as raised:
        driver.call("wq_complete", {"delivery_id": uuid.uuid4()}, connection=_Connection())
    assert raised.value.__cause__.__cause__ is cause


# -- installation, grants, test support --------------------------------------------------------


class _FakeConnection:
    """Records executed statements; answers the routine listing with ``routines``."""

    def __init__(self, routines: list[tuple[str, str]] | None = None) -> None:
        self.executed: list[tuple[str, Any]] = []
        self.routines = routines or []
        self._last = ""

    @contextmanager
    def cursor(self):
        yield self

    def execute(self, sql: str, params: Any = None) -> None:
        self.executed.append((sql, params))
        self._last = sql

    def fetchall(self) -> list[tuple[str, str]]:
        assert "sys.objects" in self._last
        return self.routines


def test_install_runs_every_batch_in_order_and_drops_only_stale_routines(driver):
    connection = _FakeConnection(
        [("wq_claim", "PROCEDURE"), ("wq_old_claim", "PROCEDURE"), ("wq_old_fn", "FUNCTION")]
    )
    driver.install_procedures(connection)
    executed = [sql for sql, _ in connection.executed]
    expected = [b for _name, text in load_procedures("sqlserver") for b in split_batches(text)]
    assert executed[: len(expected)] == expected
    assert all(not re.search(r"^\s*GO\s*$", b, re.M | re.I) for b in expected)
    assert "sys.objects" in executed[len(expected)]
    assert executed[len(expected) + 1 :] == [
        "DROP PROCEDURE dbo.[wq_old_claim]",
        "DROP FUNCTION dbo.[wq_old_fn]",
        STAMP_STATEMENT,  # last: the stamp of the files just run
    ]
    assert connection.executed[-1][1] == [driver.procedures_stamp] * 2


def test_install_declares_every_registered_procedure(driver):
    declared = declared_routines(text for _name, text in load_procedures("sqlserver"))
    assert set(PROCEDURES) <= declared
    assert {"wq_filter_matches", "wq_lock_publish_order"} <= declared


def test_each_batch_holds_one_object_and_no_stray_separators():
    for name, text in load_procedures("sqlserver"):
        for batch in split_batches(text):
            code = re.sub(r"--[^\n]*", "", batch)
            creates = re.findall(r"\bCREATE\s+(?:OR\s+ALTER|SEQUENCE)\b", code, re.I)
            assert len(creates) <= 1, f"{name}.sql has a batch with {len(creates)} objects"


def test_drop_removes_the_filter_guard_then_every_routine_and_the_sequence(driver):
    connection = _FakeConnection([("wq_claim", "PROCEDURE"), ("wq_filter_matches", "FUNCTION")])
    driver.drop_procedures(connection)
    executed = [sql for sql, _ in connection.executed]
    # The CHECK constraint uses wq_filter_problem, which SQL Server will not drop under it.
    assert executed[0] == (
        "IF OBJECT_ID(N'dbo.wq_sub_filter_valid', N'C') IS NOT NULL "
        "ALTER TABLE dbo.workqueue_subscription DROP CONSTRAINT wq_sub_filter_valid"
    )
    assert "sys.objects" in executed[1]
    assert executed[2:] == [
        "DROP PROCEDURE IF EXISTS dbo.[wq_claim]",
        "DROP FUNCTION IF EXISTS dbo.[wq_filter_matches]",
        "DROP SEQUENCE IF EXISTS dbo.wq_publish_ordinal_seq",
    ]


def test_runtime_and_operator_grants_split_the_procedures_and_deny_tokens_and_writes(driver):
    runtime = driver.grant_runtime_statements("work]er")
    operator = driver.grant_operator_statements("work]er")
    assert all(s.endswith(" TO [work]]er]") for s in runtime + operator)

    def executes(statements: list[str]) -> set[str]:
        return {s.split()[3] for s in statements if s.startswith("GRANT EXECUTE")}

    assert executes(runtime) == {
        f"dbo.{n}" for n, p in PROCEDURES.items() if p.grant is Grant.RUNTIME
    } | {"dbo.wq_backlog", "dbo.wq_queue_gauges"}  # read-only counts: a host's gauges
    assert executes(operator) == {
        f"dbo.{n}" for n, p in PROCEDURES.items() if p.grant is Grant.OPERATOR
    }
    assert "dbo.wq_replay" in executes(operator) and "dbo.wq_claim" in executes(runtime)
    for statements in (runtime, operator):
        denies = [s for s in statements if s.startswith("DENY")]
        assert "DENY SELECT ON dbo.workqueue_delivery (lease_token) TO [work]]er]" in denies
        # ALTER too, which creating a trigger takes: one would run inside the procedures.
        assert {
            s.split()[6] for s in denies if s.startswith("DENY INSERT, UPDATE, DELETE, ALTER")
        } == {
            "dbo.workqueue_message",
            "dbo.workqueue_delivery",
            "dbo.workqueue_deduplication",
            "dbo.workqueue_rate_limit_bucket",
            "dbo.workqueue_sweep_lock",
        }
        # A SELECT WITH (UPDLOCK) on it would hold the sweepers' lock.
        assert "DENY SELECT ON dbo.workqueue_sweep_lock TO [work]]er]" in denies
        writes = [s for s in statements if s.startswith("GRANT") and "INSERT" in s]
        written = ("hostrecord", "taskresult", "schedulerecord")
        assert all(any(f"dbo.workqueue_{t} " in s for t in written) for s in writes), writes
    assert "GRANT SELECT, INSERT, UPDATE, DELETE ON dbo.workqueue_hostrecord TO [work]]er]" in (
        runtime
    )
    assert "GRANT SELECT, INSERT, UPDATE, DELETE ON dbo.workqueue_taskresult TO [work]]er]" in (
        runtime
    )
    assert "GRANT SELECT ON dbo.workqueue_taskresult TO [work]]er]" in operator
    # Hosts' schedulers record the slots they publish; operators read the records.
    assert "GRANT SELECT, INSERT, UPDATE ON dbo.workqueue_schedulerecord TO [work]]er]" in runtime
    assert "GRANT SELECT ON dbo.workqueue_schedulerecord TO [work]]er]" in operator


def test_scaler_grants_read_the_topology_and_deliveries_only_and_no_lease_token(driver):
    statements = driver.grant_scaler_statements("keda")
    # After denying what no role but the owner may hold (review helper-173).
    assert not [s for s in statements if not s.startswith(("DENY", "GRANT SELECT ON"))]
    assert "DENY ALTER, REFERENCES ON dbo.workqueue_subscription TO [keda]" in statements
    assert "DENY INSERT, UPDATE, DELETE, ALTER ON dbo.workqueue_delivery TO [keda]" in statements
    assert [s for s in statements if "SELECT" in s] == [
        "GRANT SELECT ON dbo.workqueue_subscription TO [keda]",
        "GRANT SELECT ON dbo.workqueue_topic TO [keda]",
        "GRANT SELECT ON dbo.workqueue_transport TO [keda]",
        "GRANT SELECT ON dbo.workqueue_delivery TO [keda]",
        "DENY SELECT ON dbo.workqueue_delivery (lease_token) TO [keda]",
    ]


def test_scaler_query_caps_each_half_at_1000_reads_ready_once_and_returns_backlog(driver):
    # No SQL Server runs here, so the shape is checked instead: the PostgreSQL twin's values
    # are proved live in tests/integration/test_runtime_role.py.
    sql = driver.scaler_query("orders")
    *_, final = sql.split("\n)\n")
    assert sql.count("TOP (1000)") == 2  # the claimable rows and the InFlight rows
    assert final.count("FROM ready") == 1  # one evaluation of the unordered TOP
    assert re.fullmatch(r"SELECT \(SELECT [^;]*\) AS Backlog;\n", final, re.S)
    assert "1000" not in final.split("FROM ready")[0]  # the sum is not capped


def test_scaler_query_counts_nothing_claimable_under_a_disabled_topic_or_transport(driver):
    """It read the subscription's status alone, so an autoscaler started hosts for the work
    of a subscription whose topic or transport was Disabled, which none of them may claim."""
    sql = driver.scaler_query("orders")
    subscriptions = sql.split("), ready AS (")[0]

    assert "JOIN dbo.workqueue_topic t ON t.id = s.topic_id" in subscriptions
    assert "JOIN dbo.workqueue_transport tr ON tr.id = t.transport_id" in subscriptions
    assert re.search(
        r"CASE WHEN t\.status = N'Active' AND tr\.status = N'Active' THEN s\.status\s+"
        r"ELSE N'Paused' END AS status",
        subscriptions,
    )
    assert "WHERE s.status = 'Active'" in sql  # what the claimable half counts under


def test_grant_reindex_and_scaler_sql_parses(driver, tmp_path):
    script = tmp_path / "grants.sql"
    statements = (
        driver.grant_runtime_statements("runtime")
        + driver.grant_operator_statements("ops")
        + driver.grant_scaler_statements("k")
        + driver.rebuild_index_statements()
    )
    script.write_text(
        ";\n".join(statements)
        + ";\nGO\n"
        + driver.scaler_query("orders")
        + "\nGO\n"
        + driver.cancel_requested_sql.replace("%s", "'0123456789abcdef0123456789abcdef'")
    )
    result = parse_tsql(script)
    assert result.returncode == 0, result.stderr


def test_reindex_reorganizes_every_queue_table_online(driver):
    assert driver.rebuild_index_statements() == [
        "ALTER INDEX ALL ON dbo.workqueue_message REORGANIZE",
        "ALTER INDEX ALL ON dbo.workqueue_delivery REORGANIZE",
        "ALTER INDEX ALL ON dbo.workqueue_deduplication REORGANIZE",
    ]


def _capture_transaction(driver: SqlServerDriver, monkeypatch) -> _FakeConnection:
    connection = _FakeConnection()

    @contextmanager
    def transaction():
        yield connection

    monkeypatch.setattr(driver, "transaction", transaction)
    return connection


def test_shift_time_moves_timestamps_back_for_stored_ids(driver, monkeypatch, tmp_path):
    connection = _capture_transaction(driver, monkeypatch)
    topic = "0F8FAD5B-D9CB-469F-A165-70867728950E"
    driver.shift_time(90, topic_id=topic)
    assert len(connection.executed) == 3
    for sql, params in connection.executed:
        assert "DATEADD(second, -90," in sql
        assert sql.count("%s") == len(params)
        assert "0f8fad5bd9cb469fa16570867728950e" in params
    script = tmp_path / "shift.sql"
    script.write_text(";\n".join(sql.replace("%s", "NULL") for sql, _ in connection.executed))
    assert parse_tsql(script).returncode == 0


def test_remove_topic_deletes_children_before_the_topic(driver, monkeypatch, tmp_path):
    connection = _capture_transaction(driver, monkeypatch)
    driver.remove_topic("0f8fad5b-d9cb-469f-a165-70867728950e")
    tables = [re.search(r"DELETE FROM dbo\.(\w+)", sql).group(1) for sql, _ in connection.executed]
    assert tables == [
        "workqueue_delivery",
        "workqueue_delivery",
        "workqueue_message",
        "workqueue_deduplication",
        "workqueue_subscription",
        "workqueue_topic",
    ]
    assert all(params == ["0f8fad5bd9cb469fa16570867728950e"] for _, params in connection.executed)
    script = tmp_path / "remove.sql"
    script.write_text(";\n".join(sql.replace("%s", "NULL") for sql, _ in connection.executed))
    assert parse_tsql(script).returncode == 0


def test_sql_server_has_no_listen_notify(driver):
    assert driver.features.supports_listen_notify is False
    assert driver.features.binary_collation == "Latin1_General_100_BIN2"
    with pytest.raises(NotImplementedError):
        driver.open_listener()


# -- settings ---------------------------------------------------------------------------------


@pytest.mark.parametrize("use_tz", [False, True])
def test_check_refuses_sql_server_without_use_tz(settings, monkeypatch, use_tz):
    """Without USE_TZ, mssql-django creates DateTimeField as datetime2 (no offset): the
    procedures' SYSDATETIMEOFFSET() clock is stored as the server's local time and compared as
    UTC, so every lease looks expired at once on a server west of UTC."""
    import workqueue.driver
    from workqueue.checks import check_settings

    # The alias's vendor decides the driver class; no SQL Server alias can connect here.
    monkeypatch.setattr(workqueue.driver, "driver_class_for_alias", lambda alias: SqlServerDriver)
    settings.USE_TZ = use_tz

    found = [m for m in check_settings() if m.id == "workqueue.W007"]

    if use_tz:
        assert found == []
    else:
        (error,) = found
        assert "needs USE_TZ = True" in error.msg and "datetime2" in error.msg


def test_the_procedures_stamp_is_left_and_read_in_sql_that_parses(driver, tmp_path):
    script = tmp_path / "stamp.sql"
    script.write_text(
        STAMP_STATEMENT.replace("%s", "N'stamp'") + "GO\n" + driver.procedures_stamp_sql + ";\n"
    )
    assert STAMP_STATEMENT.count("%s") == 2
    assert parse_tsql(script).returncode == 0
    # The same files hash to the same stamp on every process of a release.
    assert driver.procedures_stamp == SqlServerDriver("another").procedures_stamp


def test_a_permission_refusal_from_mssql_python_is_a_privilege_refusal(driver):
    error = _wrapped(
        DatabaseError,
        _python_driver(
            mssql_python_errors.ProgrammingError,
            "Syntax error or access violation",
            "The EXECUTE permission was denied on the object 'wq_complete_many', database "
            "'wq', schema 'dbo'.",
        ),
    )
    assert isinstance(driver.translate_error(error), PrivilegeRefusedError)


def test_restricting_advisory_locks_on_sql_server_says_what_to_do_instead(monkeypatch):
    """SQL Server's locks are application locks on principal public: the command restricts
    PostgreSQL's advisory locks only, and says so rather than printing nothing useful."""
    from django.core.management import call_command
    from django.core.management.base import CommandError

    import workqueue.driver

    monkeypatch.setattr(workqueue.driver, "_drivers", {"default": SqlServerDriver("default")})
    with pytest.raises(CommandError, match="Keep logins that are not the work queue's out"):
        call_command("workqueue", "restrict-advisory-locks", "--print")
