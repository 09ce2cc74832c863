"""The narrow driver interface every vendor implements.

A driver renders a registered procedure's call for its vendor, runs it on the right connection
and turns rows into plain Python values; database errors leave it as ``DriverError`` subclasses.
It knows nothing about models, the runtime or operators.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import decimal
import functools
import hashlib
import json
import re
import sys
import threading
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import FunctionType
from typing import Any, ClassVar

from django.core.serializers.json import DjangoJSONEncoder
from django.db import DatabaseError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from workqueue.driver.procedures import Grant, Param, ParamType, Procedure, get_procedure
from workqueue.exceptions import DriverError, UnstorableValueError
from workqueue.sql import LATEST_PROCEDURE_MIGRATION, load_procedures

#: The driver-owned tables; their indexes churn with every publish, claim and settle.
QUEUE_TABLES = ("workqueue_message", "workqueue_delivery", "workqueue_deduplication")
#: The tables only the procedures write. No role but their owner may hold anything on them
#: beyond SELECT: a trigger there (TRIGGER privilege) would run inside the SECURITY DEFINER
#: procedures, as the owner.
#: The row a sweeper locks for its pass. Only the procedures' owner may lock it; on SQL Server a
#: SELECT with UPDLOCK takes the lock, so no granted role may read it either.
SWEEP_LOCK_TABLE = "workqueue_sweep_lock"
PROCEDURE_WRITTEN_TABLES = (*QUEUE_TABLES, "workqueue_rate_limit_bucket", SWEEP_LOCK_TABLE)
#: Every table the runtime and operator roles read.
READ_TABLES = ("workqueue_transport", "workqueue_topic", "workqueue_subscription", *QUEUE_TABLES)


def app_tables() -> list[str]:
    """Every table of the work queue's app (none of another app's), sorted: the grants take
    back from each what only the owner may hold (reviews helper-173 and helper-174)."""
    from django.apps import apps

    models = apps.get_app_config("workqueue").get_models(include_auto_created=True)
    return sorted({m._meta.db_table for m in models if m._meta.managed and not m._meta.proxy})


#: Tasks API results: hosts record runs in them (the ORM, in the task's transaction), the
#: sweeper purges them, operators and callers read them.
TASK_RESULT_TABLE = "workqueue_taskresult"
#: The latest slot each recurring schedule published: hosts' schedulers read and write it (the
#: ORM), operators read it.
SCHEDULE_RECORD_TABLE = "workqueue_schedulerecord"
#: Operator procedures the runtime role may call too: read-only counts, capped, which a host's
#: metrics port serves (the gauges) and that tell nothing the role cannot read from the tables.
RUNTIME_READABLE_COUNTS = ("wq_backlog", "wq_queue_gauges")
#: What a call refused for want of a grant (PrivilegeRefusedError) adds to the database's words.
PRIVILEGE_REFUSED_HINT = (
    "the role this process connects as lacks a grant: run `manage.py workqueue grant-runtime "
    "ROLE` for hosts and publishers, `grant-operator ROLE` for operators"
)
#: REST API keys: the process serving the API looks them up and stamps their last use.
API_KEY_TABLE = "workqueue_apikey"
#: The delivery column no role but the owner may read: whoever knows a delivery's lease token
#: can settle it in place of the host that holds it. Its claimer gets it from wq_claim.
LEASE_TOKEN_COLUMN = "lease_token"
#: The delivery columns the runtime and operator roles may read: all but the lease token
#: (tests/integration/test_runtime_role.py checks this against the model).
DELIVERY_READABLE_COLUMNS = (
    "id",
    "message_id",
    "subscription_id",
    "status",
    "partition_key",
    "order_key",
    "attempt_count",
    "is_replay",
    "visible_at",
    "priority",
    "lease_owner",
    "lease_expires_at",
    "last_heartbeat_at",
    "progress",
    "last_error",
    "dead_letter_reason",
    "dead_lettered_at",
    "completed_at",
    "cancel_requested_at",
    "resolved_by",
    "resolution_note",
)


@dataclass(frozen=True, slots=True)
class SparseIndex:
    name: str
    pages: int
    entries: int


@dataclass(frozen=True, slots=True)
class QueueTableSize:
    """One queue table's disk footprint against the rows it holds."""

    name: str
    table_bytes: int
    index_bytes: int
    live_rows: int
    #: Dead row versions waiting for vacuum; None where the vendor does not count them.
    dead_rows: int | None


