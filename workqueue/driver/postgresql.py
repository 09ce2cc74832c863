"""PostgreSQL: PL/pgSQL functions called with named arguments, SQLSTATE error mapping and
LISTEN/NOTIFY wake-ups."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import secrets
import select
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar

from django.db import DatabaseError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from psycopg import pq

from workqueue.driver.base import (
    API_KEY_TABLE,
    DELIVERY_READABLE_COLUMNS,
    PRIVILEGE_REFUSED_HINT,
    PROCEDURE_WRITTEN_TABLES,
    QUEUE_TABLES,
    READ_TABLES,
    RUNTIME_READABLE_COUNTS,
    SCHEDULE_RECORD_TABLE,
    TASK_RESULT_TABLE,
    BaseDriver,
    DriverFeatures,
    QueueTableSize,
    Row,
    SparseIndex,
    StalledListeners,
    VacuumHorizon,
    app_tables,
    error_chain,
    refuse_where_django_tests_refuse,
    routed_to_django_connection,
    unencodable,
)
from workqueue.driver.procedures import Grant, ParamType, Procedure, get_procedure, granted_to
from workqueue.exceptions import (
    DeadlockError,
    DriverError,
    LockTimeoutError,
    PrivilegeRefusedError,
    SerializationFailureError,
    TransientDriverError,
    UniqueViolationError,
    UnstorableValueError,
    WorkQueueConfigurationError,
    one_line,
)
from workqueue.sql import load_procedures

_CASTS = {
    ParamType.UUID: "uuid",
    ParamType.TEXT: "text",
    ParamType.INT: "integer",
    ParamType.BOOL: "boolean",
    ParamType.JSON: "jsonb",
    ParamType.TIMESTAMP: "timestamptz",
}

logger = logging.getLogger(__name__)

#: The columns ``wq_publish`` and ``wq_publish_many`` return after the registry's, PostgreSQL's
#: own: the topic to announce on and the subscriptions the publish gave a delivery
#: (comma-separated), both NULL when there is nothing to announce (see sql/postgresql/publish.sql).
ANNOUNCE_COLUMNS = ("announce_topic_id", "announce_payload")

#: The longest payload an announcement names subscriptions in; past it the payload is empty,
#: which wakes every consumer of the topic (a notification's payload holds under 8000 bytes).
ANNOUNCEMENT_PAYLOAD_MAX = 7000

# How long a step of sending an announcement, or of reading its answer, may wait on the socket
# before trying again (the server answers within a millisecond or two; this bounds a stall).
_ANNOUNCE_WAIT_SECONDS = 5.0

#: How many times the queue's own connections run a statement before preparing it, where the
#: alias's OPTIONS do not set ``prepare_threshold`` (psycopg's own default).
PREPARE_THRESHOLD = 5

#: The SQLSTATE of a prepared statement the session no longer has (DEALLOCATE, DISCARD ALL).
_NO_SUCH_STATEMENT = "26000"

#: The SQLSTATE and server routine of a prepared statement whose result changed shape since it
#: was prepared ("cached plan must not change result type"; the message may be translated).
_OUTDATED_PLAN = ("0A000", "RevalidateCachedQuery")

# Deadlock, serialization failure, lock timeout, a server shutting down or starting (57P0x),
# and the server's disk full (53100): the same call succeeds once space is freed (the
# sweeper's purges, an operator), so a host keeps trying to settle a handled delivery while
# its lease lasts instead of leaving it to be run again. Not 53200 (out of memory): it is also
# "out of shared memory" for a statement that needs more locks than max_locks_per_transaction
# allows, which fails the same way every time. (The connection exceptions, class 08, are
# matched by their class.)
# (A serialization failure, 40001, is transient too: SerializationFailureError.)
_TRANSIENT_SQLSTATES = {"40P01", "55P03", "57P01", "57P02", "57P03", "53100"}

#: query_canceled: a statement_timeout a DBA set on the role or database (or pg_cancel_backend)
#: stopped a call, which rolled back. The queue's calls take milliseconds unless a lock or a
#: loaded server holds them up, so the same call usually goes through a moment later: a host
#: keeps trying to settle a handled delivery while its lease lasts, as for a lost connection.
STATEMENT_CANCELLED_SQLSTATE = "57014"
STATEMENT_CANCELLED_HINT = (
    "a statement_timeout set on the role or database, or a cancel, stopped the call; if it "
    "keeps happening, raise the timeout for the queue's role"
)

#: read_only_sql_transaction: a session on a standby (what a failover leaves a client that
#: reconnected to the old primary, or to a name not yet pointing at the new one), or one opened
#: while default_transaction_read_only was on for its role or database. Transient, but not on
#: that session: it stays read-only for its life, so the driver closes it, and the retry opens
#: a new one that reaches the primary once the name (or the setting) is right again.
READ_ONLY_SQLSTATE = "25006"
READ_ONLY_HINT = (
    "the database is read-only: a standby (after a failover, point DATABASE_URL's host at the "
    "new primary, or list every server with target_session_attrs=read-write) or "
    "default_transaction_read_only set on the role or database. The session is closed: the "
    "next call opens a new one, which goes through once it reaches a writable primary"
)


#: undefined_table, undefined_column, undefined_function: a relation, a column (a migration
#: that adds one not applied) or a procedure that is not there.
_MISSING_OBJECT_SQLSTATES = frozenset({"42P01", "42703", "42883"})


#: Where the server refuses new transactions to avoid wraparound data loss, with the same
#: SQLSTATE (54000) as a value past one of its limits: that refusal ends with a VACUUM, and is no
#: verdict on the value. Told apart by the reporting function, which is not translated.
_WRAPAROUND_FUNCTIONS = frozenset({"GetNewTransactionId", "GetNewMultiXactId"})


def _is_wraparound_refusal(error: BaseException) -> bool:
    diag = getattr(error, "diag", None)
    return getattr(diag, "source_function", None) in _WRAPAROUND_FUNCTIONS


def _is_data_error(error: BaseException) -> bool:
    import psycopg
    from django.db import DataError

    return isinstance(error, (psycopg.DataError, DataError))


def _is_connection_error(error: BaseException) -> bool:
    import psycopg
    from django.db import InterfaceError, OperationalError

    connection_errors = (psycopg.OperationalError, psycopg.InterfaceError)
    return isinstance(error, (*connection_errors, OperationalError, InterfaceError))


#: The advisory-lock functions of bigint keys, the key space of every lock the procedures take
#: by name (hashtextextended): any role may call them unless their EXECUTE is restricted. The
#: (integer, integer) ones lock another key space, which no procedure uses.
_ADVISORY_LOCK_FUNCTIONS = tuple(
    f"pg_catalog.{name}(bigint)"
    for name in (
        "pg_advisory_lock",
        "pg_advisory_lock_shared",
        "pg_try_advisory_lock",
        "pg_try_advisory_lock_shared",
        "pg_advisory_xact_lock",
        "pg_advisory_xact_lock_shared",
        "pg_try_advisory_xact_lock",
        "pg_try_advisory_xact_lock_shared",
    )
)


def _quote_identifier(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _revoke_owner_only_rights(quoted: str) -> list[str]:
    """Statements taking back from the role ``quoted`` what no role but the owner may hold on
    the work queue's tables and sequence, as far as the owner (or a superuser) granted it (a
    GRANT ALL ON ALL TABLES or SEQUENCES before the work queue's grants): TRIGGER, since a
    trigger on even a topology table runs as whoever writes it, the owner's deploy and admin
    included; TRUNCATE, which no delete guard sees; REFERENCES; and anything on the publish
    ordinals' sequence, which orders each Ordered key (review helper-173). The app's own tables
    only, named: a pattern also matched other apps' tables (review helper-174)."""
    return [
        f"REVOKE TRIGGER, TRUNCATE, REFERENCES ON {', '.join(app_tables())} FROM {quoted}",
        f"REVOKE ALL ON SEQUENCE wq_publish_ordinal_seq FROM {quoted}",
    ]


