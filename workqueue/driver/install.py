"""Procedure installation and grants, shared by migrations and ``manage.py workqueue``.

Versioning rule: procedures are always installed from the current ``workqueue/sql`` files, and
only by the latest migration that changes them (``LATEST_PROCEDURE_MIGRATION``). Older
procedure migrations become no-ops, so replaying history on a new database never installs
today's bodies against yesterday's tables, and a fresh install equals an upgraded one (proved by
tests/integration/test_migrations.py). To change a procedure: edit its .sql file, add a migration
with ``RunPython(install_procedures_step("000N_name"), ...)`` and point the constant (in
``workqueue/sql/__init__.py``) at it.
On PostgreSQL a function whose parameter names, defaults or result shape change (which
CREATE OR REPLACE refuses) is dropped and created again by the install, its grants given back
(older releases did it with a DO block before the function: see wq_list_partitions in
``sql/postgresql/operator.sql``); on SQL Server CREATE OR ALTER makes any change in place.
Roles that hold the runtime or operator grant get it renewed after every migrate
(``renew_grants``), so new procedures and columns reach them. The install leaves a stamp of the
files it ran (``BaseDriver.procedures_stamp``), which hosts and validate-bindings compare. The
previous release's calls must keep binding (tests/integration/releases/
previous_release_calls.json, checked by test_migrations.py): a parameter renamed, or a new one
without a default, breaks its processes during a rolling deploy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from django.db import DatabaseError, connections, router, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.migrations.recorder import MigrationRecorder

from workqueue.driver import driver_for_connection, get_driver
from workqueue.driver.procedures import Grant
from workqueue.exceptions import WorkQueueConfigurationError
from workqueue.sql import LATEST_PROCEDURE_MIGRATION  # callers (and tests) import it from here

logger = logging.getLogger(__name__)


MigrationStep = Callable[[Any, Any], None]


def install_procedures_step(migration_name: str) -> MigrationStep:
    """A RunPython forward step that installs the procedures (and the queue tables' vendor
    settings, versioned the same way) if ``migration_name`` is the latest."""

    def install(apps: Any, schema_editor: Any) -> None:
        if migration_name == LATEST_PROCEDURE_MIGRATION:
            _install(schema_editor.connection)

    return install


def _install(connection: BaseDatabaseWrapper) -> None:
    """The procedures from the current files, and the queue tables' vendor settings."""
    driver = driver_for_connection(connection)
    driver.install_procedures(connection)
    driver.tune_queue_tables(connection)


def drop_procedures_step(apps: Any, schema_editor: Any) -> None:
    """RunPython reverse step of the first procedure migration."""
    driver_for_connection(schema_editor.connection).drop_procedures(schema_editor.connection)


def revert_delivery_rules_step(apps: Any, schema_editor: Any) -> None:
    """RunPython reverse step of migration 0047 (``BaseDriver.revert_delivery_rules``)."""
    connection = schema_editor.connection
    driver_for_connection(connection).revert_delivery_rules(connection)


def renew_grants(connection: BaseDatabaseWrapper) -> dict[Grant, list[str]]:
    """Give every role that holds the runtime or operator grant the grant as it stands now, on
    ``connection`` (the migrating owner's); return the roles, by grant.

    The grants name what they cover (each procedure, the readable delivery columns), so a
    migration that adds a procedure or a column leaves roles granted before it without them:
    the admin's delivery pages would fail with "permission denied" until someone ran
    grant-runtime / grant-operator again. Renewing after every migrate makes an upgraded
    database's roles equal to freshly granted ones.
    """
    driver = driver_for_connection(connection)
    holders = driver.grant_holders(connection)
    statements_for = {
        Grant.RUNTIME: driver.grant_runtime_statements,
        Grant.OPERATOR: driver.grant_operator_statements,
    }
    # One transaction: the grants take back before they give, and hosts still running must not
    # find a table they read unreadable in between.
    with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
        for grant, roles in holders.items():
            for role in roles:
                for statement in statements_for[grant](role):
                    cursor.execute(statement)
    return holders


def latest_procedure_migration_applied(connection: BaseDatabaseWrapper) -> bool:
    """Whether ``connection``'s database records this release's latest procedure migration."""
    applied = MigrationRecorder(connection).applied_migrations()
    return ("workqueue", LATEST_PROCEDURE_MIGRATION) in applied


def reinstall_procedures(connection: BaseDatabaseWrapper) -> dict[Grant, list[str]]:
    """Install the procedures from the current files and renew the grants, in one transaction
    on ``connection`` (the owner's), as the latest procedure migration does; the roles renewed.
    For a database that records that migration but holds another release's procedures."""
    with transaction.atomic(using=connection.alias):
        _install(connection)
        return renew_grants(connection)


def renew_grants_after_migrate(
    sender: Any,
    using: str,
    plan: list[tuple[Any, bool]] | None = None,
    verbosity: int = 1,
    stdout: Any = None,
    **kwargs: Any,
) -> None:
    """``post_migrate`` receiver: renew the grants after every migrate of a database that holds
    this release's procedures (a flush, which sends no plan, changes no grant).

    Every migrate, not only one that applied a workqueue migration: a migrate that failed after
    ours had committed sent no ``post_migrate``, and the next one, with nothing of ours left to
    apply, must still renew what they added (a runtime role without DELETE on the host records
    could not sweep them, or without EXECUTE on a new procedure could not claim)."""
    connection = connections[using]
    if not router.allow_migrate(using, "workqueue"):
        # A database the router keeps the app off (the queue on an alias of its own): Django
        # records the app's migrations as applied there, with none of its tables.
        return
    if plan is None or not latest_procedure_migration_applied(connection):
        return
    try:
        holders = renew_grants(connection)
    except DatabaseError as exc:
        problem = (
            f"The work-queue grants could not be renewed: {exc}. Run `migrate` again as the "
            "user that owns the work-queue tables (two at once race on the same grants); if "
            "the procedures installed are another release's (a migrate that failed part-way, "
            "then a roll-back of the code), run `manage.py workqueue install-procedures`."
        )
        if not any(m.app_label == "workqueue" and not back for m, back in plan):
            # Nothing of ours was applied: the grants were renewed when it was, so this
            # migrate (of another app, or a second one started beside it) must not fail.
            logger.warning(problem)
            return
        raise WorkQueueConfigurationError(problem) from exc
    renewed = [f"{role} ({grant.value})" for grant, roles in holders.items() for role in roles]
    if renewed and verbosity >= 1 and stdout is not None:
        stdout.write(f"  Renewed work-queue grants: {', '.join(renewed)}\n")


def grant_runtime_statements(role: str, alias: str = "default") -> list[str]:
    return get_driver(alias).grant_runtime_statements(role)


def grant_operator_statements(role: str, alias: str = "default") -> list[str]:
    return get_driver(alias).grant_operator_statements(role)


def grant_scaler_statements(role: str, alias: str = "default") -> list[str]:
    return get_driver(alias).grant_scaler_statements(role)


def apply_statements(statements: list[str], alias: str = "default") -> None:
    """Run grant statements on the driver's own connection, all or nothing."""
    driver = get_driver(alias)
    with driver.transaction() as connection, connection.cursor() as cursor:
        for statement in statements:
            cursor.execute(statement)
