"""Parity of the procedure contract across the registry, PostgreSQL and SQL Server.

Reads ``workqueue/sql/postgresql/*.sql``, ``workqueue/sql/sqlserver/*.sql`` and
``workqueue.driver.procedures.PROCEDURES`` and fails on any difference in procedure names,
parameter names and order, parameter types, result column names and order, or the file a
procedure lives in.

How each side declares its contract:

* Registry: ``Procedure(name, params, columns, ...)``.
* PostgreSQL: ``CREATE OR REPLACE FUNCTION name(p_a type, ...) RETURNS TABLE (col type, ...)``;
  parameter names lose their ``p_`` prefix.
* SQL Server: ``CREATE OR ALTER PROCEDURE dbo.name @a type, ... AS`` (or ``CREATE OR ALTER
  FUNCTION dbo.name(@a type, ...)``). A procedure that returns rows declares its columns twice:
  on a ``-- returns: col, col`` line of the comment header right above it, and in the one
  statement that produces its result set, which is preceded by a line holding only
  ``-- result set``. The columns of that statement's outer SELECT list are its aliases (or the
  column name of an unaliased ``alias.column``). The test requires the header, the SELECT and the
  registry to agree, and exactly one ``-- result set`` per registered procedure.

Functions or procedures that are not in the registry are internal helpers. A helper must exist
on both vendors with the same parameter names, unless it is listed in ``VENDOR_ONLY_HELPERS``
with the reason it has no twin.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from workqueue.conf import MAX_CLAIM_ROWS
from workqueue.driver.postgresql import ANNOUNCE_COLUMNS
from workqueue.driver.procedures import PROCEDURES, ParamType, Procedure
from workqueue.sql import INSTALL_ORDER

SQL_ROOT = Path(__file__).resolve().parents[2] / "workqueue" / "sql"

VENDOR_ONLY_HELPERS = {
    "postgresql": {
        "wq_topic_channel": "LISTEN/NOTIFY channel name; SQL Server has no NOTIFY (consumers poll)",
        "wq_guard_subscription_delete": "a trigger function; the T-SQL guard is the trigger "
        "wq_subscription_delete_guard itself (see test_both_vendors_guard_topology_deletes)",
        "wq_guard_topic_delete": "a trigger function; the T-SQL guard is the trigger "
        "wq_topic_delete_guard itself",
        "wq_guard_subscription_mode": "a trigger function; the T-SQL guard is the trigger "
        "wq_subscription_mode_guard itself",
        "wq_guard_ordered_subscription": "a trigger function; the T-SQL guard is the trigger "
        "wq_subscription_ordered_guard itself",
        "wq_new_id": "time-ordered (version 7) ids for the rows the procedures create; the T-SQL "
        "keeps NEWID() until a SQL Server can test a version 7 id built in T-SQL",
        "wq_id_clock": "the time part of a batch's delivery ids (with wq_id_random and "
        "wq_id_at: consecutive ids from one random start); the T-SQL keeps NEWID()",
        "wq_id_random": "the random start of a batch's delivery ids (see wq_id_clock)",
        "wq_id_at": "a batch's n-th delivery id (see wq_id_clock)",
        "wq_envelope_text_bytes": "the envelope's size as jsonb writes it, for the publish "
        "procedures' size guard; the T-SQL wq_publish_one counts its stored text inline",
        "wq_publish_items": "wq_publish_many's per-item checks as rows, for its set-based "
        "INSERTs; the T-SQL wq_publish_many runs wq_publish_one per item instead",
        "wq_wait_for_topology": "the publish procedures' bounded wait for a held topology "
        "lock (a function with its own lock_timeout); T-SQL's sp_getapplock takes @LockTimeout "
        "in the call itself",
        "wq_settle_expired_leases": "takes a uuid[] of rows its callers locked; T-SQL has no "
        "array parameters and a set-returning procedure cannot be shared through nested INSERT "
        "... EXEC, so each T-SQL caller selects (UPDLOCK, READPAST) and settles in one statement",
    },
    "sqlserver": {
        "wq_publish_one": "wq_publish's body with OUTPUT parameters, so wq_publish_many can run "
        "it per item without INSERT ... EXEC; PL/pgSQL can select from a function instead",
        "wq_uuid_text": "UUIDs are stored as char(32) hex on SQL Server; PostgreSQL has uuid",
        "wq_text_uuid": "UUIDs are stored as char(32) hex on SQL Server; PostgreSQL has uuid",
    },
}

#: Result columns a vendor returns after the registry's, which only that vendor's driver reads:
#: what a PostgreSQL publish asks its caller to NOTIFY once it has committed (SQL Server has no
#: NOTIFY, and its previous release's processes would fail on result sets wider than theirs).
VENDOR_ONLY_COLUMNS = {
    "postgresql": {"wq_publish": ANNOUNCE_COLUMNS, "wq_publish_many": ANNOUNCE_COLUMNS},
}

PG_TYPES = {
    ParamType.UUID: {"uuid"},
    ParamType.TEXT: {"text"},
    ParamType.INT: {"integer"},
    ParamType.BOOL: {"boolean"},
    ParamType.JSON: {"jsonb"},
    ParamType.TIMESTAMP: {"timestamptz"},
}
TSQL_TYPES = {
    ParamType.UUID: {"uniqueidentifier"},
    ParamType.TEXT: {"nvarchar(4000)", "nvarchar(max)"},
    ParamType.INT: {"int"},
    ParamType.BOOL: {"bit"},
    ParamType.JSON: {"nvarchar(max)"},
    ParamType.TIMESTAMP: {"datetimeoffset", "datetimeoffset(7)"},
}


@dataclass(frozen=True)
class Routine:
    """One procedure or function as a vendor's SQL file declares it."""

    name: str
    file: str
    params: tuple[str, ...]
    param_types: tuple[str, ...]
    # Result columns; None for a routine that returns no rows (or a scalar).
    columns: tuple[str, ...] | None
    # SQL Server only: the columns of each statement marked "-- result set".
    result_sets: tuple[tuple[str, ...], ...] = ()


