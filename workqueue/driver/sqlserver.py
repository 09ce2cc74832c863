"""SQL Server: T-SQL procedures called with EXEC and named parameters, error-number mapping.

Works with mssql-django over either of its drivers (mssql-python or pyodbc). Procedures take and
return ``uniqueidentifier`` values; the tables keep Django's char(32) form and the procedures
convert at the edge, so callers only ever see canonical lower-case UUID strings.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable
from typing import Any

from django.conf import settings
from django.db import DatabaseError, InterfaceError
from django.db.backends.base.base import BaseDatabaseWrapper

from workqueue.driver.base import (
    API_KEY_TABLE,
    LEASE_TOKEN_COLUMN,
    PRIVILEGE_REFUSED_HINT,
    PROCEDURE_WRITTEN_TABLES,
    QUEUE_TABLES,
    READ_TABLES,
    RUNTIME_READABLE_COUNTS,
    SCHEDULE_RECORD_TABLE,
    SWEEP_LOCK_TABLE,
    TASK_RESULT_TABLE,
    BaseDriver,
    DriverFeatures,
    QueueTableSize,
    VacuumHorizon,
    app_tables,
    error_chain,
)
from workqueue.driver.procedures import Grant, Param, ParamType, Procedure, granted_to
from workqueue.exceptions import (
    DeadlockError,
    DriverError,
    LockTimeoutError,
    PrivilegeRefusedError,
    SerializationFailureError,
    TransientDriverError,
    UniqueViolationError,
    WorkQueueConfigurationError,
    one_line,
)
from workqueue.sql import load_procedures

# 2601/2627: duplicate key in a unique index / a PRIMARY KEY or UNIQUE constraint.
UNIQUE_ERRORS = frozenset({2601, 2627})
# Worth retrying: 1205 deadlock victim, 1222 lock request timeout, 51001 the ordered-publish lock
# was not granted in time (raised by wq_lock_publish_order); lost connections (233, 64, 10053,
# 10054, 10060), Azure SQL failover/throttling (40197, 40501, 40613), and the server out of
# space (1105 a full filegroup, 9002 a full transaction log), which passes once space is freed,
# as PostgreSQL's 53100 does.
TRANSIENT_ERRORS = frozenset(
    {1205, 1222, 51001, 64, 233, 10053, 10054, 10060, 40197, 40501, 40613, 1105, 9002}
)

# A SNAPSHOT transaction refused a row changed since it began (worth retrying, as a whole).
SNAPSHOT_UPDATE_CONFLICT = 3960

# Message fragments for drivers that do not report the error number (mssql-python puts only the
# SQLSTATE class and the server's text in its exceptions).
_MESSAGE_NUMBERS = (
    ("cannot insert duplicate key row", 2601),
    ("violation of primary key constraint", 2627),
    ("violation of unique key constraint", 2627),
    ("was deadlocked on", 1205),
    ("snapshot isolation transaction aborted due to update conflict", 3960),
    ("lock request time out period exceeded", 1222),
    ("filegroup is full", 1105),
    ("the transaction log for database", 9002),
    ("invalid object name", 208),
    ("invalid column name", 207),
    ("could not find stored procedure", 2812),
    ("permission was denied on the object", 229),
)
# pyodbc ends a server message with "(<number>) (SQLExecDirectW)".
_PYODBC_NUMBER = re.compile(r"\((-?\d{1,6})\)\s*\(SQL[A-Za-z]+\)")
# The procedures' own THROWs (51000-59999) name their number as "error 5xxxx".
_OWN_NUMBER = re.compile(r"\berror (5\d{4})\b")
_SQLSTATE = re.compile(r"[0-9A-Z]{5}")  # used with fullmatch
# mssql-python names the SQLSTATE class of a lost connection in ``driver_error``.
_CONNECTION_LOST = frozenset(
    {
        "communication link failure",
        "connection not open",
        "connection failure during transaction",
        "disconnect error",
        "client unable to establish connection",
        "connection timeout expired",
    }
)

# A batch separator: a line holding only GO (any case).
_GO_LINE = re.compile(r"^[ \t]*GO[ \t]*;?[ \t]*$", re.IGNORECASE | re.MULTILINE)
_LINE_COMMENT = re.compile(r"--[^\n]*")
_DECLARED_ROUTINE = re.compile(
    r"\bCREATE\s+OR\s+ALTER\s+(PROCEDURE|PROC|FUNCTION|TRIGGER)\s+(?:\[?dbo\]?\.)?\[?(wq_\w+)\]?",
    re.IGNORECASE,
)

SEQUENCE = "dbo.wq_publish_ordinal_seq"
# The CHECK constraint on workqueue_subscription.filter that filters.sql adds.
FILTER_GUARD = "wq_sub_filter_valid"

# Every wq_* procedure and function in dbo, procedures first (they may call the functions).
_LIST_ROUTINES = """
    SELECT o.name, CASE o.type WHEN 'P' THEN 'PROCEDURE' WHEN 'TR' THEN 'TRIGGER'
                               ELSE 'FUNCTION' END
      FROM sys.objects AS o
     WHERE o.schema_id = SCHEMA_ID(N'dbo') AND o.name LIKE N'wq[_]%'
       AND o.type IN ('TR', 'P', 'FN', 'IF', 'TF')
     ORDER BY CASE o.type WHEN 'TR' THEN 0 WHEN 'P' THEN 1 ELSE 2 END, o.name
