"""Procedure installation and grants, shared by migrations and ``manage.py workqueue``.

Versioning rule: procedures are always installed from the current ``workqueue/sql`` files, and
only by the latest migration that changes them (``LATEST_PROCEDURE_MIGRATION``). Older
procedure migrations become no-ops, so replaying history on a new database never installs
today's bodies against yesterday's tables, and a fresh install equals an upgraded one (proved by
tests/integration/test_migrations.py). To change a procedure: edit its .sql file, add a migration
with ``RunPython(install_procedures_step("000N_name"), ...)`` and point the constant at it.
A changed result shape also needs the old function dropped first: on PostgreSQL a DO block
before the function drops it only while it has the old shape (see wq_list_partitions in
``sql/postgresql/operator.sql``), and a dropped function loses its grants, which the upgrade
note must say.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from workqueue.driver import driver_for_connection, get_driver

LATEST_PROCEDURE_MIGRATION = "0017_cheaper_claims_and_completions"

MigrationStep = Callable[[Any, Any], None]


def install_procedures_step(migration_name: str) -> MigrationStep:
    """A RunPython forward step that installs the procedures (and the queue tables' vendor
    settings, versioned the same way) if ``migration_name`` is the latest."""

    def install(apps: Any, schema_editor: Any) -> None:
        if migration_name == LATEST_PROCEDURE_MIGRATION:
            driver = driver_for_connection(schema_editor.connection)
            driver.install_procedures(schema_editor.connection)
            driver.tune_queue_tables(schema_editor.connection)

    return install


def drop_procedures_step(apps: Any, schema_editor: Any) -> None:
    """RunPython reverse step of the first procedure migration."""
    driver_for_connection(schema_editor.connection).drop_procedures(schema_editor.connection)


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