# Functions that a CHECK constraint calls. PostgreSQL checks EXECUTE on them as whichever role
# writes the row, so they stay executable by PUBLIC; they read nothing and return a verdict.
GUARD_FUNCTIONS = frozenset({"wq_filter_problem(jsonb)"})

# Every wq_* function in the current schema, as "name(argument types)".
_LIST_FUNCTIONS = """
    SELECT p.oid::regprocedure::text, p.oid::bigint, p.xmin::text || p.ctid::text
      FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
     WHERE n.nspname = current_schema() AND p.proname LIKE 'wq\\_%%'
"""

#: What CREATE OR REPLACE FUNCTION raises for a change it cannot make in place, and the hint
#: naming the function to drop: "Use DROP FUNCTION wq_x(uuid,integer) first." (the words around
#: the statement are translated under another lc_messages; the statement and its signature,
#: which ends at the last parenthesis, are not).
INVALID_FUNCTION_DEFINITION = "42P13"
_DROP_FIRST = re.compile(r"DROP FUNCTION (.*\))")

# Roles (other than the owner and PUBLIC) granted EXECUTE on each wq_* function, by name.
_EXECUTE_GRANTEES = """
    SELECT p.proname::text, quote_ident(r.rolname)
      FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
     CROSS JOIN LATERAL aclexplode(p.proacl) a JOIN pg_roles r ON r.oid = a.grantee
     WHERE n.nspname = current_schema() AND p.proname LIKE 'wq\\_%%'
       AND a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner
"""

# Roles (unquoted names) holding EXECUTE on the named wq_* functions of the current schema.
_EXECUTE_GRANTEES_BY_NAME = """
    SELECT DISTINCT p.proname::text, r.rolname::text
      FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
     CROSS JOIN LATERAL aclexplode(p.proacl) a JOIN pg_roles r ON r.oid = a.grantee
     WHERE n.nspname = current_schema() AND p.proname = ANY (%s)
       AND a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner
"""

# The relations (and the delivery columns' domains) the procedure files name. Their search_path
# is pinned to pg_catalog alone, so install_procedures qualifies each of these (and every wq_*
# function the files declare) with the schema the tables were migrated into.
_OWN_RELATIONS = (
    "wq_delivery_status",
    "wq_priority",
    "wq_attempt_count",
    "workqueue_transport",
    "workqueue_topic",
    "workqueue_subscription",
    "workqueue_message",
    "workqueue_delivery",
    "workqueue_deduplication",
    "workqueue_rate_limit_bucket",
    "workqueue_sweep_lock",
    "wq_publish_ordinal_seq",
)
_DECLARED_FUNCTION = re.compile(r"\bCREATE\s+OR\s+REPLACE\s+FUNCTION\s+(wq_\w+)\s*\(", re.I)

# Roles, other than the procedures' owner and the roles that can act as it, that may create
# objects in the current schema: PUBLIC alone when everyone may. Superusers may anyway, and
# pg_database_owner stands for the database's owner, which is checked under its own name.
# The owner is the owner of the installed wq_claim, or (before the first install) whoever
# installs.
_SCHEMA_CREATORS = """
    WITH owner AS (
        SELECT coalesce(
            (SELECT p.proowner FROM pg_proc p
              WHERE p.pronamespace = quote_ident(current_schema())::regnamespace
                AND p.proname = 'wq_claim'
              LIMIT 1),
            (SELECT r.oid FROM pg_roles r WHERE r.rolname = current_user)) AS oid
    ), public_may AS (
        SELECT EXISTS (
            SELECT 1 FROM pg_namespace n, aclexplode(n.nspacl) a
             WHERE n.nspname = current_schema() AND a.grantee = 0
               AND a.privilege_type = 'CREATE') AS yes
    )
    SELECT (SELECT r.rolname FROM pg_roles r, owner WHERE r.oid = owner.oid),
           quote_ident(current_schema()),
           CASE WHEN public_may.yes THEN ARRAY['PUBLIC'] ELSE ARRAY(
               SELECT r.rolname::text FROM pg_roles r, owner
                WHERE NOT r.rolsuper AND r.rolname <> 'pg_database_owner'
                  AND NOT pg_has_role(r.oid, owner.oid, 'MEMBER')
                  AND has_schema_privilege(r.oid, current_schema(), 'CREATE')
                ORDER BY 1) END
      FROM public_may
"""


_REVERT_DELIVERY_RULES = """
    DO $revert$
    BEGIN
        IF EXISTS (SELECT 1 FROM pg_attribute a
                    WHERE a.attrelid = 'workqueue_delivery'::regclass AND a.attname = 'status'
                      AND a.atttypid = to_regtype('wq_delivery_status')) THEN
            ALTER TABLE workqueue_delivery
                ALTER COLUMN status TYPE varchar(20),
                ALTER COLUMN priority TYPE smallint,
                ALTER COLUMN attempt_count TYPE integer,
                ADD CONSTRAINT wq_delivery_status_valid CHECK (
                    status::pg_catalog.text OPERATOR(pg_catalog.=) ANY (ARRAY[
                        'Pending', 'InFlight', 'Completed', 'DeadLettered', 'Discarded'
                    ]::pg_catalog.text[])),
                ADD CONSTRAINT wq_delivery_attempts_nonneg CHECK (
                    attempt_count OPERATOR(pg_catalog.>=) 0),
                ADD CONSTRAINT wq_delivery_priority_range CHECK (
                    priority OPERATOR(pg_catalog.>=) -100
                    AND priority OPERATOR(pg_catalog.<=) 100);
        END IF;
        DROP DOMAIN IF EXISTS wq_delivery_status, wq_priority, wq_attempt_count;
    END
    $revert$
"""


def declared_functions(texts: Iterable[str]) -> set[str]:
    """The wq_* functions that the procedure files create."""
    return {name.lower() for text in texts for name in _DECLARED_FUNCTION.findall(text)}


def qualify_own_objects(sql: str, schema: str, functions: Iterable[str]) -> str:
    """Qualify the tables, the sequence and calls of the wq_* ``functions`` in ``sql`` with
    ``schema`` (an identifier, quoted as needed), so the bodies need no search_path to find
    them. A name already qualified is left alone. A name that opens a string literal
    (``nextval('wq_publish_ordinal_seq')``, ``'workqueue_topic'::regclass``) becomes a literal
    of the qualified name: a quote in the schema's name is doubled there."""
    in_literal = schema.replace("'", "''")

    def qualified(match: re.Match[str]) -> str:
        opens_a_literal = match.string[match.start() - 1 : match.start()] == "'"
        return f"{in_literal if opens_a_literal else schema}.{match[1]}"

    unqualified = r'(?<![.\w"])'
    sql = re.sub(rf"{unqualified}\b({'|'.join(_OWN_RELATIONS)})\b", qualified, sql)
    names = "|".join(sorted(functions, key=len, reverse=True))
    if names:
        sql = re.sub(rf"{unqualified}\b({names})(?=\s*\()", qualified, sql)
    return sql


