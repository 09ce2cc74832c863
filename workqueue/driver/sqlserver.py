"""SQL Server: T-SQL procedures called with EXEC and named parameters, error-number mapping."""

from __future__ import annotations

from django.db import DatabaseError

from workqueue.driver.base import BaseDriver, DriverFeatures
from workqueue.driver.procedures import PROCEDURES, Procedure
from workqueue.exceptions import DriverError, TransientDriverError, UniqueViolationError

# 2601/2627: duplicate key in a unique index / constraint.
_UNIQUE_ERRORS = {2601, 2627}
# 1205 deadlock victim, 1222 lock request timeout, 51001 the publish-order lock timed out
# (raised by wq_lock_publish_order), -2 client timeout, 10054/10053/233 lost connection.
_TRANSIENT_ERRORS = {1205, 1222, 51001, -2, 233, 10053, 10054}


def _error_number(error: BaseException) -> int | None:
    """Find the SQL Server error number in a driver exception's args or message."""
    for arg in getattr(error, "args", ()):
        if isinstance(arg, int):
            return arg
        text = str(arg)
        for marker in ("(", "Error "):
            start = text.rfind(marker)
            while start != -1:
                digits = "".join(
                    ch for ch in text[start + len(marker) :].split(")")[0] if ch.isdigit()
                )
                if digits and len(digits) <= 6:
                    return int(digits)
                start = text.rfind(marker, 0, start)
    return None


def _quote_identifier(name: str) -> str:
    return "[" + name.replace("]", "]]") + "]"


class SqlServerDriver(BaseDriver):
    vendor_label = "SQL Server"
    sql_directory = "sqlserver"
    features = DriverFeatures(
        supports_listen_notify=False, binary_collation="Latin1_General_100_BIN2"
    )

    def render_call(self, procedure: Procedure) -> str:
        args = ", ".join(f"@{p.name} = %s" for p in procedure.params)
        return f"EXEC dbo.{procedure.name} {args}".rstrip()

    def translate_error(self, error: DatabaseError) -> DriverError:
        cause = error.__cause__ or error
        number = _error_number(cause)
        message = str(cause).strip()
        if number in _UNIQUE_ERRORS:
            return UniqueViolationError(message)
        if number in _TRANSIENT_ERRORS:
            return TransientDriverError(message)
        return DriverError(message)

    def grant_runtime_statements(self, role: str) -> list[str]:
        quoted = _quote_identifier(role)
        tables = [
            "workqueue_transport",
            "workqueue_topic",
            "workqueue_subscription",
            "workqueue_message",
            "workqueue_delivery",
            "workqueue_deduplication",
        ]
        statements = [f"GRANT SELECT ON dbo.{table} TO {quoted}" for table in tables]
        statements += [
            f"DENY INSERT, UPDATE, DELETE ON dbo.{table} TO {quoted}" for table in tables[3:]
        ]
        statements += [f"GRANT EXECUTE ON dbo.{name} TO {quoted}" for name in sorted(PROCEDURES)]
        return statements

    def grant_scaler_statements(self, role: str) -> list[str]:
        quoted = _quote_identifier(role)
        return [
            f"GRANT SELECT ON dbo.workqueue_subscription TO {quoted}",
            f"GRANT SELECT ON dbo.workqueue_delivery TO {quoted}",
        ]

    def scaler_query(self) -> str:
        return SCALER_QUERY


SCALER_QUERY = """\
DECLARE @name nvarchar(200) = LOWER(?);
WITH s AS (
    SELECT id, partition_mode, status FROM dbo.workqueue_subscription WHERE name = @name
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
SELECT CASE WHEN x.n > 1000 THEN 1000 ELSE x.n END AS desired_workers
  FROM (SELECT (SELECT COUNT(*) FROM ready WHERE partition_key IS NULL)
             + (SELECT COUNT(DISTINCT partition_key) FROM ready)
             + (SELECT COUNT(*) FROM (SELECT TOP (1000) 1 AS one FROM dbo.workqueue_delivery d
                  JOIN s ON d.subscription_id = s.id WHERE d.status = 'InFlight') AS held) AS n) x;
"""