# -- scanning helpers -------------------------------------------------------------------------


def _scan(sql: str) -> tuple[str, str]:
    """Return ``sql`` with comments blanked, and with comments and string contents blanked.

    One left-to-right pass, so an apostrophe inside a comment or "--" inside a string cannot
    confuse it. Every offset is kept (blanked characters become spaces; newlines stay).
    """
    code, masked = list(sql), list(sql)
    i, n = 0, len(sql)
    while i < n:
        if sql.startswith("--", i):
            end = sql.find("\n", i)
            end = n if end == -1 else end
        elif sql.startswith("/*", i):
            end = sql.find("*/", i + 2)
            end = n if end == -1 else end + 2
        elif sql[i] == "'":
            end = i + 1
            while end < n:
                if sql[end] == "'" and sql.startswith("''", end):
                    end += 2
                elif sql[end] == "'":
                    break
                else:
                    end += 1
            for j in range(i + 1, min(end, n)):
                if masked[j] != "\n":
                    masked[j] = " "
            i = end + 1
            continue
        else:
            i += 1
            continue
        for j in range(i, end):
            if code[j] != "\n":
                code[j] = masked[j] = " "
        i = end
    return "".join(code), "".join(masked)


def _strip_comments(sql: str) -> str:
    return _scan(sql)[0]


def _blank_strings(sql: str) -> str:
    """Blank comments and the inside of string literals, keeping every offset."""
    return _scan(sql)[1]