class PostgresDriver(BaseDriver):
    vendor_label = "PostgreSQL"
    sql_directory = "postgresql"
    now_sql = "SELECT now()"
    # Completed too: a handler that completed in its transaction and runs on holding its key
    # may be asked to stop (wq_cancel); its renewal confirms it against the lease token.
    cancel_requested_sql = (
        "SELECT 1 FROM workqueue_delivery WHERE id = %s "
        "AND status IN ('InFlight', 'Completed') AND cancel_requested_at IS NOT NULL"
    )
    # Through the search path, as the calls find wq_claim.
    procedures_stamp_sql = "SELECT obj_description(to_regproc('wq_claim'), 'pg_proc')"
    features = DriverFeatures(supports_listen_notify=True, binary_collation="C")
    # A database that vanishes without closing its connections (a failover behind a load
    # balancer, a dropped network path) leaves a call waiting for an answer that never comes:
    # a settle, a renewal or the sweeper's commit would hang past the lease instead of failing
    # and being retried on a fresh connection. Keepalives probe a silent peer after 10 s idle,
    # and unacknowledged writes give up after 30 s (Linux; it also bounds the probes).
    own_connection_options: ClassVar[Mapping[str, Any]] = {
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
        "tcp_user_timeout": 30_000,  # milliseconds
    }

    @classmethod
    def settings_problems(cls, alias: str) -> list[str]:
        # Imported here: Django's PostgreSQL backend, and its IsolationLevel for whichever
        # psycopg it runs on, load only with a PostgreSQL alias.
        from django.db.backends.postgresql.psycopg_any import IsolationLevel

        level = connections[alias].settings_dict.get("OPTIONS", {}).get("isolation_level")
        try:
            level = None if level is None else IsolationLevel(level)
        except ValueError:
            return []  # Django refuses it itself, at the first connection
        if level not in (IsolationLevel.REPEATABLE_READ, IsolationLevel.SERIALIZABLE):
            return []
        return [
            f"DATABASES[{alias!r}]['OPTIONS']['isolation_level'] is "
            f"{level.name.replace('_', ' ')}: a transaction that completes a delivery "
            "(context.complete(enlist=True), and every Tasks API task, whose result commits "
            "with its completion) is refused whenever the host renewed the delivery's lease "
            "after its first statement, since renewals change the delivery's row and PostgreSQL "
            "refuses such a transaction to update a row changed since its snapshot: one that "
            "outlasts a third of the lease never completes. Give the work queue an alias of the "
            "same database at READ COMMITTED (WORKQUEUE['DATABASE_ALIAS']) and make the "
            "handlers' changes through it, or run `SET TRANSACTION ISOLATION LEVEL READ "
            "COMMITTED` first in each such block."
        ]

    def install_procedures(self, connection: BaseDatabaseWrapper) -> None:
        # The SECURITY DEFINER functions run with search_path = pg_catalog, pg_temp and name
        # their own tables and functions qualified. Keeping the tables' schema out of the path
        # is what makes them safe: a role that may create objects there could otherwise plant
        # an overload or an operator (varchar = varchar beats the built-in text = text for
        # every status test) that wins overload resolution and runs as the owner; qualifying
        # built-ins with pg_catalog would not stop the operators. (pg_temp is never searched
        # for functions or operators, and comes last for relations.)
        problem = self.schema_problem(connection)
        if problem is not None:
            raise WorkQueueConfigurationError(problem)
        with connection.cursor() as cursor:
            cursor.execute("SELECT quote_ident(current_schema())")
            schema = cursor.fetchone()[0]
            # A function whose parameters change is created anew and the old one dropped
            # below, and one whose result changes is dropped and created by its file (a result
            # shape cannot be replaced in place): either way it is granted again to the roles
            # that held it, so an upgrade does not take publishing away from a runtime role
            # (grant-runtime), not even until the grants are renewed after migrate.
            cursor.execute(_EXECUTE_GRANTEES)
            grantees: dict[str, set[str]] = {}
            for name, role in cursor.fetchall():
                grantees.setdefault(name, set()).add(role)
            # CREATE OR REPLACE rewrites a function's catalogue row, so a row whose version
            # (transaction id and place: a second install in one transaction keeps the first)
            # is the one read here belongs to a function the current files no longer declare.
            # Compared with the row's own earlier version, not with this transaction's id: in
            # a savepoint, a migrate inside an atomic block, the rows carry the savepoint's.
            cursor.execute(_LIST_FUNCTIONS)
            untouched = {(oid, version) for _signature, oid, version in cursor.fetchall()}
            files = load_procedures(self.sql_directory)
            # From every file: a call is qualified whichever file declares its function.
            functions = declared_functions(text for _name, text in files)
            for _name, text in files:
                qualified = qualify_own_objects(text, schema, functions)
                self._run_replacing(connection, cursor, qualified)
            cursor.execute(_LIST_FUNCTIONS)
            for signature, oid, version in cursor.fetchall():
                current = (oid, version) not in untouched
                if current and signature in GUARD_FUNCTIONS:
                    cursor.execute(f"GRANT EXECUTE ON FUNCTION {signature} TO PUBLIC")
                elif current:
                    # New functions are executable by PUBLIC by default; only roles given
                    # `manage.py workqueue grant-runtime` may call these.
                    cursor.execute(f"REVOKE ALL ON FUNCTION {signature} FROM PUBLIC")
                    roles = grantees.get(signature.partition("(")[0].rpartition(".")[2])
                    if roles:
                        cursor.execute(
                            f"GRANT EXECUTE ON FUNCTION {signature} TO {', '.join(sorted(roles))}"
                        )
                else:
                    cursor.execute(f"DROP FUNCTION {signature}")
            # On wq_claim, found as the calls and the stamp's readers find it; any role reads
            # its comment (the stamp is hex and words: no quoting needed).
            cursor.execute("SELECT to_regproc('wq_claim')::regprocedure::text")
            claim = cursor.fetchone()[0]
            cursor.execute(f"COMMENT ON FUNCTION {claim} IS '{self.procedures_stamp}'")

    @staticmethod
    def _run_replacing(connection: BaseDatabaseWrapper, cursor: Any, text: str) -> None:
        """Run a procedure file. CREATE OR REPLACE refuses to rename a parameter, drop a
        default or change a result: the function it names is then dropped, and the file run
        again (its grants are given back with the others'), so such a change in a release does
        not stop its `migrate` with "cannot change name of input parameter". Each drop runs in
        one savepoint with the file, so a file that fails anyway drops nothing."""
        dropping: list[str] = []
        while True:
            try:
                with transaction.atomic(using=connection.alias):
                    for signature in dropping:
                        cursor.execute(f"DROP FUNCTION {signature}")
                    cursor.execute(text)
                return
            except DatabaseError as exc:
                cause = exc.__cause__
                diagnostics = getattr(cause, "diag", None)
                found = _DROP_FIRST.search(getattr(diagnostics, "message_hint", None) or "")
                if (
                    getattr(cause, "sqlstate", None) != INVALID_FUNCTION_DEFINITION
                    or found is None
                    or found[1] in dropping
                ):
                    raise
                dropping.append(found[1])

    def schema_problem(self, connection: BaseDatabaseWrapper | None = None) -> str | None:
        [(owner, schema, creators)] = self.execute(_SCHEMA_CREATORS, [], connection)
        if not creators:
            return None
        grantees = ", ".join(c if c == "PUBLIC" else _quote_identifier(c) for c in creators)
        return (
            f"Roles other than {_quote_identifier(owner)}, the owner of the work-queue "
            f"procedures, may create objects in schema {schema}: {grantees}. Such a role can "
            "plant functions and operators that run with the owner's rights in the owner's own "
            "sessions (migrate, loaddata). PostgreSQL 14 and older let PUBLIC create in schema "
            f"public by default. As the schema's owner run: REVOKE CREATE ON SCHEMA {schema} "
            f"FROM {grantees}; then try again."
        )

    def tune_queue_tables(self, connection: BaseDatabaseWrapper) -> None:
        # Every claim and settle leaves a dead row version, and a burst can change a table
        # many times over between PostgreSQL's default autovacuum/analyze triggers (a fifth
        # and a tenth of the table); stale statistics then mislead the planner about the
        # partial indexes. Vacuum and analyze after 2 % (and at least 1,000 rows) instead.
        with connection.cursor() as cursor:
            for table in QUEUE_TABLES:
                cursor.execute(
                    f"ALTER TABLE {table} SET ("
                    "autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 1000, "
                    "autovacuum_vacuum_insert_scale_factor = 0.02, "
                    "autovacuum_analyze_scale_factor = 0.02, autovacuum_analyze_threshold = 1000)"
                )

    def drop_procedures(self, connection: BaseDatabaseWrapper) -> None:
        with connection.cursor() as cursor:
            cursor.execute(_LIST_FUNCTIONS)
            for signature, _oid, _version in cursor.fetchall():
                cursor.execute(f"DROP FUNCTION IF EXISTS {signature} CASCADE")
            cursor.execute("DROP SEQUENCE IF EXISTS wq_publish_ordinal_seq")

    def revert_delivery_rules(self, connection: BaseDatabaseWrapper) -> None:
        # The columns back to their base types (the indexes naming the status in their WHERE
        # are rebuilt, and the CHECKs read every row, under the table's lock) and the CHECK
        # constraints back under the names migrations 0001 and 0015 gave them, with
        # pg_catalog's operators as the domains have them; the domains then go
        # (sql/postgresql/publish.sql makes them again).
        with connection.cursor() as cursor:
            cursor.execute(_REVERT_DELIVERY_RULES)

    def render_call(self, procedure: Procedure) -> str:
        return self._render_select(procedure, procedure.column_names)

    def _render_select(self, procedure: Procedure, columns: Iterable[str]) -> str:
        # Named arguments with explicit casts: the call cannot bind to the wrong parameter, and
        # an untyped NULL still resolves to the one function of that name.
        args = ", ".join(f"p_{p.name} => %s::{_CASTS[p.type]}" for p in procedure.params)
        return f"SELECT {', '.join(columns)} FROM {procedure.name}({args})"

    def translate_error(self, error: BaseException) -> DriverError:
        cause = error.__cause__ if isinstance(error, DatabaseError) and error.__cause__ else error
        sqlstate = getattr(cause, "sqlstate", None)
        message = str(cause).strip()
        if sqlstate == "23505":
            return UniqueViolationError(message)
        if sqlstate == "55P03":
            return LockTimeoutError(message)
        if sqlstate == "40001":
            return SerializationFailureError(message)
        if sqlstate == "40P01":
            return DeadlockError(message)
        # For these the server's words name the statement a procedure ran, with its SQL as
        # CONTEXT: the first line, and what it means, are what an operator needs.
        first_line = (message.splitlines() or [""])[0]
        if sqlstate == "42501":  # insufficient_privilege
            return PrivilegeRefusedError(f"{first_line} ({PRIVILEGE_REFUSED_HINT})")
        if sqlstate in (READ_ONLY_SQLSTATE, STATEMENT_CANCELLED_SQLSTATE):
            hint = READ_ONLY_HINT if sqlstate == READ_ONLY_SQLSTATE else STATEMENT_CANCELLED_HINT
            return TransientDriverError(f"{first_line} ({hint})")
        if sqlstate in _TRANSIENT_SQLSTATES or (sqlstate or "").startswith("08"):
            return TransientDriverError(message)
        # Class 22 ("data exception") from the server, a value past one of its limits (54000:
        # a jsonb string of 256 MiB, say), or psycopg refusing to send a value (a NUL
        # character: no SQLSTATE, the server never saw it): the value is the problem.
        if (
            (sqlstate or "").startswith("22")
            or (sqlstate == "54000" and not _is_wraparound_refusal(cause))
            or (sqlstate is None and _is_data_error(cause))
        ):
            return UnstorableValueError(message)
        if sqlstate is None:
            # No SQLSTATE: the server never judged the statement. A failed or broken connection
            # is worth retrying; anything else failed on this side (a value psycopg cannot
            # adapt) and would fail the same way again.
            if _is_connection_error(cause) or _is_connection_error(error):
                return TransientDriverError(message or "lost the database connection")
            return DriverError(message)
        return DriverError(message)

    def session_unfit(self, error: BaseException) -> bool:
        return any(
            getattr(cause, "sqlstate", None) == READ_ONLY_SQLSTATE for cause in error_chain(error)
        )

    @staticmethod
    def session_refuses_writes(connection: BaseDatabaseWrapper) -> bool:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SHOW transaction_read_only")
                return cursor.fetchone()[0] == "on"
        except DatabaseError:
            return False  # broken: Django's own check closes it

    def names_a_missing_object(self, error: BaseException) -> bool:
        return any(
            getattr(cause, "sqlstate", None) in _MISSING_OBJECT_SQLSTATES
            for cause in error_chain(error)
        )

    def grant_runtime_statements(self, role: str) -> list[str]:
        quoted = _quote_identifier(role)
        return [
            *self._read_statements(role),
            *(
                f"GRANT EXECUTE ON FUNCTION {name} TO {quoted}"
                for name in (*granted_to(Grant.RUNTIME), *RUNTIME_READABLE_COUNTS)
            ),
            # Hosts record their own health (not a queue table: no fencing rules to protect);
            # the sweeper deletes the records of hosts long gone.
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON workqueue_hostrecord TO {quoted}",
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON {TASK_RESULT_TABLE} TO {quoted}",
            f"GRANT SELECT, INSERT, UPDATE ON {SCHEDULE_RECORD_TABLE} TO {quoted}",
        ]

    def grant_operator_statements(self, role: str) -> list[str]:
        quoted = _quote_identifier(role)
        return [
            *self._read_statements(role),
            *(
                f"GRANT EXECUTE ON FUNCTION {name} TO {quoted}"
                for name in granted_to(Grant.OPERATOR)
            ),
            f"GRANT SELECT ON workqueue_hostrecord, {TASK_RESULT_TABLE}, {SCHEDULE_RECORD_TABLE} "
            f"TO {quoted}",
            f"GRANT SELECT, UPDATE (last_used_at) ON {API_KEY_TABLE} TO {quoted}",
        ]

    @staticmethod
    def _read_statements(role: str) -> list[str]:
        quoted = _quote_identifier(role)
        others = ", ".join(t for t in READ_TABLES if t != "workqueue_delivery")
        return [
            # Whatever the role held on the tables only the procedures write (an older release's
            # grant, GRANT ALL ON ALL TABLES) is taken back first: DML, TRIGGER (a trigger there
            # runs inside the SECURITY DEFINER procedures, as their owner), REFERENCES, and
            # SELECT on the whole delivery table, which would include the lease tokens. It also
            # takes back column grants, so the order below is idempotent.
            f"REVOKE ALL ON {', '.join(PROCEDURE_WRITTEN_TABLES)} FROM {quoted}",
            *_revoke_owner_only_rights(quoted),
            f"GRANT SELECT ON {others} TO {quoted}",
            f"GRANT SELECT ({', '.join(DELIVERY_READABLE_COLUMNS)}) ON workqueue_delivery "
            f"TO {quoted}",
        ]

    def grant_holders(self, connection: BaseDatabaseWrapper) -> dict[Grant, list[str]]:
        with connection.cursor() as cursor:
            cursor.execute(_EXECUTE_GRANTEES_BY_NAME, [list(self.GRANT_MARKERS.values())])
            by_marker: dict[str, list[str]] = {}
            for name, role in cursor.fetchall():
                by_marker.setdefault(name, []).append(role)
        return {
            grant: sorted(by_marker.get(marker, [])) for grant, marker in self.GRANT_MARKERS.items()
        }

    def advisory_lock_statements(self, allowed: Iterable[str], *, restrict: bool) -> list[str]:
        if not restrict:
            return [f"GRANT EXECUTE ON FUNCTION {f} TO PUBLIC" for f in _ADVISORY_LOCK_FUNCTIONS]
        # The procedures run as their owner (SECURITY DEFINER), so the owner keeps the right
        # named: the user running this may be a superuser who owns nothing of the queue's.
        [(owner, _schema, _creators)] = self.execute(_SCHEMA_CREATORS, [])
        holders = ", ".join(_quote_identifier(role) for role in dict.fromkeys([owner, *allowed]))
        return [
            *(f"REVOKE EXECUTE ON FUNCTION {f} FROM PUBLIC" for f in _ADVISORY_LOCK_FUNCTIONS),
            *(f"GRANT EXECUTE ON FUNCTION {f} TO {holders}" for f in _ADVISORY_LOCK_FUNCTIONS),
        ]

    def advisory_locks_open_to_all(self) -> bool:
        [(open_to_all,)] = self.execute(
            "SELECT bool_or(a.grantee = 0) FROM pg_proc p, "
            "aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a "
            "WHERE p.oid = ANY(%s::regprocedure[]::oid[]) AND a.privilege_type = 'EXECUTE'",
            [list(_ADVISORY_LOCK_FUNCTIONS)],
        )
        return bool(open_to_all)

    def grant_scaler_statements(self, role: str) -> list[str]:
        quoted = _quote_identifier(role)
        return [
            # A scaler granted before 0006 could read the whole delivery table, lease tokens
            # included: taken back, with whatever else a broad grant gave (review helper-173).
            f"REVOKE ALL ON {', '.join(PROCEDURE_WRITTEN_TABLES)} FROM {quoted}",
            *_revoke_owner_only_rights(quoted),
            f"GRANT SELECT ON workqueue_subscription TO {quoted}",
            f"GRANT EXECUTE ON FUNCTION wq_backlog(uuid, integer) TO {quoted}",
        ]

    def rebuild_index_statements(self) -> list[str]:
        return [f"REINDEX TABLE CONCURRENTLY {table}" for table in QUEUE_TABLES]

    def sparse_queue_indexes(self) -> list[SparseIndex]:
        # Fewer entries than pages, in an index of 64 pages or more: a B-tree page holds
        # hundreds of entries, so this is what a drained backlog leaves, never a busy index.
        # reltuples is as fresh as the last (auto)vacuum or analyze; -1 means never counted.
        with self._waiting_briefly_for_locks() as connection:
            rows = self.execute(
                "SELECT c.relname::text, (pg_relation_size(c.oid) / "
                "current_setting('block_size')::int)::int, c.reltuples::bigint "
                "FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
                "WHERE i.indrelid = ANY (%s::regclass[]) ORDER BY 1",
                [list(QUEUE_TABLES)],
                connection,
            )
        return [
            SparseIndex(name, pages, entries)
            for name, pages, entries in rows
            if pages >= 64 and 0 <= entries < pages
        ]

    def queue_index_bytes(self, connection: BaseDatabaseWrapper) -> int:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT coalesce(sum(pg_relation_size(indexrelid)), 0) FROM pg_index "
                "WHERE indrelid = ANY (%s::regclass[])",
                [list(QUEUE_TABLES)],
            )
            return int(cursor.fetchone()[0])

    @contextlib.contextmanager
    def _waiting_briefly_for_locks(self) -> Iterator[BaseDatabaseWrapper]:
        """A transaction whose statements wait 2 s at most for a lock, as the gauge procedures
        do, then fail with LockTimeoutError: the sizes of a table, or of its indexes, wait for
        the lock VACUUM FULL, REINDEX or an ALTER TABLE holds as long as it runs, and a scrape
        or /health would wait as long (reviews helper-185, helper-187)."""
        with self.transaction() as connection:
            self.execute("SET LOCAL lock_timeout = '2s'", [], connection)
            yield connection

    def queue_table_sizes(self) -> list[QueueTableSize]:
        # The live and dead counts are the statistics system's, kept as rows change: a little
        # behind, never a scan of the table.
        with self._waiting_briefly_for_locks() as connection:
            rows = self.execute(
                "SELECT c.relname::text, pg_table_size(c.oid), pg_indexes_size(c.oid), "
                "coalesce(s.n_live_tup, 0), coalesce(s.n_dead_tup, 0) "
                "FROM pg_class c LEFT JOIN pg_stat_all_tables s ON s.relid = c.oid "
                "WHERE c.oid = ANY (%s::regclass[]) ORDER BY 1",
                [list(QUEUE_TABLES)],
                connection,
            )
        return [
            QueueTableSize(name, int(table), int(index), int(live), int(dead))
            for name, table, index, live, dead in rows
        ]

    def vacuum_horizon(self) -> VacuumHorizon:
        (sees_every_session,) = self.execute(VISIBILITY_OF_SESSIONS, [])[0]
        rows = self.execute(VACUUM_HORIZON_QUERY, [])
        if not rows:
            return VacuumHorizon(0.0, 0, "", bool(sees_every_session))
        holder, seconds, transactions = rows[0]
        return VacuumHorizon(
            max(float(seconds or 0.0), 0.0),
            int(transactions) if transactions is not None else None,
            holder,
            bool(sees_every_session),
        )

    def notification_queue_usage(self) -> float | None:
        return float(self.execute("SELECT pg_notification_queue_usage()", [])[0][0])

    def release_stalled_listeners(self, confirm_seconds: float) -> StalledListeners:
        seen = self._stalled_sessions()
        if seen:
            # A session that is merely slow to read gets its write through meanwhile.
            time.sleep(confirm_seconds)
            still = self._stalled_sessions()
            seen = {session: holder for session, holder in seen.items() if session in still}
        released: list[str] = []
        refused: list[str] = []
        for (pid, *_), holder in sorted(seen.items()):
            try:
                # False when it has just gone: nothing to report.
                if self.execute("SELECT pg_terminate_backend(%s)", [pid])[0][0]:
                    released.append(holder)
            except DriverError as exc:  # another role's session, or a superuser's
                refused.append(f"{holder}: {one_line(exc)}")
        return StalledListeners(released, refused)

    def _stalled_sessions(self) -> dict[tuple[Any, ...], str]:
        """This database's sessions blocked writing to a client that is not reading, each
        described, by what tells a session that stayed so from one that ran a statement in
        between (pid, when it started, when it last went idle)."""
        rows = self.execute(STALLED_SESSIONS_QUERY, [])
        return {(pid, started, idle_since): holder for pid, started, idle_since, holder in rows}

    def scaler_query(self, subscription_name: str) -> str:
        literal = "'" + subscription_name.strip().lower().replace("'", "''") + "'"
        return SCALER_QUERY.replace("%(name)s", literal)

    def shift_time(
        self, seconds: int, *, subscription_id: str | None = None, topic_id: str | None = None
    ) -> None:
        shift = f"interval '{int(seconds)} seconds'"
        with self.transaction() as connection, connection.cursor() as cursor:
            cursor.execute(
                f"""UPDATE workqueue_delivery d
                       SET visible_at = visible_at - {shift},
                           lease_expires_at = lease_expires_at - {shift},
                           last_heartbeat_at = last_heartbeat_at - {shift},
                           completed_at = completed_at - {shift},
                           dead_lettered_at = dead_lettered_at - {shift}
                     WHERE d.subscription_id = %(s)s
                        OR d.subscription_id IN (SELECT id FROM workqueue_subscription
                                                  WHERE topic_id = %(t)s)""",
                {"s": subscription_id, "t": topic_id},
            )
            cursor.execute(
                f"""UPDATE workqueue_message SET published_at = published_at - {shift}
                     WHERE topic_id = %(t)s
                        OR id IN (SELECT message_id FROM workqueue_delivery
                                   WHERE subscription_id = %(s)s)""",
                {"s": subscription_id, "t": topic_id},
            )
            cursor.execute(
                f"""UPDATE workqueue_deduplication SET expires_at = expires_at - {shift}
                     WHERE topic_id = %(t)s""",
                {"t": topic_id},
            )

    def remove_topic(self, topic_id: str) -> None:
        with self.transaction() as connection, connection.cursor() as cursor:
            for statement in (
                "DELETE FROM workqueue_delivery WHERE subscription_id IN "
                "(SELECT id FROM workqueue_subscription WHERE topic_id = %(t)s)",
                "DELETE FROM workqueue_delivery WHERE message_id IN "
                "(SELECT id FROM workqueue_message WHERE topic_id = %(t)s)",
                "DELETE FROM workqueue_message WHERE topic_id = %(t)s",
                "DELETE FROM workqueue_deduplication WHERE topic_id = %(t)s",
                "DELETE FROM workqueue_subscription WHERE topic_id = %(t)s",
                "DELETE FROM workqueue_topic WHERE id = %(t)s",
            ):
                cursor.execute(statement, {"t": topic_id})

    def open_listener(self) -> PostgresListener:
        return PostgresListener(self.alias)

    def execute(
        self, sql: str, values: list[Any], connection: BaseDatabaseWrapper | None = None
    ) -> list[tuple[Any, ...]]:
        if connection is not None or routed_to_django_connection(self.alias):
            return super().execute(sql, values, connection)
        # The private path talks to psycopg directly: Django's cursor wrapper (debug logging,
        # client-side binding) costs more per call than a settle itself, and Django's
        # connection prepares nothing, where this one prepares the calls it repeats (_connect).
        import psycopg

        refuse_where_django_tests_refuse(self.alias)
        retried = False
        while True:
            owned = getattr(self._local, "raw", None)
            raw = owned.connection if owned is not None else None
            try:
                if owned is not None and owned.announcing is not None and not raw.closed:
                    _collect_announcement(owned)
                if raw is None or raw.closed:
                    owned = self._local.raw = _ThreadConnection(_connect(self.alias))
                    raw = owned.connection
                    self._track(raw)
                cursor = owned.cursor.execute(sql, values)
                # Whether the statement returned rows, read from the result itself: psycopg
                # builds ``description`` anew at each access (~15 us for a dozen columns).
                result = cursor.pgresult
                rows = cursor.fetchall() if result is not None and result.nfields else []
                if owned.opened_read_only:
                    # Reads go through on a session a read-only server opened, but it stays
                    # read-only after the primary is back: one kept by a thread that only read
                    # (a cancel check) failed that thread's next renewal long after the outage.
                    self._local.raw = None
                    owned.close()
                return rows
            except UnicodeEncodeError as exc:
                raise unencodable(exc) from exc
            except psycopg.Error as exc:
                if raw is None:  # no connection could be made: nothing to forget or recover
                    raise self.translate_error(exc) from exc
                if raw.closed or raw.broken:
                    self._local.raw = None
                elif self.session_unfit(exc):
                    self._local.raw = None  # read-only for its life: the next call opens anew
                    owned.close()
                elif not retried and self._recovered_prepared_statement(owned, exc):
                    retried = True  # the call stopped before it ran anything: once more
                    continue
                raise self.translate_error(exc) from exc

    def returned_rows(self, cursor: Any) -> bool:
        # From the result itself, as on the private path above: an enlisted completion paid for
        # psycopg's ``description`` (a column object per column, built anew at each access). A
        # cursor some instrumentation wrapped without passing ``pgresult`` on is asked the
        # DB-API way.
        try:
            result = cursor.cursor.pgresult
        except AttributeError:
            return super().returned_rows(cursor)
        return result is not None and result.nfields > 0

    def _recovered_prepared_statement(self, owned: _ThreadConnection, exc: Any) -> bool:
        """Whether ``exc`` is a call's prepared statement failing at its bind, before it ran
        anything, and the thread's connection is now fit to make the call again."""
        if owned.connection.prepare_threshold is None:
            return False
        if exc.sqlstate == _NO_SUCH_STATEMENT:
            _stop_preparing(owned)
            return True
        if (exc.sqlstate, exc.diag.source_function) == _OUTDATED_PLAN:
            _replace_outdated(owned)
            return True
        return False

    def close(self) -> None:
        owned = getattr(self._local, "raw", None)
        if owned is not None:
            self._local.raw = None
            owned.close()
        super().close()

    def publish(
        self,
        name: str,
        params: Mapping[str, Any],
        *,
        connection: BaseDatabaseWrapper | None = None,
    ) -> list[Row]:
        if connection is not None or routed_to_django_connection(self.alias):
            # Enlisted (or in test mode): the procedure's NOTIFY goes out when the caller's
            # transaction commits, and only if it does.
            return self.call(name, params, connection=connection)
        # On this thread's own connection the publish has committed when the call returns, so
        # it is announced in a transaction of its own: a NOTIFY inside the publish would hold
        # the cluster-wide notification lock until its commit record was flushed, and
        # concurrent publishers would commit one at a time.
        # The procedure also returns what to announce, in columns of PostgreSQL's own after
        # the registry's (SQL Server, without notifications, has no such columns).
        procedure = get_procedure(name)
        values = self.bind(procedure, {**params, "caller_announces": True})
        results = self.execute(self._announcing_calls[name], values)
        kept = len(procedure.columns)
        announcement = _announcement([result[kept:] for result in results])
        named: frozenset[str] = frozenset()
        if announcement is not None:
            topic_id, payload, named = announcement
            self._announce(params["topic_name"], self.topic_channel(topic_id), payload)
        rows = [self.decode_row(procedure, result[:kept]) for result in results]
        if name == "wq_publish" and rows[0]["status"] == "Accepted":
            # Its announcement names the subscriptions it made deliveries for (none when it
            # made none): for free, what PublishResult.delivered_to reports. (A batch's rows do
            # not each carry theirs.)
            rows[0]["delivered_to"] = named
        return rows

    @functools.cached_property
    def _announcing_calls(self) -> dict[str, str]:
        return {
            name: self.render_announcing_call(get_procedure(name))
            for name in ("wq_publish", "wq_publish_many")
        }

    def render_announcing_call(self, procedure: Procedure) -> str:
        """``render_call`` of a publish procedure that also selects what to announce once the
        publish has committed (``ANNOUNCE_COLUMNS``)."""
        return self._render_select(procedure, (*procedure.column_names, *ANNOUNCE_COLUMNS))

    #: The announcement, a bare notification: the publish has found its channel and payload, so
    #: the server looks nothing up (a third of what calling wq_announce costs it).
    _announce_sql = b"SELECT pg_notify($1, $2)"

    def _announce(self, topic_name: str, channel: str, payload: str) -> None:
        """Notify ``channel`` on this thread's connection without waiting for the answer, which
        the connection's next statement collects first (``_collect_announcement``). The server
        runs it right after the publish, while this thread goes on; it runs even if the process
        exits at once, the statement being already with the server."""
        owned = getattr(self._local, "raw", None)
        if owned is None or owned.connection.closed:
            return
        pgconn = owned.connection.pgconn
        params = [channel.encode(), payload.encode()]
        try:
            if owned.connection.prepare_threshold is not None and not owned.announce_prepared:
                # Parsed and planned once per connection rather than at every publish, where
                # the user turned prepared statements on: no pooler in between, or one that
                # keeps them (PgBouncer 1.21 and later).
                prepared = pgconn.prepare(owned.announce_statement, self._announce_sql)
                if prepared.status != pq.ExecStatus.COMMAND_OK:
                    problem = prepared.error_message.decode(errors="replace").strip()
                    logger.warning(
                        "Could not announce a publish to topic %s: %s", topic_name, problem
                    )
                    return  # on a lost connection (closed now) the next statement opens a new one
                owned.announce_prepared = True
            if owned.announce_prepared:
                pgconn.send_query_prepared(owned.announce_statement, params)
            else:
                pgconn.send_query_params(self._announce_sql, params)
            while pgconn.flush():  # non-blocking: wait until the statement is sent
                select.select([], [pgconn.socket], [], _ANNOUNCE_WAIT_SECONDS)
        except Exception:
            # Only a hint is lost (hosts poll). The connection is in an unknown state: the
            # next statement opens a new one.
            logger.warning("Could not announce a publish to topic %s", topic_name, exc_info=True)
            with contextlib.suppress(Exception):
                owned.connection.close()
            return
        owned.announcing = topic_name