@dataclass(frozen=True, slots=True)
class VacuumHorizon:
    """The oldest thing in the database that keeps dead queue rows from being cleaned up: an open
    transaction or snapshot, a prepared transaction or a replication slot."""

    #: How long it has been held, in seconds (0 when nothing is held).
    age_seconds: float
    #: Its age in transaction ids, where the vendor counts them (PostgreSQL's ``age(xmin)``).
    age_transactions: int | None
    #: What holds it, for the operator to find it ("session 4242 (user app, idle in
    #: transaction)", "replication slot standby1"), or "" when nothing is held.
    holder: str
    #: False when this login may not see other logins' sessions, so a session of another role
    #: holding the horizon is invisible (grant ``pg_monitor`` / VIEW SERVER STATE to see it).
    sees_every_session: bool


@dataclass(frozen=True, slots=True)
class StalledListeners:
    """What a look for sessions that stopped reading their notifications found and did."""

    #: The sessions disconnected, each described for the operator.
    released: list[str]
    #: The sessions that could not be disconnected, each described with why.
    refused: list[str]


@dataclass(frozen=True, slots=True)
class DriverFeatures:
    """What a vendor can do; callers ask these flags instead of naming the vendor."""

    #: Publishes announce themselves so consumers can wake without polling.
    supports_listen_notify: bool
    #: Collation under which partition and deduplication keys compare byte for byte.
    binary_collation: str


Row = dict[str, Any]

# Per thread: how many times each alias was routed to the thread's own Django connection
# (``workqueue.testing.use_test_connection``). Module-level rather than per driver, so every
# driver instance of an alias (the sweep lock makes its own) follows the same rule.
_routing = threading.local()


@contextmanager
def on_django_connection(alias: str) -> Iterator[None]:
    """Run this thread's queue calls for ``alias`` on the thread's Django connection, each in a
    savepoint, instead of on the driver's private connection (test mode). Nests."""
    depths: dict[str, int] = _routing.__dict__.setdefault("depths", {})
    depths[alias] = depths.get(alias, 0) + 1
    try:
        yield
    finally:
        depths[alias] -= 1
        if not depths[alias]:
            del depths[alias]


def refuse_where_django_tests_refuse(alias: str) -> None:
    """Raise what Django's own connection for ``alias`` raises where a test has database access
    blocked: pytest-django outside a test that asks for it (``django_db``), and a
    ``SimpleTestCase``. The queue's calls run on connections of their own, which those gates do
    not cover: a test without the mark published for real, into the development database
    until some test of the run had set the test database up (helper-158).

    Asked at every call, as Django's gates are at every query; where nothing blocks it costs
    two dictionary lookups (0.1 us; reading the thread's wrapper each time cost 1.3 us)."""
    gate = vars(BaseDatabaseWrapper)["ensure_connection"]
    if type(gate) is not FunctionType and getattr(gate, "__name__", "") == "_blocking_wrapper":
        # pytest-django blocks by putting its stand-in on the class, which raises. Named, not
        # merely "not Django's": an APM's wrapper there must not open a connection per call.
        gate()
    if "django.test.testcases" in sys.modules:  # where a SimpleTestCase can be running
        refusal = vars(connections[alias]).get("connect")
        if type(refusal).__name__ == "_DatabaseFailure":
            refusal()  # SimpleTestCase's stand-in: it raises


def routed_to_django_connection(alias: str) -> bool:
    """Whether this thread's queue calls for ``alias`` run on its Django connection."""
    return alias in _routing.__dict__.get("depths", ())


#: How a stamp of this project's procedures begins (``BaseDriver.procedures_stamp``).
_STAMP_PREFIX = "django-workqueue procedures"


def _stamped_migration(stamp: str | None) -> str | None:
    """The migration a stamp names, or None for no stamp (or one of another shape)."""
    words = (stamp or "").split()
    return words[2] if len(words) == 4 and " ".join(words[:2]) == _STAMP_PREFIX else None