def _split_top_level(text: str, separator: str = ",") -> list[str]:
    """Split on ``separator`` outside parentheses and string literals."""
    masked = _blank_strings(text)
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(masked):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == separator and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _matching_paren(text: str, open_index: int) -> int:
    masked = _blank_strings(text)
    depth = 0
    for i in range(open_index, len(masked)):
        if masked[i] == "(":
            depth += 1
        elif masked[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError("unbalanced parentheses")


def _normalise_type(text: str) -> str:
    return re.sub(r"\s+", "", text).lower()


# -- PostgreSQL -------------------------------------------------------------------------------

_PG_FUNCTION = re.compile(r"\bCREATE\s+OR\s+REPLACE\s+FUNCTION\s+(\w+)\s*\(", re.IGNORECASE)


def parse_postgresql(files: Mapping[str, str]) -> dict[str, list[Routine]]:
    routines: dict[str, list[Routine]] = {}
    for file, raw in files.items():
        sql = _strip_comments(raw)
        for match in _PG_FUNCTION.finditer(sql):
            name = match.group(1).lower()
            close = _matching_paren(sql, match.end() - 1)
            params, types = [], []
            for item in _split_top_level(sql[match.end() : close]):
                param_name, _, param_type = item.partition(" ")
                # A default (DEFAULT NULL) is not part of the type.
                param_type = re.split(r"\s+DEFAULT\s+", param_type, flags=re.IGNORECASE)[0]
                params.append(param_name.removeprefix("p_"))
                types.append(_normalise_type(param_type))
            rest = sql[close + 1 :]
            columns = None
            returns = re.match(r"\s*RETURNS\s+TABLE\s*\(", rest, re.IGNORECASE)
            if returns:
                open_index = close + 1 + returns.end() - 1
                table_close = _matching_paren(sql, open_index)
                columns = tuple(
                    item.split()[0].lower()
                    for item in _split_top_level(sql[open_index + 1 : table_close])
                )
            routine = Routine(name, file, tuple(params), tuple(types), columns)
            routines.setdefault(name, []).append(routine)
    return routines


# -- SQL Server -------------------------------------------------------------------------------

_TSQL_ROUTINE = re.compile(
    r"\bCREATE\s+OR\s+ALTER\s+(PROCEDURE|PROC|FUNCTION)\s+(?:\[?dbo\]?\.)?\[?(\w+)\]?",
    re.IGNORECASE,
)
_TSQL_PARAM = re.compile(r"@(\w+)\s+([\w]+(?:\s*\(\s*(?:\d+|max)\s*(?:,\s*\d+\s*)?\))?)", re.I)
_GO = re.compile(r"^[ \t]*GO[ \t]*$", re.IGNORECASE | re.MULTILINE)


def _header_returns(raw: str, start: int) -> tuple[str, ...] | None:
    """Columns of the "-- returns:" line in the comment block right above ``start``."""
    lines = raw[:start].rstrip("\n").split("\n")
    header = []
    for line in reversed(lines):
        if not line.strip().startswith("--"):
            break
        header.append(line.strip())
    for line in header:
        found = re.match(r"--\s*returns:\s*(.*)$", line, re.IGNORECASE)
        if found:
            return tuple(c.strip().lower() for c in found.group(1).split(",") if c.strip())
    return None


def select_list_names(statement: str) -> tuple[str, ...]:
    """Output column names of the outer SELECT of ``statement`` (comments already blanked)."""
    masked = _blank_strings(statement)
    select = re.search(r"\bSELECT\b", masked, re.IGNORECASE)
    if select is None:
        raise ValueError("no SELECT after the '-- result set' marker")
    body_start = select.end()
    head = re.match(r"\s*(DISTINCT\s+)?(TOP\s*\()?", masked[body_start:], re.IGNORECASE)
    if head and head.group(2):
        body_start = _matching_paren(statement, body_start + head.end() - 1) + 1
    elif head and head.group(1):
        body_start += head.end()
    depth, end = 0, len(statement)
    for match in re.finditer(r"\(|\)|\bFROM\b|;", masked[body_start:], re.IGNORECASE):
        token = match.group(0)
        if token == "(":
            depth += 1
        elif token == ")":
            depth -= 1
        elif depth == 0:
            end = body_start + match.start()
            break
    names = []
    for item in _split_top_level(statement[body_start:end]):
        item_masked = _blank_strings(item)
        alias = None
        depth = 0
        for match in re.finditer(r"\(|\)|\bAS\s+\[?(\w+)\]?\s*$", item_masked, re.IGNORECASE):
            if match.group(0) == "(":
                depth += 1
            elif match.group(0) == ")":
                depth -= 1
            elif depth == 0:
                alias = match.group(1)
        if alias is None:
            bare = re.fullmatch(r"(?:\w+\.)?\[?(\w+)\]?", item.strip())
            if bare is None:
                raise ValueError(f"result column without a name: {item.strip()!r}")
            alias = bare.group(1)
        names.append(alias.lower())
    return tuple(names)


def parse_sqlserver(files: Mapping[str, str]) -> dict[str, list[Routine]]:
    routines: dict[str, list[Routine]] = {}
    for file, raw in files.items():
        sql = _strip_comments(raw)
        for match in _TSQL_ROUTINE.finditer(sql):
            kind, name = match.group(1).upper(), match.group(2).lower()
            after = sql[match.end() :]
            if kind == "FUNCTION":
                open_index = match.end() + after.index("(")
                signature = sql[open_index + 1 : _matching_paren(sql, open_index)]
            else:
                as_line = re.search(r"^\s*AS\s*$", after, re.MULTILINE | re.IGNORECASE)
                signature = after[: as_line.start()] if as_line else ""
            found = _TSQL_PARAM.findall(signature)
            go = _GO.search(raw, match.end())
            body_raw = raw[match.end() : go.start() if go else len(raw)]
            result_sets = []
            for marker in re.finditer(r"^[ \t]*--[ \t]*result set[ \t]*$", body_raw, re.M | re.I):
                statement = _strip_comments(body_raw[marker.end() :])
                result_sets.append(select_list_names(statement))
            routine = Routine(
                name,
                file,
                tuple(p.lower() for p, _ in found),
                tuple(_normalise_type(t) for _, t in found),
                _header_returns(raw, match.start()),
                tuple(result_sets),
            )
            routines.setdefault(name, []).append(routine)
    return routines


# -- comparison -------------------------------------------------------------------------------


def read_vendor(root: Path, vendor: str) -> dict[str, str]:
    return {name: (root / vendor / f"{name}.sql").read_text("utf-8") for name in INSTALL_ORDER}


def contract_differences(
    registry: Mapping[str, Procedure],
    pg_files: Mapping[str, str],
    tsql_files: Mapping[str, str],
) -> list[str]:
    """Every way the two vendors' SQL and the registry disagree, as readable sentences."""
    problems: list[str] = []
    vendors = {"postgresql": parse_postgresql(pg_files), "sqlserver": parse_sqlserver(tsql_files)}
    single: dict[str, dict[str, Routine]] = {}
    for vendor, found in vendors.items():
        single[vendor] = {}
        for name, routines in found.items():
            if len(routines) > 1:
                problems.append(f"{vendor}: {name} is declared {len(routines)} times")
            single[vendor][name] = routines[0]

    for name, procedure in registry.items():
        expected_params = procedure.param_names
        expected_columns = procedure.column_names
        for vendor, routines in single.items():
            routine = routines.get(name)
            if routine is None:
                problems.append(f"{vendor}: {name} is in the registry but not in the SQL files")
                continue
            if routine.params != expected_params:
                problems.append(
                    f"{vendor}: {name} parameters {list(routine.params)} differ from the "
                    f"registry's {list(expected_params)}"
                )
            else:
                allowed = PG_TYPES if vendor == "postgresql" else TSQL_TYPES
                for param, declared in zip(procedure.params, routine.param_types, strict=True):
                    if declared not in allowed[param.type]:
                        problems.append(
                            f"{vendor}: {name} parameter {param.name} is {declared}, expected "
                            f"one of {sorted(allowed[param.type])} for {param.type.value}"
                        )
            returned = expected_columns + VENDOR_ONLY_COLUMNS.get(vendor, {}).get(name, ())
            if routine.columns != returned:
                where = "RETURNS TABLE" if vendor == "postgresql" else "'-- returns:' header"
                problems.append(
                    f"{vendor}: {name} {where} columns {list(routine.columns or ())} differ from "
                    f"the registry's {list(returned)}"
                )
            if vendor == "sqlserver":
                if len(routine.result_sets) != 1:
                    problems.append(
                        f"sqlserver: {name} has {len(routine.result_sets)} '-- result set' "
                        "statements; exactly one is required"
                    )
                for columns in routine.result_sets:
                    if columns != expected_columns:
                        problems.append(
                            f"sqlserver: {name} result set columns {list(columns)} differ from "
                            f"the registry's {list(expected_columns)}"
                        )
        if name in single["postgresql"] and name in single["sqlserver"]:
            pg_file, tsql_file = single["postgresql"][name].file, single["sqlserver"][name].file
            if pg_file != tsql_file:
                problems.append(
                    f"{name} lives in {pg_file}.sql on PostgreSQL, {tsql_file}.sql on SQL Server"
                )

    helpers = {
        vendor: {n: r for n, r in routines.items() if n not in registry}
        for vendor, routines in single.items()
    }
    for vendor, other in (("postgresql", "sqlserver"), ("sqlserver", "postgresql")):
        for name, routine in helpers[vendor].items():
            if name in VENDOR_ONLY_HELPERS[vendor]:
                if name in helpers[other]:
                    problems.append(f"{name} is listed as {vendor}-only but exists on {other}")
                continue
            twin = helpers[other].get(name)
            if twin is None:
                problems.append(f"{vendor}: helper {name} has no {other} twin")
            elif vendor == "postgresql" and twin.params != routine.params:
                problems.append(
                    f"helper {name} parameters differ: postgresql {list(routine.params)}, "
                    f"sqlserver {list(twin.params)}"
                )
        for name in VENDOR_ONLY_HELPERS[vendor]:
            if name not in helpers[vendor]:
                problems.append(f"{vendor}: {name} is listed as a {vendor}-only helper but missing")
    return problems


# -- tests ------------------------------------------------------------------------------------


def test_both_vendors_declare_the_registry_contract_exactly():
    problems = contract_differences(
        PROCEDURES, read_vendor(SQL_ROOT, "postgresql"), read_vendor(SQL_ROOT, "sqlserver")
    )
    assert problems == [], "\n".join(problems)


def test_every_vendor_folder_holds_exactly_the_install_order_files():
    for vendor in ("postgresql", "sqlserver"):
        names = sorted(p.stem for p in (SQL_ROOT / vendor).glob("*.sql"))
        assert names == sorted(INSTALL_ORDER), vendor


def test_parsers_see_every_registered_procedure_with_its_columns():
    # Guards the parsers themselves: an empty parse would make the comparison vacuous.
    pg = parse_postgresql(read_vendor(SQL_ROOT, "postgresql"))
    tsql = parse_sqlserver(read_vendor(SQL_ROOT, "sqlserver"))
    assert set(PROCEDURES) <= set(pg)
    assert set(PROCEDURES) <= set(tsql)
    assert tsql["wq_claim"][0].result_sets[0][:3] == ("kind", "delivery_id", "lease_token")
    assert pg["wq_publish"][0].params[0] == "topic_name"
    assert tsql["wq_filter_matches"][0].params == ("filter", "attributes")


def _copy_sql(tmp_path: Path) -> Path:
    shutil.copytree(SQL_ROOT / "postgresql", tmp_path / "postgresql")
    shutil.copytree(SQL_ROOT / "sqlserver", tmp_path / "sqlserver")
    return tmp_path


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text("utf-8")
    assert text.count(old) >= 1, f"{old!r} not in {path.name}"
    path.write_text(text.replace(old, new), "utf-8")


def _differences(root: Path) -> list[str]:
    return contract_differences(
        PROCEDURES, read_vendor(root, "postgresql"), read_vendor(root, "sqlserver")
    )


def test_parity_check_reports_a_renamed_tsql_parameter(tmp_path):
    root = _copy_sql(tmp_path)
    _edit(root / "sqlserver" / "claim.sql", "@lease_owner", "@lease_holder")
    problems = _differences(root)
    assert any("sqlserver: wq_claim parameters" in p and "lease_holder" in p for p in problems), (
        problems
    )


def test_parity_check_reports_a_renamed_postgresql_parameter(tmp_path):
    root = _copy_sql(tmp_path)
    _edit(root / "postgresql" / "settle.sql", "p_delay_seconds", "p_delay")
    problems = _differences(root)
    assert any("postgresql: wq_retry parameters" in p for p in problems), problems


def test_parity_check_reports_reordered_parameters(tmp_path):
    root = _copy_sql(tmp_path)
    _edit(
        root / "sqlserver" / "lease.sql",
        "    @delivery_id uniqueidentifier,\n    @lease_token uniqueidentifier,",
        "    @lease_token uniqueidentifier,\n    @delivery_id uniqueidentifier,",
    )
    problems = _differences(root)
    assert any("sqlserver: wq_extend_lease parameters" in p for p in problems), problems


def test_parity_check_reports_a_renamed_result_column(tmp_path):
    root = _copy_sql(tmp_path)
    _edit(root / "sqlserver" / "lease.sql", "@expires AS lease_expires_at", "@expires AS expires")
    problems = _differences(root)
    assert any("wq_extend_lease result set columns" in p for p in problems), problems


def test_parity_check_reports_a_header_that_disagrees_with_the_registry(tmp_path):
    root = _copy_sql(tmp_path)
    _edit(root / "sqlserver" / "sweeper.sql", "-- returns: acquired", "-- returns: granted")
    problems = _differences(root)
    assert any("wq_try_sweep_lock '-- returns:' header" in p for p in problems), problems


def test_parity_check_reports_a_missing_procedure_and_a_lonely_helper(tmp_path):
    root = _copy_sql(tmp_path)
    _edit(root / "sqlserver" / "settle.sql", "dbo.wq_release\n", "dbo.wq_release_it\n")
    problems = _differences(root)
    assert any("sqlserver: wq_release is in the registry" in p for p in problems), problems
    assert any("helper wq_release_it has no postgresql twin" in p for p in problems), problems


def test_parity_check_reports_a_wrong_parameter_type(tmp_path):
    root = _copy_sql(tmp_path)
    _edit(root / "sqlserver" / "settle.sql", "@delay_seconds int", "@delay_seconds bigint")
    problems = _differences(root)
    assert any("wq_retry parameter delay_seconds is bigint" in p for p in problems), problems


@pytest.mark.parametrize(
    ("statement", "names"),
    [
        ("SELECT COUNT(*) AS affected_rows FROM @changed;", ("affected_rows",)),
        ("SELECT TOP (@limit) d.id, CAST(x AS bit) AS flag, [y] FROM t;", ("id", "flag", "y")),
        ("SELECT @a AS one, N'x, FROM y' AS two;", ("one", "two")),
        ("SELECT (SELECT 1 FROM t AS q) AS nested, r.c\n  FROM r ORDER BY r.c;", ("nested", "c")),
    ],
)
def test_select_list_names_reads_aliases_and_bare_columns(statement, names):
    assert select_list_names(statement) == names


def test_select_list_names_rejects_an_unnamed_expression():
    with pytest.raises(ValueError, match="without a name"):
        select_list_names("SELECT COUNT(*) FROM t;")


def test_both_vendors_guard_topology_deletes():
    # The queue tables hold no foreign keys to topics and subscriptions (migration 0025): on
    # each vendor a trigger refuses to delete one that rows still refer to.
    for vendor, pattern in (
        ("postgresql", r"CREATE TRIGGER {name}\s+BEFORE DELETE ON {table}\s"),
        ("sqlserver", r"CREATE OR ALTER TRIGGER dbo\.{name}\s+ON dbo\.{table}\s+AFTER DELETE"),
    ):
        text = (SQL_ROOT / vendor / "publish.sql").read_text()
        for name, table in (
            ("wq_subscription_delete_guard", "workqueue_subscription"),
            ("wq_topic_delete_guard", "workqueue_topic"),
        ):
            assert re.search(pattern.format(name=name, table=table), text), (vendor, name)
    # Checked as text (no SQL Server here): like the foreign keys they replace, the T-SQL
    # guards are off while their table's foreign keys are (mssql-django's flush sets NOCHECK,
    # then deletes tables in no particular order, for TransactionTestCase).
    tsql = (SQL_ROOT / "sqlserver" / "publish.sql").read_text()
    for table in ("workqueue_subscription", "workqueue_topic"):
        assert f"OBJECT_ID(N'dbo.{table}') AND is_disabled = 1)\n        RETURN;" in tsql, table


def test_both_vendors_guard_a_partition_mode_change_under_deliveries():
    # Review helper-173: the rule lived in the model only. Proved live on PostgreSQL by
    # tests/integration/test_grants_after_broad_grants.py; the T-SQL twin is checked as text.
    postgresql = (SQL_ROOT / "postgresql" / "publish.sql").read_text()
    assert re.search(
        r"CREATE TRIGGER wq_subscription_mode_guard\s+BEFORE UPDATE OF partition_mode ON "
        r"workqueue_subscription\s",
        postgresql,
    )
    tsql = (SQL_ROOT / "sqlserver" / "publish.sql").read_text()
    assert re.search(
        r"CREATE OR ALTER TRIGGER dbo\.wq_subscription_mode_guard\s+ON dbo\.workqueue_subscription"
        r"\s+AFTER UPDATE",
        tsql,
    )
    assert "JOIN dbo.workqueue_delivery d ON d.subscription_id = i.id" in tsql


def test_both_vendors_lock_the_topology_when_a_subscription_becomes_ordered_and_enabled():
    # Review helper-179: only a change of mode took the lock in the database. Proved live on
    # PostgreSQL by tests/integration/test_ordered_publish_locks.py; T-SQL checked as text.
    postgresql = (SQL_ROOT / "postgresql" / "publish.sql").read_text()
    assert re.search(
        r"CREATE TRIGGER wq_subscription_ordered_insert_guard\s+BEFORE INSERT ON "
        r"workqueue_subscription\s",
        postgresql,
    )
    assert re.search(
        r"CREATE TRIGGER wq_subscription_ordered_update_guard\s+BEFORE UPDATE OF status, "
        r"filter, topic_id ON workqueue_subscription\s",
        postgresql,
    )
    tsql = (SQL_ROOT / "sqlserver" / "publish.sql").read_text()
    assert re.search(
        r"CREATE OR ALTER TRIGGER dbo\.wq_subscription_ordered_guard\s+ON "
        r"dbo\.workqueue_subscription\s+AFTER INSERT, UPDATE",
        tsql,
    )


def test_both_vendors_refuse_a_partition_key_stored_as_another():
    # Review helper-179: the application refused these keys; a caller of the procedures did not.
    for text in (
        _postgresql_function("publish", "wq_publish"),
        _postgresql_function("publish", "wq_publish_items"),
    ):
        assert "LIKE '% '" in text and "> 200" in text and "'InvalidPartitionKey'" in text
    tsql = _tsql_procedure("publish", "wq_publish_one")
    assert "DATALENGTH(@partition_key) > 400" in tsql and "@partition_key LIKE N'% '" in tsql
    assert "SET @out_error_code = N'InvalidPartitionKey';" in tsql


def test_the_sqlserver_progress_cap_counts_what_is_stored():
    """Review helper-174: LEN() leaves out trailing spaces, and N'{}' followed by 8,000,000 of
    them is valid JSON of LEN 2, stored whole. DATALENGTH counts every byte (two a character)."""
    tsql = (SQL_ROOT / "sqlserver" / "lease.sql").read_text()
    assert "LEN(@progress)" not in tsql
    assert "CASE WHEN DATALENGTH(@progress) > 32000" in tsql


def _postgresql_function(file: str, name: str) -> str:
    text = (SQL_ROOT / "postgresql" / f"{file}.sql").read_text()
    start = text.index(f"CREATE OR REPLACE FUNCTION {name}(")
    return text[start : text.index("\n$$;", start)]


def _tsql_procedure(file: str, name: str) -> str:
    from workqueue.driver.sqlserver import split_batches

    text = (SQL_ROOT / "sqlserver" / f"{file}.sql").read_text()
    [batch] = [b for b in split_batches(text) if f"CREATE OR ALTER PROCEDURE dbo.{name}\n" in b]
    return _strip_comments(batch)


def test_both_vendors_clamp_a_claims_row_count_to_the_claim_cap():
    """Review helper-176: the claim took any count (100,000 deliveries in one transaction; on
    PostgreSQL NULL looped for ever). Proved live on PostgreSQL by
    tests/integration/test_procedures_bound_their_input.py; the T-SQL twin is checked as text,
    the clamp before the first use of @max_rows (DECLARE ... = runs in order)."""
    postgresql = _postgresql_function("claim", "wq_claim")
    body = postgresql[postgresql.index("AS $$") :]
    clamp = f"v_max_rows integer := LEAST(GREATEST(coalesce(p_max_rows, 0), 0), {MAX_CLAIM_ROWS});"
    assert clamp in body
    assert body.count("p_max_rows") == 1  # only the clamp reads it
    tsql = _tsql_procedure("claim", "wq_claim")
    clamp = (
        "SET @max_rows = CASE WHEN @max_rows IS NULL OR @max_rows < 0 THEN 0\n"
        f"                         WHEN @max_rows > {MAX_CLAIM_ROWS} THEN {MAX_CLAIM_ROWS} "
        "ELSE @max_rows END;"
    )
    assert clamp in tsql
    body = tsql[tsql.index("\nAS\n") :]
    assert body.index(clamp) < body.replace(clamp, "", 1).index("@max_rows")


@pytest.mark.parametrize("name", ["wq_retire_discard", "wq_retire_purge"])
def test_both_vendors_clamp_a_retirement_batch_from_above(name):
    # Review helper-176: clamped from below only, one call changed every row of a subscription.
    assert "LIMIT LEAST(GREATEST(coalesce(p_batch_size, 1000), 1), 5000)" in _postgresql_function(
        "operator", name
    )
    assert (
        "DECLARE @limit int = CASE WHEN @batch_size IS NULL THEN 1000\n"
        "                              WHEN @batch_size > 5000 THEN 5000\n"
        "                              WHEN @batch_size < 1 THEN 1 ELSE @batch_size END;"
        in _tsql_procedure("operator", name)
    )


def test_both_vendors_count_locked_rows_a_bulk_discard_batch_walks():
    """Review helper-176: the walk itself skipped locked rows (SKIP LOCKED, READPAST) uncounted
    and read on past any number of them. It now walks its batch unlocked and locks what it
    walked, skipping what others hold; examined counts the walk. A dry run locks nothing
    (review helper-183: a real run beside it skipped what the dry run held). Proved live on
    PostgreSQL by tests/integration/test_procedures_bound_their_input.py and
    tests/integration/test_bulk_recovery.py; the T-SQL twin is checked as text."""
    postgresql = _strip_comments(_postgresql_function("operator", "wq_discard_pending"))
    assert postgresql.count("FOR UPDATE SKIP LOCKED") == 1
    assert "WHERE x.ctid = w.row_at AND x.status = 'Pending'\n" in postgresql
    assert "CASE WHEN p_dry_run THEN '' ELSE 'FOR UPDATE SKIP LOCKED' END" in postgresql
    tsql = _tsql_procedure("operator", "wq_discard_pending")
    walk = tsql[tsql.index("INSERT INTO @walked") : tsql.index("IF @dry_run = 1")]
    assert "WITH (" not in walk and "SELECT TOP (@limit)" in walk
    dry_run, real_run = tsql[tsql.index("IF @dry_run = 1") :].split("ELSE", 1)
    assert "WITH (" not in dry_run and "FROM @walked WHERE matches = 1" in dry_run
    assert (
        "FROM @walked AS w\n"
        "          JOIN dbo.workqueue_delivery AS d WITH (UPDLOCK, ROWLOCK, READPAST)\n"
        "            ON d.id = w.id AND w.matches = 1"
    ) in real_run
    assert "SELECT (SELECT COUNT(*) FROM @walked) AS examined," in tsql