def _announcement(announced: list[tuple[Any, ...]]) -> tuple[str, str, frozenset[str]] | None:
    """What a publish asks to announce, from each result row's ``ANNOUNCE_COLUMNS``, as (topic
    id, payload, every subscription named), or None when it made no delivery. A batch run item
    by item gives each accepted item's row its own: they share the topic, and the payload names
    every subscription any of them named (empty, every consumer of the topic, when the names
    would not fit a notification)."""
    topic_id, named = None, set()
    for announce_topic_id, announce_payload in announced:
        if announce_topic_id is not None:
            topic_id = announce_topic_id
            named.update(announce_payload.split(","))
    if topic_id is None:
        return None
    payload = ",".join(sorted(named))
    fits = payload if len(payload) <= ANNOUNCEMENT_PAYLOAD_MAX else ""
    return str(topic_id), fits, frozenset(named)


class _ThreadConnection:
    """Holds one thread's connection and closes it when the thread ends (its thread-local
    storage is released then), so pool threads that finish never leak an open connection."""

    __slots__ = (
        "announce_prepared",
        "announce_statement",
        "announcing",
        "connection",
        "cursor",
        "opened_read_only",
    )

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        #: Whether the server said at the start that the session refuses writes (a standby, or
        #: default_transaction_read_only on): used for one call, not kept for a primary's
        #: return (a standby's promotion aside, such a session refuses writes for its life).
        self.opened_read_only = any(
            connection.info.parameter_status(name) == "on"
            for name in ("in_hot_standby", "default_transaction_read_only")
        )
        # One cursor for every statement of the thread: ``connection.execute`` makes a new one
        # each call, ~17 us of CPU (a claim, a completion batch, a publish each pay it).
        self.cursor = connection.cursor()
        #: The topic of an announcement sent on the connection whose answer is still unread.
        self.announcing: str | None = None
        #: Whether the session holds the announcement as a prepared statement, and its name:
        #: one of this connection's own, as the statements psycopg prepares for it get.
        self.announce_prepared = False
        self.announce_statement = f"{_statement_prefix()}_announce".encode()

    def close(self) -> None:
        """Close the connection, having read an announcement's answer first: a session closed
        with an answer on its way makes the server log that it could not send it."""
        if self.announcing is not None and not self.connection.closed:
            _collect_announcement(self)
        self.connection.close()

    def __del__(self, _suppress: Any = contextlib.suppress) -> None:
        # Bound at definition: at interpreter shutdown module globals may already be gone, and
        # a failing close then leaves nothing to tidy anyway.
        with _suppress(Exception):
            self.close()