"""


def _quote_identifier(name: str) -> str:
    return "[" + name.replace("]", "]]") + "]"


def _deny_owner_only_rights(quoted: str) -> list[str]:
    """What no role but the owner may hold, whoever granted it: ALTER on the work queue's
    tables (creating a trigger there takes it, and a trigger runs as whoever writes the table,
    the owner's deploys and admin edits included; TRUNCATE takes it too), REFERENCES (a foreign
    key or a schema-bound view of another role's would block deletes or the owner's ALTERs:
    review helper-174), and ALTER or UPDATE on the publish ordinals' sequence, which orders
    each Ordered key (review helper-173)."""
    return [
        *(f"DENY ALTER, REFERENCES ON dbo.{table} TO {quoted}" for table in app_tables()),
        f"DENY ALTER, UPDATE ON dbo.wq_publish_ordinal_seq TO {quoted}",
    ]


def split_batches(text: str) -> list[str]:
    """Split a T-SQL script on its GO lines, dropping batches that hold only comments."""
    batches = []
    for batch in _GO_LINE.split(text):
        if _LINE_COMMENT.sub("", batch).strip():
            batches.append(batch.strip() + "\n")
    return batches


def declared_routines(texts: Iterable[str]) -> set[str]:
    """The (lower-case) names of the wq_* procedures, functions and triggers the scripts create."""
    names: set[str] = set()
    for text in texts:
        names.update(m.group(2).lower() for m in _DECLARED_ROUTINE.finditer(text))
    return names


def stored_uuid(value: Any) -> str | None:
    """A UUID as Django stores it on SQL Server: char(32), lower-case hex without dashes."""
    return None if value is None else uuid.UUID(str(value)).hex


def _texts(error: BaseException) -> list[str]:
    texts = [str(arg) for arg in getattr(error, "args", ()) if isinstance(arg, str)]
    for attribute in ("driver_error", "ddbc_error", "message"):
        value = getattr(error, attribute, None)
        if isinstance(value, str):
            texts.append(value)
    texts.append(str(error))
    return texts


def error_number(error: BaseException) -> int | None:
    """The SQL Server error number behind a driver exception, when it can be told."""
    number = getattr(error, "number", None)
    if isinstance(number, int):
        return number
    for arg in getattr(error, "args", ()):
        if isinstance(arg, int) and not isinstance(arg, bool):
            return arg
    texts = _texts(error)
    for text in texts:
        found = _PYODBC_NUMBER.findall(text)
        if found:
            return int(found[-1])
    for text in texts:
        found = _OWN_NUMBER.search(text)
        if found:
            return int(found.group(1))
    lowered = " ".join(texts).lower()
    for fragment, fragment_number in _MESSAGE_NUMBERS:
        if fragment in lowered:
            return fragment_number
    return None


def _sqlstate(error: BaseException) -> str | None:
    args = getattr(error, "args", ())
    if args and isinstance(args[0], str) and _SQLSTATE.fullmatch(args[0]):
        return args[0]
    return None


def _connection_lost(error: BaseException, outer: BaseException) -> bool:
    if isinstance(outer, InterfaceError) or isinstance(error, InterfaceError):
        return True
    sqlstate = _sqlstate(error)
    if sqlstate is not None and sqlstate.startswith("08"):
        return True
    driver_error = getattr(error, "driver_error", None)
    return isinstance(driver_error, str) and driver_error.strip().lower() in _CONNECTION_LOST


#: Where the install leaves its stamp (``BaseDriver.procedures_stamp``): a property of the
#: database, which every role that may connect can read (one of a procedure only the roles
#: granted on it can see).
STAMP_PROPERTY = "wq_procedures"
STAMP_STATEMENT = f"""\
IF EXISTS (SELECT 1 FROM sys.extended_properties WHERE class = 0 AND name = N'{STAMP_PROPERTY}')
    EXEC sys.sp_updateextendedproperty @name = N'{STAMP_PROPERTY}', @value = %s;