def error_chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and what it was raised from, in turn (a driver's error wraps Django's, which
    wraps the client library's)."""
    seen: BaseException | None = error
    while seen is not None:
        yield seen
        seen = seen.__cause__


class BaseDriver:
    """Runs ``wq_*`` procedures for one database alias."""

    features: DriverFeatures
    vendor_label: str
    #: Folder under ``workqueue/sql`` holding this vendor's procedure files.
    sql_directory: str
    #: One row, one column: the database's current time with its offset.
    now_sql: str
    #: A row when the running delivery whose id is the one parameter carries a cancel request.
    cancel_requested_sql: str
    #: Connection options the queue's own connections take unless the alias's OPTIONS set them.
    own_connection_options: ClassVar[Mapping[str, Any]] = {}

    def __init__(self, alias: str = "default") -> None:
        self.alias = alias
        self._local = threading.local()
        # Every private connection opened by any thread, so ``close_all`` can reach them all.
        self._opened: weakref.WeakSet[Any] = weakref.WeakSet()
        self._opened_lock = threading.Lock()
        # Each procedure's call statement, rendered once (claims and publishes render the same
        # text on every call otherwise).
        self._rendered: dict[Procedure, str] = {}

    @classmethod
    def settings_problems(cls, alias: str) -> list[str]:
        """What in Django's settings (those of the queue's ``alias`` among them) keeps this
        vendor's procedures from working, each with its fix (reported by ``manage.py check``
        as ``workqueue.W007``)."""
        return []

    # -- rendering and errors: the vendor-specific part ------------------------------------

    def render_call(self, procedure: Procedure) -> str:
        """Return the SQL that calls ``procedure`` with one placeholder per parameter."""
        raise NotImplementedError

    def translate_error(self, error: DatabaseError) -> DriverError:
        """Map a database error to the app's own error class, keeping it as ``__cause__``."""
        raise NotImplementedError

    def names_a_missing_object(self, error: BaseException) -> bool:
        """Whether ``error`` (or what it was raised from) says a table, column or procedure
        does not exist: what a database not migrated answers."""
        return False

    def client_setup_problem(self, error: BaseException) -> str | None:
        """Why ``error`` (or what it was raised from) says this machine lacks the database's
        client software, naming the fix; else None. No retry mends it."""
        return None

    def install_procedures(self, connection: BaseDatabaseWrapper) -> None:
        """Create or replace every procedure on ``connection`` (inside a migration), drop
        ``wq_*`` procedures that the current files no longer declare, and leave
        ``procedures_stamp``."""
        raise NotImplementedError

    def schema_problem(self, connection: BaseDatabaseWrapper | None = None) -> str | None:
        """Why the schema holding the procedures is unsafe for them, naming the fix, or None.

        Procedures run with their owner's rights; a role that may create objects where they
        live could make the owner run its code. ``connection`` defaults to the driver's own.
        By default None: a vendor whose procedures name every object by schema and whose
        built-ins cannot be shadowed (SQL Server) leaves nothing to plant.
        """
        return None

    # Which release's procedures are installed: the install leaves a stamp, the latest procedure
    # migration and a hash of the files it ran, where any role may read it. A process of an
    # earlier release (one started before `migrate`, or a database a failed migrate and a code
    # roll-back left with other procedures) then says so, instead of failing call by call; one
    # of a later release's (a rolling deploy's old processes) keeps quiet, as those
    # procedures keep serving it.

    #: One row, one column: the stamp the install left (NULL, or no row, when none).
    procedures_stamp_sql: str

    @functools.cached_property
    def procedures_stamp(self) -> str:
        """The stamp an install of this release's procedure files leaves."""
        files = load_procedures(self.sql_directory)
        digest = hashlib.sha256("".join(text for _name, text in files).encode()).hexdigest()
        return f"{_STAMP_PREFIX} {LATEST_PROCEDURE_MIGRATION} {digest[:16]}"

    def installed_procedures(self) -> str | None:
        """The latest procedure migration of the release whose procedures are installed (from
        the stamp its install left), or None when none was left (a release before stamps)."""
        return _stamped_migration(self._installed_stamp())

    def _installed_stamp(self) -> str | None:
        rows = self.execute(self.procedures_stamp_sql, [])
        return rows[0][0] if rows else None

    def procedures_problem(self) -> str | None:
        """Why the procedures installed are not this release's, naming the fix, or None (they
        are, or they are a later release's: its procedures keep serving this one's calls)."""
        stamp = self._installed_stamp()
        installed = _stamped_migration(stamp)
        if stamp == self.procedures_stamp or (
            installed is not None and installed > LATEST_PROCEDURE_MIGRATION
        ):
            return None
        if installed == LATEST_PROCEDURE_MIGRATION:
            found = f"other files of this release's migration {installed}"
            fix = "run `manage.py workqueue install-procedures`"
        else:
            found = f"an earlier release's ({installed or 'from before stamps'})"
            fix = (
                "run `manage.py migrate`; if it has nothing to apply (a migrate that failed "
                "after the work-queue migrations committed, then a roll-back of the code), "
                "`manage.py workqueue install-procedures`"
            )
        return (
            f"The procedures installed in the database are {found}, not this release's "
            f"({LATEST_PROCEDURE_MIGRATION}), so calls may fail or act as theirs: as the owner "
            f"of the work-queue tables, {fix}."
        )

    def tune_queue_tables(self, connection: BaseDatabaseWrapper) -> None:
        """Apply vendor settings that suit tables rewritten by every claim and settle (by
        default none)."""

    def drop_procedures(self, connection: BaseDatabaseWrapper) -> None:
        """Drop every ``wq_*`` procedure (reversing the first procedure migration)."""
        raise NotImplementedError

    def revert_delivery_rules(self, connection: BaseDatabaseWrapper) -> None:
        """Put back the delivery columns' CHECK constraints that Django's state holds before
        migration 0047, where the procedure files keep those rules otherwise (reversing 0047,
        so that earlier migrations find them). By default nothing: the vendor kept them."""

    def grant_runtime_statements(self, role: str) -> list[str]:
        """Statements giving ``role`` what hosts and publishers need: EXECUTE on the runtime
        procedures, SELECT on the tables (not the lease tokens), no DML on the queue tables,
        and writes to its host records."""
        raise NotImplementedError

    def grant_operator_statements(self, role: str) -> list[str]:
        """Statements giving ``role`` EXECUTE on the operator procedures and SELECT on the
        tables (not the lease tokens) and host records, no DML on the queue tables."""
        raise NotImplementedError

    def grant_scaler_statements(self, role: str) -> list[str]:
        """Statements giving an autoscaler login what its scaler query needs, nothing more."""
        raise NotImplementedError

    def advisory_lock_statements(self, allowed: Iterable[str], *, restrict: bool) -> list[str]:
        """Statements letting only the procedures' owner and the roles ``allowed`` take the
        locks the procedures take by name (a claim's partition key, a deduplication key, a
        topic's topology), or with ``restrict`` False, every role again. Raises
        WorkQueueConfigurationError, saying what to do instead, where the vendor cannot."""
        raise NotImplementedError

    def advisory_locks_open_to_all(self) -> bool:
        """Whether every role may still take the locks ``advisory_lock_statements`` restrict
        (a REVOKE by a role that may not make it is only a warning on PostgreSQL)."""
        raise NotImplementedError

    #: The procedure whose EXECUTE grant marks a role as holding each grant: ``grant-runtime``
    #: and ``grant-operator`` give it, and nothing else does.
    GRANT_MARKERS: ClassVar[dict[Grant, str]] = {
        Grant.RUNTIME: "wq_claim",
        Grant.OPERATOR: "wq_replay",
    }

    def grant_holders(self, connection: BaseDatabaseWrapper) -> dict[Grant, list[str]]:
        """The roles (by name, sorted) that hold each grant in this database, told by EXECUTE
        on the grant's marker procedure; the owner of the procedures is not listed."""
        raise NotImplementedError

    def rebuild_index_statements(self) -> list[str]:
        """Statements that rebuild the queue tables' indexes without blocking claims or
        publishes; each runs on its own, outside any transaction, as the tables' owner."""
        raise NotImplementedError

    def sparse_queue_indexes(self) -> list[SparseIndex]:
        """Queue indexes holding far fewer entries than their size (what a drained backlog
        leaves), which a planner pricing indexes by pages per entry may stop using."""
        return []

    def queue_index_bytes(self, connection: BaseDatabaseWrapper) -> int:
        """The disk space the queue tables' indexes take now."""
        raise NotImplementedError

    def queue_table_sizes(self) -> list[QueueTableSize]:
        """Each queue table's size, its indexes' size and its live (and dead) rows, from the
        catalog and statistics views: no table is scanned."""
        raise NotImplementedError

    def vacuum_horizon(self) -> VacuumHorizon:
        """The oldest transaction horizon holding back cleanup of the queue tables."""
        raise NotImplementedError

    def notification_queue_usage(self) -> float | None:
        """How full the server's notification queue is, from 0 to 1; None where the database
        has none (no LISTEN/NOTIFY)."""
        return None

    def release_stalled_listeners(self, confirm_seconds: float) -> StalledListeners:
        """Disconnect the sessions of this database that have stopped reading what the server
        sends them (so hold the notification queue's oldest entries for ever), seen so twice
        ``confirm_seconds`` apart. Asked only where ``notification_queue_usage`` reads one."""
        raise NotImplementedError

    def scaler_query(self, subscription_name: str) -> str:
        """Self-contained SQL an autoscaler runs to size its workers for one subscription: one
        row, one column named ``Backlog``, holding claimable deliveries (one per key that could
        run now) plus those in flight, each half capped at 1000. The name is embedded as a
        quoted literal (scalers take no parameters)."""
        raise NotImplementedError

    def shift_time(
        self, seconds: int, *, subscription_id: str | None = None, topic_id: str | None = None
    ) -> None:
        """Move a subscription's (or a topic's) stored timestamps ``seconds`` into the past.

        For tests and the conformance suite only (never granted to runtime roles): it stands in
        for waiting on the database clock when a case is about leases, backoff or retention.
        """
        raise NotImplementedError

    def remove_topic(self, topic_id: str) -> None:
        """Delete a topic with its subscriptions, messages, deliveries and ledger rows.

        For tests and the conformance suite only: the queue tables are otherwise written by
        the procedures alone.
        """
        raise NotImplementedError

    def open_listener(self) -> Any:
        """A dedicated connection with ``listen(channel)``, ``unlisten(channel)``,
        ``notifications(timeout)`` (yields (channel, payload)) and ``close()``; only where
        ``features.supports_listen_notify``."""
        raise NotImplementedError(f"{self.vendor_label} has no LISTEN/NOTIFY")

    #: The notification channel on which cancel requests are announced (payload: delivery id).
    cancel_channel = "wq_cancel"

    def topic_channel(self, topic_id: str) -> str:
        """The notification channel a publish to ``topic_id`` is announced on."""
        return "wq_" + str(topic_id).replace("-", "").lower()

    # -- connections -----------------------------------------------------------------------

    def _private_connection(self) -> BaseDatabaseWrapper:
        """This thread's own autocommit connection: never the caller's transaction."""
        conn = getattr(self._local, "connection", None)
        if conn is None:
            conn = connections.create_connection(self.alias)
            if self.own_connection_options:
                options = {**self.own_connection_options, **conn.settings_dict.get("OPTIONS", {})}
                conn.settings_dict = {**conn.settings_dict, "OPTIONS": options}
            self._local.connection = conn
            self._track(conn)
        return conn

    def _track(self, connection: Any) -> None:
        with self._opened_lock:
            self._opened.add(connection)

    def close(self) -> None:
        """Close this thread's private connection (the next call opens a new one)."""
        conn = getattr(self._local, "connection", None)
        if conn is not None:
            self._local.connection = None
            conn.close()

    def close_all(self) -> None:
        """Close the private connections of every thread; each thread opens a new one at its
        next call. Used before Django creates, clones or drops a database, which PostgreSQL
        refuses while other sessions are connected to it."""
        with self._opened_lock:
            opened = list(self._opened)
        for conn in opened:
            # Best effort: a connection that fails to close is gone either way.
            with contextlib.suppress(Exception):
                if isinstance(conn, BaseDatabaseWrapper):
                    # Django refuses to close another thread's wrapper unless told it is shared.
                    conn.inc_thread_sharing()
                    try:
                        conn.close()
                    finally:
                        conn.dec_thread_sharing()
                else:
                    conn.close()

    @contextmanager
    def transaction(self) -> Iterator[BaseDatabaseWrapper]:
        """Run several calls in one transaction on this thread's private connection (in test
        mode: in a savepoint of the thread's Django connection)."""
        if routed_to_django_connection(self.alias):
            try:
                with transaction.atomic(using=self.alias):
                    yield connections[self.alias]
            except DatabaseError as exc:
                raise self.translate_error(exc) from exc
            return
        refuse_where_django_tests_refuse(self.alias)
        conn = self._private_connection()
        try:
            conn.ensure_connection()
            conn.set_autocommit(False)
            try:
                yield conn
                conn.commit()
            except BaseException:
                conn.rollback()
                raise
            finally:
                conn.set_autocommit(True)
        except DatabaseError as exc:
            self._discard_if_broken(conn, exc)
            raise self.translate_error(exc) from exc

    def _discard_if_broken(self, conn: BaseDatabaseWrapper, error: BaseException) -> None:
        try:
            broken = conn.connection is None or not conn.is_usable()
        except Exception:
            broken = True
        if broken or self.session_unfit(error):
            self.close()

    def session_unfit(self, error: BaseException) -> bool:
        """Whether ``error`` says the session that raised it would refuse every later call too
        (an open connection, not a broken one), so it is closed and the next call opens anew."""
        return False

    @staticmethod
    def session_refuses_writes(connection: BaseDatabaseWrapper) -> bool:
        """Whether Django's open ``connection`` is a session that refuses every write for its
        life (one opened on a read-only server), which Django's health check passes."""
        return False

    # -- calling ---------------------------------------------------------------------------

    def call(
        self,
        name: str,
        params: Mapping[str, Any] | None = None,
        *,
        connection: BaseDatabaseWrapper | None = None,
    ) -> list[Row]:
        """Call procedure ``name`` and return its rows as dicts of decoded values.

        Runs on this thread's private autocommit connection unless ``connection`` is given (an
        enlisted publish passes the caller's, so the write joins the caller's transaction).
        Missing parameters are passed as NULL; unknown ones are a programming error.
        """
        procedure = get_procedure(name)
        values = self.bind(procedure, params)
        sql = self._rendered.get(procedure)
        if sql is None:
            sql = self._rendered[procedure] = self.render_call(procedure)
        rows = self.execute(sql, values, connection)
        return [self.decode_row(procedure, row) for row in rows]

    def bind(self, procedure: Procedure, params: Mapping[str, Any] | None) -> list[Any]:
        """The values of ``procedure``'s placeholders, in order, from ``params`` by name: the
        missing ones NULL, an unknown one a programming error."""
        params = params or {}
        # A subset test first: it makes no set, which the error below needs only when it fails.
        if not params.keys() <= _param_names(procedure):
            unknown = params.keys() - _param_names(procedure)
            raise TypeError(f"{procedure.name} has no parameter(s) {sorted(unknown)}")
        # Most of a call's parameters are usually NULL: no adapt call for those.
        adapt, get = self.adapt, params.get
        return [
            None if (value := get(p.name)) is None else adapt(p, value) for p in procedure.params
        ]

    def publish(
        self,
        name: str,
        params: Mapping[str, Any],
        *,
        connection: BaseDatabaseWrapper | None = None,
    ) -> list[Row]:
        """Call a publish procedure (``wq_publish`` or ``wq_publish_many``, whose params name
        the topic as ``topic_name``) and wake the topic's consumers once it has committed.

        Here the procedure itself does whatever waking the vendor can; a driver with
        notifications may instead announce the publish after the commit (PostgreSQL does).
        """
        return self.call(name, params, connection=connection)

    def execute(
        self, sql: str, values: list[Any], connection: BaseDatabaseWrapper | None = None
    ) -> list[tuple[Any, ...]]:
        """Send one statement and fetch its rows: the driver's only way to the database.

        Without ``connection`` it runs on this thread's private autocommit connection, or in
        test mode in a savepoint of the thread's Django connection, so a failed call undoes only
        itself, as it would on its own connection. A vendor driver may override this with a
        leaner path to its database library.
        """
        if connection is None and routed_to_django_connection(self.alias):
            try:
                with transaction.atomic(using=self.alias):
                    return self.execute(sql, values, connections[self.alias])
            except DatabaseError as exc:
                raise self.translate_error(exc) from exc
        if connection is None:
            refuse_where_django_tests_refuse(self.alias)
        conn = connection if connection is not None else self._private_connection()
        try:
            with conn.cursor() as cursor:
                cursor.execute(sql, values)
                return cursor.fetchall() if self.returned_rows(cursor) else []
        except UnicodeEncodeError as exc:
            raise unencodable(exc) from exc
        except DatabaseError as exc:
            if connection is None:
                self._discard_if_broken(conn, exc)
            raise self.translate_error(exc) from exc

    def returned_rows(self, cursor: Any) -> bool:
        """Whether the statement just run on ``cursor`` (a Django cursor) returned a result set,
        however empty. A vendor driver may read it from its database library more cheaply."""
        return bool(cursor.description)

    def database_now(self) -> dt.datetime:
        """The database clock, which decides every due time (the scheduler reads its slots
        from it, so all hosts agree whatever their own clocks say)."""
        [(value,)] = self.execute(self.now_sql, [])
        return decode_value(ParamType.TIMESTAMP, value)

    def cancel_requested(self, delivery_id: str) -> bool:
        """Whether an operator asked to cancel the running delivery ``delivery_id``: a read on
        this thread's own connection (the one its renewals use) that renews nothing."""
        return bool(self.execute(self.cancel_requested_sql, [self.stored_id(delivery_id)]))

    def stored_id(self, value: str) -> Any:
        """A delivery's (or any row's) id as the tables store it, for a statement's parameter."""
        return uuid.UUID(value)

    def call_one(self, name: str, params: Mapping[str, Any] | None = None, **kw: Any) -> Row:
        rows = self.call(name, params, **kw)
        if len(rows) != 1:
            raise DriverError(f"{name} returned {len(rows)} rows where one was expected")
        return rows[0]

    def call_rowcount(
        self,
        name: str,
        params: Mapping[str, Any] | None = None,
        *,
        connection: BaseDatabaseWrapper | None = None,
    ) -> int:
        return int(self.call_one(name, params, connection=connection)["affected_rows"])

    # -- values ----------------------------------------------------------------------------

    def adapt(self, param: Param, value: Any) -> Any:
        """Turn a Python value into what the vendor's placeholder expects."""
        # One lookup rather than a test of each type in turn (a publish binds seven values),
        # by the type's value (``_value_``, the member's own attribute: ``value`` and an enum
        # member's hash are each a Python call).
        return None if value is None else _ADAPTERS[param.type._value_](value)

    def decode_row(self, procedure: Procedure, row: tuple[Any, ...]) -> Row:
        names, typed = _result_shape(procedure)
        if len(row) != len(names):
            # Where a call's result is read by position (SQL Server's EXEC): a procedure of a
            # later release may add columns after these, and this release reads on; fewer
            # means the procedures are older than this code.
            if len(row) < len(names):
                raise DriverError(
                    f"{procedure.name} returned {len(row)} columns where this release reads "
                    f"{len(names)}: the database's procedures are older than this code. Run "
                    "manage.py migrate."
                )
            row = row[: len(names)]
        decoded = dict(zip(names, row, strict=True))
        # Text comes back as it is stored and NULL as None: only the other columns need a look
        # (a claim returns fourteen columns per delivery, so the calls saved add up), each with
        # its type's own decoder rather than decode_value's tests of every type.
        for name, decode in typed:
            value = decoded[name]
            if value is not None:
                decoded[name] = decode(value)
        return decoded


@functools.cache
def _param_names(procedure: Procedure) -> frozenset[str]:
    return frozenset(procedure.param_names)


@functools.cache
def _result_shape(
    procedure: Procedure,
) -> tuple[tuple[str, ...], tuple[tuple[str, Callable[[Any], Any]], ...]]:
    """The procedure's column names, and the columns whose values need decoding with their
    decoders."""
    typed = tuple(
        (c.name, _DECODERS[c.type]) for c in procedure.columns if c.type is not ParamType.TEXT
    )
    return procedure.column_names, typed


def unencodable(error: UnicodeEncodeError) -> UnstorableValueError:
    """The error for a string the database library could not encode (a lone surrogate): it is
    raised before anything is sent, is not a database error, and would fail again."""
    return UnstorableValueError(f"A value cannot be sent to the database: {error}")


#: A UUID in the text ``str(uuid.UUID(...))`` writes: lower-case, hyphenated.
_CANONICAL_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class JsonText(str):
    """Text that is already JSON, as ``canonical_json`` wrote it: a JSON parameter takes it as
    it is, where any other ``str`` is encoded as a JSON string. For text made anyway (publishing
    serialises each payload to measure it), so that it is not serialised a second time."""

    __slots__ = ()


def canonical_json(value: Any) -> str:
    """Serialise JSON with sorted keys and no spaces, so equal values give equal text.

    Django's encoder, so payloads may hold what Django itself serialises: ``Decimal`` and
    ``UUID`` become strings, ``datetime``/``date``/``time`` ISO 8601 strings, ``timedelta``
    ISO 8601 durations, lazy translations their text (handlers receive those strings).

    A value that refers to itself raises ``ValueError`` and one nested too deep for Python's
    recursion limit ``RecursionError``, as ``json.dumps`` does.

    A float Python writes with an exponent (``1e+23``, ``5e-324``) is written out in full
    (``100000000000000000000000.0``, ``0.000…5``): PostgreSQL's jsonb keeps a number's value,
    not its spelling, and gave ``1e+23`` back as the integer ``10**23``, another number than the
    float published. Written out, every vendor stores the text the size limit measured, and it
    reads back as the same float."""
    if _C_ENCODER is None:
        text = _CANONICAL_ENCODER.encode(value)
    else:
        # What _CANONICAL_ENCODER.encode runs, without the Python around it (about 0.6 us of a
        # small payload's 2 us): CPython's C encoder, made for each call because its dict of
        # the containers being written (how a value that contains itself is caught before it
        # recurses any deeper) must be the call's own. tests/unit/test_canonical_json.py
        # compares the texts.
        text = "".join(_C_ENCODER({}, *_C_ENCODER_SETTINGS)(value, 0))
    if _EXPONENT.search(text):
        return _STRING_OR_EXPONENT.sub(_written_out, text)
    return text


class CanonicalJSONEncoder(DjangoJSONEncoder):
    """An encoder class for Django's JSON handling (``json.dumps(value, cls=...)``) that writes
    ``canonical_json(value)``: for values stored through a JSONField (a task's return value),
    whose floats must read back as the floats written."""

    def encode(self, o: Any) -> str:
        return canonical_json(o)


#: An exponent where a JSON value ends (before ",", "]", "}" or the end of the text): that of a
#: float Python wrote so, or text inside a string that looks like one, which the substitution
#: below then leaves alone. (A uuid's "1e-4" is followed by more hex.) Its literal first
#: character lets the search skip through long texts at the speed of a substring test.
_EXPONENT = re.compile(r"e[-+][0-9]+(?:[,\]}]|$)")
#: A JSON string (group 1 unset: left as it is) or a number with an exponent (group 1).
_STRING_OR_EXPONENT = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|(-?[0-9]+(?:\.[0-9]+)?e[-+][0-9]+)')


def _written_out(match: re.Match[str]) -> str:
    number = match[1]
    if number is None:
        return match[0]
    # The number's own decimal digits (what jsonb stores and writes back), and a fraction so
    # that it reads back as a float: Python writes an exponent only from 1e16 up (a whole
    # number) and below 1e-4 (which has its fraction).
    text = format(decimal.Decimal(number), "f")
    return text if "." in text else f"{text}.0"


# One instance for every call (json.dumps with cls= builds an encoder per call); encoding keeps
# no state on it, so threads share it.
_CANONICAL_ENCODER = DjangoJSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)