def _collect_announcement(owned: _ThreadConnection) -> None:
    """Read the answer to the announcement sent after the connection's last publish (it has
    almost always arrived by now), so the connection can run its next statement. A failed
    announcement is logged: the hosts find that publish at their next poll. A broken
    connection is closed, to be replaced by the statement that comes next."""
    topic, owned.announcing = owned.announcing, None
    pgconn = owned.connection.pgconn
    try:
        while True:
            pgconn.consume_input()
            if not pgconn.is_busy():
                break
            select.select([pgconn.socket], [], [], _ANNOUNCE_WAIT_SECONDS)
        failures, outdated = [], False
        while (result := pgconn.get_result()) is not None:
            if result.status != pq.ExecStatus.TUPLES_OK:
                failures.append(result.error_message.decode(errors="replace").strip())
                sqlstate = (result.error_field(pq.DiagnosticField.SQLSTATE) or b"").decode()
                routine = (result.error_field(pq.DiagnosticField.SOURCE_FUNCTION) or b"").decode()
                if sqlstate == _NO_SUCH_STATEMENT:
                    _stop_preparing(owned)
                outdated = outdated or (sqlstate, routine) == _OUTDATED_PLAN
    except Exception:
        logger.warning("Could not announce a publish to topic %s", topic, exc_info=True)
        with contextlib.suppress(Exception):
            owned.connection.close()
        return
    if failures:
        logger.warning("Could not announce a publish to topic %s: %s", topic, "; ".join(failures))
    if outdated:
        _replace_outdated(owned)