ELSE
    EXEC sys.sp_addextendedproperty @name = N'{STAMP_PROPERTY}', @value = %s;
"""


class SqlServerDriver(BaseDriver):
    vendor_label = "SQL Server"
    sql_directory = "sqlserver"
    now_sql = "SELECT SYSDATETIMEOFFSET()"
    cancel_requested_sql = (  # Completed too: see PostgresDriver's
        "SELECT 1 FROM dbo.workqueue_delivery WHERE id = %s "
        "AND status IN (N'InFlight', N'Completed') AND cancel_requested_at IS NOT NULL"
    )
    procedures_stamp_sql = (
        "SELECT CAST(value AS nvarchar(200)) FROM sys.extended_properties "
        f"WHERE class = 0 AND name = N'{STAMP_PROPERTY}'"
    )
    features = DriverFeatures(
        supports_listen_notify=False, binary_collation="Latin1_General_100_BIN2"
    )

    @classmethod
    def settings_problems(cls, alias: str) -> list[str]:
        if settings.USE_TZ:
            return []
        # mssql-django makes DateTimeField a datetimeoffset column only under USE_TZ. The
        # procedures' clock is SYSDATETIMEOFFSET(): into a datetime2 column it goes as the
        # server's local wall time, and datetime2 compared with it reads as UTC, so on a server
        # not on UTC every lease looks expired at once (or new work stays hidden for hours).
        return [
            "The work queue on SQL Server needs USE_TZ = True: without it Django creates the "
            "queue's timestamp columns as datetime2, without an offset, and on a server whose "
            "clock is not on UTC leases and due times are off by its offset (every lease "
            "expires at once west of UTC). Set USE_TZ = True before the first `migrate` (the "
            "columns are created then); a database migrated without it is safe only while its "
            "server runs on UTC."
        ]

    # -- calls -----------------------------------------------------------------------------

    def render_call(self, procedure: Procedure) -> str:
        # Named parameters: the call cannot bind a value to the wrong parameter. mssql-django
        # turns each %s into the driver's "?" placeholder.
        args = ", ".join(f"@{p.name} = %s" for p in procedure.params)
        return f"EXEC dbo.{procedure.name} {args}".rstrip()

    def adapt(self, param: Param, value: Any) -> Any:
        # Both mssql-python and pyodbc bind uuid.UUID as a native GUID (SQL_GUID), so a
        # malformed id fails here rather than as a string conversion on the server.
        if value is not None and param.type is ParamType.UUID:
            return uuid.UUID(str(value))
        return super().adapt(param, value)

    def translate_error(self, error: DatabaseError) -> DriverError:
        cause = error.__cause__ or error
        number = error_number(cause)
        message = str(cause).strip() or str(error).strip()
        if number in UNIQUE_ERRORS:
            return UniqueViolationError(message)
        if number == 1222:  # SET LOCK_TIMEOUT ran out (wq_cancel, wq_discard)
            return LockTimeoutError(message)
        if number == SNAPSHOT_UPDATE_CONFLICT:
            return SerializationFailureError(message)
        if number == 1205:
            return DeadlockError(message)
        if number == 229:  # "The EXECUTE permission was denied on the object ..."
            return PrivilegeRefusedError(f"{message} ({PRIVILEGE_REFUSED_HINT})")
        # SQLSTATE 40001 here is also a deadlock's (1205), not a snapshot's refusal.
        if number in TRANSIENT_ERRORS or _sqlstate(cause) == "40001":
            return TransientDriverError(message)
        if _connection_lost(cause, error):
            return TransientDriverError(message or "lost the database connection")
        return DriverError(message)

    def names_a_missing_object(self, error: BaseException) -> bool:
        # 208: invalid object name (a table); 207: invalid column name; 2812: could not find
        # stored procedure.
        return any(error_number(cause) in (207, 208, 2812) for cause in error_chain(error))

    def client_setup_problem(self, error: BaseException) -> str | None:
        # pyodbc's own Error (outside the DB-API classes) when unixODBC finds no driver of the
        # name mssql-django asks for.
        if not any("Can't open lib" in str(cause) for cause in error_chain(error)):
            return None
        return (
            f"The database's ODBC driver could not be loaded ({one_line(error)}). Install "
            "Microsoft's ODBC Driver 18 for SQL Server (msodbcsql18), or use Microsoft's Python "
            'driver, which needs no ODBC set-up: OPTIONS {"python_driver": "mssql_python"} '
            "(?python_driver=mssql_python in DATABASE_URL)."
        )

    # -- installation ----------------------------------------------------------------------

    def install_procedures(self, connection: BaseDatabaseWrapper) -> None:
        files = load_procedures(self.sql_directory)
        declared = declared_routines(text for _name, text in files)
        with connection.cursor() as cursor:
            for name, text in files:
                for batch in split_batches(text):
                    if "%s" in batch:
                        # mssql-django rewrites %s in any batch containing GROUP BY.
                        raise DriverError(f"sqlserver/{name}.sql must not contain '%s'")
                    cursor.execute(batch)
            cursor.execute(_LIST_ROUTINES)
            for routine, kind in cursor.fetchall():
                if routine.lower() not in declared:
                    cursor.execute(f"DROP {kind} dbo.{_quote_identifier(routine)}")
            # A property of the database, which every role that may connect can read.
            cursor.execute(STAMP_STATEMENT, [self.procedures_stamp, self.procedures_stamp])

    def drop_procedures(self, connection: BaseDatabaseWrapper) -> None:
        with connection.cursor() as cursor:
            # The filter guard uses wq_filter_problem, which cannot be dropped while it does.
            cursor.execute(
                f"IF OBJECT_ID(N'dbo.{FILTER_GUARD}', N'C') IS NOT NULL "
                f"ALTER TABLE dbo.workqueue_subscription DROP CONSTRAINT {FILTER_GUARD}"
            )
            cursor.execute(_LIST_ROUTINES)
            for routine, kind in cursor.fetchall():
                cursor.execute(f"DROP {kind} IF EXISTS dbo.{_quote_identifier(routine)}")
            cursor.execute(f"DROP SEQUENCE IF EXISTS {SEQUENCE}")

    # -- grants and the scaler query -------------------------------------------------------

    def grant_runtime_statements(self, role: str) -> list[str]:
        quoted = _quote_identifier(role)
        return [
            *self._read_statements(quoted),
            *(
                f"GRANT EXECUTE ON dbo.{name} TO {quoted}"
                for name in (*granted_to(Grant.RUNTIME), *RUNTIME_READABLE_COUNTS)
            ),
            # Hosts record their own health (not a queue table: no fencing rules to protect);
            # the sweeper deletes the records of hosts long gone.
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON dbo.workqueue_hostrecord TO {quoted}",
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON dbo.{TASK_RESULT_TABLE} TO {quoted}",
            f"GRANT SELECT, INSERT, UPDATE ON dbo.{SCHEDULE_RECORD_TABLE} TO {quoted}",
        ]

    def grant_holders(self, connection: BaseDatabaseWrapper) -> dict[Grant, list[str]]:
        markers = list(self.GRANT_MARKERS.values())
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT DISTINCT OBJECT_NAME(p.major_id), dp.name "
                "FROM sys.database_permissions p "
                "JOIN sys.database_principals dp ON dp.principal_id = p.grantee_principal_id "
                "WHERE p.class = 1 AND p.permission_name = 'EXECUTE' "
                "AND p.state IN ('G', 'W') AND p.major_id IN ("
                + ", ".join(["OBJECT_ID(%s)"] * len(markers))
                + ")",
                [f"dbo.{marker}" for marker in markers],
            )
            by_marker: dict[str, list[str]] = {}
            for name, role in cursor.fetchall():
                by_marker.setdefault(name.lower(), []).append(role)
        return {
            grant: sorted(by_marker.get(marker, [])) for grant, marker in self.GRANT_MARKERS.items()
        }

    def grant_operator_statements(self, role: str) -> list[str]:
        quoted = _quote_identifier(role)
        return [
            *self._read_statements(quoted),
            *(f"GRANT EXECUTE ON dbo.{name} TO {quoted}" for name in granted_to(Grant.OPERATOR)),
            f"GRANT SELECT ON dbo.workqueue_hostrecord TO {quoted}",
            f"GRANT SELECT ON dbo.{TASK_RESULT_TABLE} TO {quoted}",
            f"GRANT SELECT ON dbo.{SCHEDULE_RECORD_TABLE} TO {quoted}",
            f"GRANT SELECT, UPDATE (last_used_at) ON dbo.{API_KEY_TABLE} TO {quoted}",
        ]

    @staticmethod
    def _read_statements(quoted: str) -> list[str]:
        return [
            *(f"GRANT SELECT ON dbo.{table} TO {quoted}" for table in READ_TABLES),
            # A column DENY outranks the table GRANT: every column but the lease token.
            f"DENY SELECT ON dbo.workqueue_delivery ({LEASE_TOKEN_COLUMN}) TO {quoted}",
            # The procedures still write: ownership chaining (same owner, dbo) skips these.
            # ALTER too: it is what creating a trigger on a table takes.
            *(
                f"DENY INSERT, UPDATE, DELETE, ALTER ON dbo.{table} TO {quoted}"
                for table in PROCEDURE_WRITTEN_TABLES
            ),
            # A SELECT WITH (UPDLOCK) would hold the sweepers' lock: these roles may read every
            # other table, but not this one. (A login in db_datareader that is none of them
            # still could: keep such logins off the queue's database.)
            f"DENY SELECT ON dbo.{SWEEP_LOCK_TABLE} TO {quoted}",
            *_deny_owner_only_rights(quoted),
        ]

    def advisory_lock_statements(self, allowed: Iterable[str], *, restrict: bool) -> list[str]:
        raise WorkQueueConfigurationError(
            "On SQL Server the procedures' locks are application locks (sp_getapplock on "
            "principal public), which every user of the database may take by name; this "
            "command restricts PostgreSQL's advisory locks only. Keep logins that are not the "
            "work queue's out of its database instead."
        )

    def grant_scaler_statements(self, role: str) -> list[str]:
        quoted = _quote_identifier(role)
        return [
            *(
                f"DENY INSERT, UPDATE, DELETE, ALTER ON dbo.{table} TO {quoted}"
                for table in PROCEDURE_WRITTEN_TABLES
            ),
            *_deny_owner_only_rights(quoted),
            f"GRANT SELECT ON dbo.workqueue_subscription TO {quoted}",
            f"GRANT SELECT ON dbo.workqueue_topic TO {quoted}",
            f"GRANT SELECT ON dbo.workqueue_transport TO {quoted}",
            f"GRANT SELECT ON dbo.workqueue_delivery TO {quoted}",
            f"DENY SELECT ON dbo.workqueue_delivery ({LEASE_TOKEN_COLUMN}) TO {quoted}",
        ]

    def rebuild_index_statements(self) -> list[str]:
        # REORGANIZE is always online (REBUILD WITH (ONLINE = ON) needs Enterprise or Azure).
        return [f"ALTER INDEX ALL ON dbo.{table} REORGANIZE" for table in QUEUE_TABLES]

    def queue_index_bytes(self, connection: BaseDatabaseWrapper) -> int:
        placeholders = ", ".join(["OBJECT_ID(%s)"] * len(QUEUE_TABLES))
        with connection.cursor() as cursor:
            # index_id 0 and 1 are the table itself (heap or clustered index).
            cursor.execute(
                "SELECT COALESCE(SUM(used_page_count), 0) * 8192 FROM sys.dm_db_partition_stats "
                f"WHERE index_id > 1 AND object_id IN ({placeholders})",
                [f"dbo.{table}" for table in QUEUE_TABLES],
            )
            return int(cursor.fetchone()[0])

    def queue_table_sizes(self) -> list[QueueTableSize]:
        # index_id 0 and 1 are the table itself (heap or clustered index), above are indexes.
        # SQL Server keeps no count of row versions awaiting cleanup per table: dead_rows None.
        placeholders = ", ".join(["OBJECT_ID(%s)"] * len(QUEUE_TABLES))
        rows = self.execute(
            "SELECT OBJECT_NAME(object_id), "
            "SUM(CASE WHEN index_id IN (0, 1) THEN used_page_count ELSE 0 END) * 8192, "
            "SUM(CASE WHEN index_id > 1 THEN used_page_count ELSE 0 END) * 8192, "
            "SUM(CASE WHEN index_id IN (0, 1) THEN row_count ELSE 0 END) "
            f"FROM sys.dm_db_partition_stats WHERE object_id IN ({placeholders}) "
            "GROUP BY object_id ORDER BY 1",
            [f"dbo.{table}" for table in QUEUE_TABLES],
        )
        return [
            QueueTableSize(name, int(table), int(index), int(live), None)
            for name, table, index, live in rows
        ]

    def vacuum_horizon(self) -> VacuumHorizon:
        # The transaction views need VIEW SERVER STATE; without it they raise, so ask first.
        (permitted,) = self.execute(
            "SELECT HAS_PERMS_BY_NAME(NULL, NULL, 'VIEW SERVER STATE')", []
        )[0]
        if not permitted:
            return VacuumHorizon(0.0, None, "", False)
        rows = self.execute(VERSION_STORE_HORIZON_QUERY, [])
        if not rows:
            return VacuumHorizon(0.0, None, "", True)
        holder, seconds = rows[0]
        return VacuumHorizon(max(float(seconds or 0.0), 0.0), None, holder, True)

    def stored_id(self, value: str) -> Any:
        return stored_uuid(value)

    def scaler_query(self, subscription_name: str) -> str:
        literal = "N'" + subscription_name.strip().lower().replace("'", "''") + "'"
        return SCALER_QUERY.replace("LOWER(?)", literal)

    # -- test support ----------------------------------------------------------------------

    def shift_time(
        self, seconds: int, *, subscription_id: str | None = None, topic_id: str | None = None
    ) -> None:
        shift = -int(seconds)
        s, t = stored_uuid(subscription_id), stored_uuid(topic_id)
        with self.transaction() as connection, connection.cursor() as cursor:
            cursor.execute(
                f"""UPDATE dbo.workqueue_delivery
                       SET visible_at = DATEADD(second, {shift}, visible_at),
                           lease_expires_at = DATEADD(second, {shift}, lease_expires_at),
                           last_heartbeat_at = DATEADD(second, {shift}, last_heartbeat_at),
                           completed_at = DATEADD(second, {shift}, completed_at),
                           dead_lettered_at = DATEADD(second, {shift}, dead_lettered_at)
                     WHERE subscription_id = %s
                        OR subscription_id IN (SELECT id FROM dbo.workqueue_subscription
                                                WHERE topic_id = %s)""",
                [s, t],
            )
            cursor.execute(
                f"""UPDATE dbo.workqueue_message
                       SET published_at = DATEADD(second, {shift}, published_at)
                     WHERE topic_id = %s
                        OR id IN (SELECT message_id FROM dbo.workqueue_delivery
                                   WHERE subscription_id = %s)""",
                [t, s],
            )
            cursor.execute(
                f"""UPDATE dbo.workqueue_deduplication
                       SET expires_at = DATEADD(second, {shift}, expires_at)
                     WHERE topic_id = %s""",
                [t],
            )

    def remove_topic(self, topic_id: str) -> None:
        t = stored_uuid(topic_id)
        with self.transaction() as connection, connection.cursor() as cursor:
            for statement in (
                "DELETE FROM dbo.workqueue_delivery WHERE subscription_id IN "
                "(SELECT id FROM dbo.workqueue_subscription WHERE topic_id = %s)",
                "DELETE FROM dbo.workqueue_delivery WHERE message_id IN "
                "(SELECT id FROM dbo.workqueue_message WHERE topic_id = %s)",
                "DELETE FROM dbo.workqueue_message WHERE topic_id = %s",
                "DELETE FROM dbo.workqueue_deduplication WHERE topic_id = %s",
                "DELETE FROM dbo.workqueue_subscription WHERE topic_id = %s",
                "DELETE FROM dbo.workqueue_topic WHERE id = %s",
            ):
                cursor.execute(statement, [t])


# Claimable now (keyless visible Pending rows, plus one per key that could be claimed) plus
# InFlight rows, for one subscription by name (the one "?" parameter), each half capped at 1000
# and the sum not (as on PostgreSQL). Nothing is claimable unless the subscription, its topic and
# its transport are Active, as wq_claim and wq_backlog decide: an autoscaler must not start hosts
# for work none of them may claim. The claimable half reads `ready`
# once (keyless rows are COUNT(*) - COUNT(partition_key)): SQL Server evaluates a CTE once per
# reference, and two reads of an unordered TOP (1000) may see different rows and pass 1000.
#: The oldest open transaction in this database, or snapshot anywhere on the instance (the
#: version store that read committed snapshot writes to is shared), other than this session's:
#: row versions younger than it cannot be cleaned up.
VERSION_STORE_HORIZON_QUERY = """
SELECT TOP (1) holder, seconds FROM (
    SELECT CONCAT(N'session ', st.session_id) AS holder,
           DATEDIFF_BIG(millisecond, dt.database_transaction_begin_time, SYSDATETIME()) / 1000.0
               AS seconds
      FROM sys.dm_tran_database_transactions AS dt
      JOIN sys.dm_tran_session_transactions AS st ON st.transaction_id = dt.transaction_id
     WHERE dt.database_id = DB_ID() AND dt.database_transaction_begin_time IS NOT NULL
       AND st.session_id <> @@SPID
    UNION ALL
    SELECT CONCAT(N'snapshot of session ', s.session_id), CAST(s.elapsed_time_seconds AS float)
      FROM sys.dm_tran_active_snapshot_database_transactions AS s
     WHERE s.session_id <> @@SPID
) AS holders
ORDER BY seconds DESC
"""
SCALER_QUERY = """\
DECLARE @name nvarchar(200) = LOWER(?);
WITH s AS (
    SELECT s.id, s.partition_mode,
           CASE WHEN t.status = N'Active' AND tr.status = N'Active' THEN s.status
                ELSE N'Paused' END AS status
      FROM dbo.workqueue_subscription s
      JOIN dbo.workqueue_topic t ON t.id = s.topic_id
      JOIN dbo.workqueue_transport tr ON tr.id = t.transport_id
     WHERE s.name = @name
), ready AS (
    SELECT TOP (1000) d.partition_key
      FROM dbo.workqueue_delivery d JOIN s ON d.subscription_id = s.id
     WHERE s.status = 'Active' AND d.status = 'Pending' AND d.visible_at <= SYSDATETIMEOFFSET()
       AND (d.partition_key IS NULL OR NOT EXISTS (
            SELECT 1 FROM dbo.workqueue_delivery f WHERE f.subscription_id = s.id
               AND f.partition_key = d.partition_key AND f.status = 'InFlight'))
       AND (s.partition_mode <> 'Ordered' OR d.partition_key IS NULL OR NOT EXISTS (
            SELECT 1 FROM dbo.workqueue_delivery h WHERE h.subscription_id = s.id
               AND h.partition_key = d.partition_key AND h.order_key < d.order_key
               AND h.status IN ('Pending', 'InFlight', 'DeadLettered')))
)
SELECT (SELECT COUNT(*) - COUNT(partition_key) + COUNT(DISTINCT partition_key) FROM ready)
     + (SELECT COUNT(*) FROM (SELECT TOP (1000) 1 AS one FROM dbo.workqueue_delivery d
          JOIN s ON d.subscription_id = s.id WHERE d.status = 'InFlight') AS held) AS Backlog;
"""