#: None where CPython's C module is missing; then the encoder's own (Python) path is taken.
_C_ENCODER = json.encoder.c_make_encoder
#: The C encoder's settings after its markers, as _CANONICAL_ENCODER.iterencode passes them.
_C_ENCODER_SETTINGS = (
    _CANONICAL_ENCODER.default,
    json.encoder.encode_basestring,  # ensure_ascii=False
    None,  # no indent
    _CANONICAL_ENCODER.key_separator,
    _CANONICAL_ENCODER.item_separator,
    _CANONICAL_ENCODER.sort_keys,
    _CANONICAL_ENCODER.skipkeys,
    _CANONICAL_ENCODER.allow_nan,
)

#: A str as canonical_json writes it (a JSON string, non-ASCII kept), without the encoder's
#: per-call set-up: for the short texts publishing assembles JSON from.
encode_json_string = json.encoder.encode_basestring


def _json_param(value: Any) -> str:
    # Always encoded, except JsonText: any other str is a JSON string value, never pre-encoded
    # JSON.
    return str(value) if isinstance(value, JsonText) else canonical_json(value)


def _uuid_param(value: Any) -> str:
    if type(value) is str and _CANONICAL_UUID.fullmatch(value):
        return value  # already as below (ids made by workqueue.ids), at a fifth the cost
    return str(uuid.UUID(str(value)))