def _connect(alias: str) -> Any:
    """A new autocommit psycopg connection with the alias's Django connection settings."""
    import psycopg
    from django.db import connections

    params = connections[alias].get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    # Names the process in pg_stat_activity, so an operator (or a test) can tell which backends
    # belong to which host; a name set in the database's OPTIONS wins.
    params.setdefault("application_name", f"workqueue:{os.getpid()}")
    # Values set in the database's OPTIONS win (PostgresDriver.own_connection_options).
    for name, value in PostgresDriver.own_connection_options.items():
        params.setdefault(name, value)
    # Django turns psycopg's prepared statements off unless OPTIONS say otherwise, for the sake
    # of poolers that lose them. The queue's connections prepare the calls they repeat unless
    # OPTIONS say otherwise: parsing and planning a call again each time costs about a quarter
    # of a publish's database time, and a lost statement is safe here (names of the
    # connection's own, the call run again unprepared: _name_statements_uniquely, execute).
    asked = "prepare_threshold" in connections[alias].settings_dict.get("OPTIONS", {})
    if not asked:
        params["prepare_threshold"] = PREPARE_THRESHOLD
    connection = psycopg.connect(autocommit=True, **params)
    _name_statements_uniquely(connection, asked=asked)
    connection.execute("SET TIME ZONE 'UTC'")
    # JSON comes back as text, as it does through Django and on SQL Server, so decoding is one
    # rule for every path (a decoded JSON string would be indistinguishable from raw text).
    from psycopg.types.string import TextLoader

    connection.adapters.register_loader("jsonb", TextLoader)
    connection.adapters.register_loader("json", TextLoader)
    # UUIDs too: results carry them as lower-case text anyway (decode_value), and a UUID
    # object built only to be formatted back costs a microsecond or two per value, four
    # values per claimed delivery.
    connection.adapters.register_loader("uuid", TextLoader)
    return connection


def _stop_preparing(owned: _ThreadConnection) -> None:
    """``owned``'s connection lost a statement it prepared. Most likely a pooler in between
    keeps no prepared statements (PgBouncer before 1.21, in transaction pooling), and each call
    it binds by name may reach a server connection that does not have it: the connection
    prepares nothing more, its announcement included (a ``DISCARD ALL`` or ``DEALLOCATE ALL``
    on it gets the same answer)."""
    logger.warning(
        "A statement the queue's connection prepared is gone, most likely because a "
        "transaction pooler that keeps no prepared statements is in between; the connection "
        "stops preparing statements. Set OPTIONS prepare_threshold to None for the alias "
        "(README, PgBouncer).",
        extra={"action": "prepared_statements_lost"},
    )
    owned.connection.prepare_threshold = None
    owned.announce_prepared = False


def _replace_outdated(owned: _ThreadConnection) -> None:
    """A procedure's result changed shape since ``owned``'s connection prepared a call to it:
    a migration dropped the function and created it anew, a result not being replaceable in
    place. Such a statement fails at every bind, having run nothing, for as long as the
    session keeps it, so the connection is closed; the thread's next statement opens a new
    one, which prepares the call in its new shape."""
    logger.info(
        "The queue's procedures changed since this connection prepared its calls (a migration "
        "ran); the connection is replaced by a new one.",
        extra={"action": "prepared_statements_outdated"},
    )
    owned.close()