def _timestamp_param(value: Any) -> str:
    # ISO 8601 with its offset: both vendors read it as that instant.
    return value.isoformat() if isinstance(value, dt.datetime) else str(value)


_ADAPTERS: dict[str, Callable[[Any], Any]] = {
    ParamType.JSON.value: _json_param,
    ParamType.UUID.value: _uuid_param,
    ParamType.INT.value: int,
    ParamType.BOOL.value: bool,
    ParamType.TIMESTAMP.value: _timestamp_param,
    ParamType.TEXT.value: str,
}


def decode_value(kind: ParamType, value: Any) -> Any:
    """Decode one result value; UUIDs come back as lower-case strings whatever the vendor."""
    return None if value is None else _DECODERS[kind](value)


def _uuid_text(value: Any) -> str:
    # Text already on PostgreSQL's own connections (their UUID loader), a UUID object through
    # Django's, upper-case text on SQL Server.
    return str(value).lower()


def _json_value(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str | bytes) else value


def _aware(value: Any) -> Any:
    if isinstance(value, dt.datetime) and value.tzinfo is None:
        return value.replace(tzinfo=dt.UTC)
    return value


def _as_is(value: Any) -> Any:
    return value


_DECODERS: dict[ParamType, Callable[[Any], Any]] = {
    ParamType.UUID: _uuid_text,
    ParamType.JSON: _json_value,
    ParamType.INT: int,
    ParamType.BOOL: bool,
    ParamType.TIMESTAMP: _aware,
    ParamType.TEXT: _as_is,
}