def _name_statements_uniquely(connection: Any, *, asked: bool) -> None:
    """Give the statements ``connection`` prepares names no other client's statements have.
    ``asked`` says whether the alias's OPTIONS set ``prepare_threshold`` themselves: only then
    is a psycopg that cannot name them worth a warning.

    psycopg names them ``_pg3_0``, ``_pg3_1``, ... in every client alike. Behind a transaction
    pooler that keeps no prepared statements for its clients (PgBouncer before 1.21), a call
    binding one by name may reach a server connection where another client prepared a
    statement of that name, and run it with this call's parameters: a release bound to another
    host's completion (both take a delivery id and a lease token) would complete a delivery no
    handler ran. Under a name of this connection's own, such a call finds no statement
    (SQLSTATE 26000) and runs nothing; the driver then runs it unprepared (``execute``).
    psycopg has no option for the names, so its prepared statement manager is replaced by one
    that prefixes them; should a psycopg release no longer have that manager, the connection
    prepares nothing rather than risk it."""
    if connection.prepare_threshold is None:
        return
    own_names = _own_names_manager()
    replaced = getattr(connection, "_prepared", None)
    if own_names is None or type(replaced) is not own_names.replaces:
        logger.log(
            logging.WARNING if asked else logging.DEBUG,
            "This psycopg's prepared statements cannot be given names of their own, so the "
            "queue's connections prepare none (prepare_threshold is ignored for them)",
        )
        connection.prepare_threshold = None
        return
    connection._prepared = own_names(replaced, _statement_prefix())


def _statement_prefix() -> str:
    """A prefix for one connection's statement names: no other client's begins the same."""
    return f"wq{secrets.token_hex(8)}"


@functools.cache
def _own_names_manager() -> type | None:
    """psycopg's prepared statement manager, naming each new statement with a prefix of the
    connection's own (see _name_statements_uniquely); None if this psycopg has none."""
    try:
        from psycopg._preparing import Prepare, PrepareManager
    except ImportError:
        return None

    class OwnNames(PrepareManager):
        #: The manager psycopg gives a connection, which this one takes the place of.
        replaces = PrepareManager

        def __init__(self, replaced: PrepareManager, prefix: str) -> None:
            super().__init__()
            self.prepare_threshold = replaced.prepare_threshold
            self.prepared_max = replaced.prepared_max
            self._prefix = prefix.encode()

        def get(self, query: Any, prepare: bool | None = None) -> tuple[Prepare, bytes]:
            action, name = super().get(query, prepare)
            if action is Prepare.SHOULD:
                name = self._prefix + name  # kept as given: later calls bind this name
            return action, name

    return OwnNames


class PostgresListener:
    """A dedicated autocommit connection that LISTENs for publish notifications."""

    def __init__(self, alias: str) -> None:
        self._connection = _connect(alias)

    def listen(self, channel: str) -> None:
        self._connection.execute(f"LISTEN {_quote_identifier(channel)}")

    def unlisten(self, channel: str) -> None:
        self._connection.execute(f"UNLISTEN {_quote_identifier(channel)}")

    def notifications(self, timeout: float) -> Iterator[tuple[str, str]]:
        """Yield (channel, payload) of each notification arriving within ``timeout`` seconds."""
        for notify in self._connection.notifies(timeout=timeout):
            yield notify.channel, notify.payload

    def close(self) -> None:
        self._connection.close()


# Claimable now plus InFlight, for one subscription by name, from wq_backlog (the same count the
# operators see); one row, 0 when no subscription has that name. wq_backlog caps each half at
# 1000, and the sum is left uncapped: capping it would let a full claimable half hide the running
# jobs that schedulers subtract from the value.
#: Whether this login sees other logins' sessions in pg_stat_activity (their xmin otherwise
#: reads NULL): superusers and members of pg_read_all_stats (pg_monitor includes it) do.
VISIBILITY_OF_SESSIONS = (
    "SELECT coalesce((SELECT rolsuper FROM pg_roles WHERE rolname = current_user), false) "
    "OR pg_has_role(current_user, 'pg_read_all_stats', 'USAGE')"
)
#: The oldest of what keeps vacuum from removing dead queue rows: a session's snapshot or
#: transaction id in this database, a prepared transaction, a replication slot (a standby's
#: feedback included). Ordered by transaction age, which is what vacuum goes by; a slot has no
#: start time, so its seconds are unknown (NULL). (Sent with a parameter list: % is doubled.)
VACUUM_HORIZON_QUERY = """
SELECT holder, seconds, transactions FROM (
    SELECT format('session %%s (user %%s, %%s, %%s)', a.pid, coalesce(a.usename::text, '?'),
                  coalesce(nullif(a.application_name, ''), 'no application name'),
                  coalesce(a.state, '?')) AS holder,
           extract(epoch FROM clock_timestamp() - coalesce(a.xact_start, a.query_start))::float8
               AS seconds,
           greatest(age(a.backend_xmin), age(a.backend_xid)) AS transactions
      FROM pg_stat_activity a
     WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
       AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
       AND a.backend_type <> 'autovacuum worker'
    UNION ALL
    SELECT format('prepared transaction %%s', p.gid),
           extract(epoch FROM clock_timestamp() - p.prepared)::float8, age(p.transaction)
      FROM pg_prepared_xacts p
     WHERE p.database = current_database()
    UNION ALL
    SELECT format('replication slot %%s', r.slot_name), NULL::float8,
           greatest(age(r.xmin), age(r.catalog_xmin))
      FROM pg_replication_slots r
     WHERE r.xmin IS NOT NULL OR (r.catalog_xmin IS NOT NULL AND r.database = current_database())
) AS holders
ORDER BY transactions DESC NULLS LAST, seconds DESC NULLS LAST
LIMIT 1
"""
#: This database's sessions that sit idle blocked writing to their client: between statements
#: a session writes only what it is notified of, so one whose client stopped reading (a frozen
#: or hung process; its kernel still holds the connection open) keeps the server's
#: notification queue from being truncated past what it has not handed over. (Sent with a
#: parameter list: % is doubled.)
STALLED_SESSIONS_QUERY = """
SELECT a.pid, a.backend_start, a.state_change,
       format('session %%s (user %%s, %%s, client %%s, idle since %%s)', a.pid,
              coalesce(a.usename::text, '?'),
              coalesce(nullif(a.application_name, ''), 'no application name'),
              coalesce(host(a.client_addr), 'local'),
              to_char(a.state_change AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS "UTC"'))
  FROM pg_stat_activity a
 WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
   AND a.state = 'idle' AND a.wait_event = 'ClientWrite'
"""
SCALER_QUERY = """\
SELECT coalesce((
    SELECT b.claimable + b.in_flight
      FROM workqueue_subscription s CROSS JOIN LATERAL wq_backlog(s.id, 1000) b
     WHERE s.name = %(name)s), 0) AS "Backlog"
"""
