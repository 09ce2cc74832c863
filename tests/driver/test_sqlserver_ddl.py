"""The migrations' SQL Server DDL, generated offline and checked.

mssql-django's schema editor can collect the DDL of every migration without a server: give its
DatabaseWrapper a known ``sql_server_version``, make ``ensure_connection`` a no-op and use
``schema_editor(collect_sql=True)``. The collected statements must carry the guarantees the
procedures rely on (one InFlight delivery per (subscription, partition key), byte-exact keys) and
must parse with Microsoft's T-SQL parser. ``import mssql.base`` needs the system library
libodbc.so.2 (Debian package unixodbc), even with the mssql-python driver.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.db import connections
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.state import ProjectState

from tests.support.tsql import parse_tsql

ALIAS = "workqueue_offline_sqlserver"
BINARY = "Latin1_General_100_BIN2"


@pytest.fixture(scope="module")
def offline_connection() -> Iterator[object]:
    try:
        from mssql.base import DatabaseWrapper
    except ImportError as exc:  # pragma: no cover - depends on the machine
        pytest.fail(f"mssql-django cannot load ({exc}); install unixodbc (libodbc.so.2)")
    settings = {
        "ENGINE": "mssql",
        "NAME": "workqueue",
        "USER": "",
        "PASSWORD": "",
        "HOST": "",
        "PORT": "",
        "OPTIONS": {"python_driver": "mssql_python"},
        "TIME_ZONE": None,
        "CONN_MAX_AGE": 0,
        "CONN_HEALTH_CHECKS": False,
        "AUTOCOMMIT": True,
        "ATOMIC_REQUESTS": False,
        "TEST": {},
    }
    connection = DatabaseWrapper(settings, alias=ALIAS)
    # Both are cached properties that would otherwise ask the server.
    connection.__dict__["sql_server_version"] = 2022
    connection.__dict__["to_azure_sql_db"] = False
    connection.ensure_connection = lambda: None
    # Migration operations look their connection up by alias (router checks).
    connections[ALIAS] = connection
    try:
        yield connection
    finally:
        del connections[ALIAS]


@pytest.fixture(scope="module")
def ddl(offline_connection) -> list[str]:
    """Every statement the workqueue migrations would run on SQL Server, in order."""
    loader = MigrationLoader(None, ignore_no_migrations=True)
    (leaf,) = loader.graph.leaf_nodes("workqueue")
    state = ProjectState()
    statements: list[str] = []
    for key in loader.graph.forwards_plan(leaf):
        migration = loader.graph.nodes[key]
        with offline_connection.schema_editor(collect_sql=True, atomic=False) as editor:
            state = migration.apply(state, editor, collect_sql=True)
        statements += editor.collected_sql
    return statements


def _statement(ddl: list[str], pattern: str) -> str:
    found = [s for s in ddl if re.search(pattern, s, re.IGNORECASE)]
    assert len(found) == 1, f"{pattern!r} matched {len(found)} statements"
    return found[0]


def _column(create_table: str, column: str) -> str:
    found = re.search(rf"\[{column}\] ([^,]+?)(?:,|\)\s*;?\s*$)", create_table)
    assert found, f"no column {column} in {create_table[:80]}..."
    return found.group(1)


def test_one_in_flight_delivery_per_subscription_and_key_is_a_filtered_unique_index(ddl):
    index = _statement(ddl, r"wq_delivery_inflight_key_uq")
    compact = re.sub(r"\s+", " ", index)
    assert compact.startswith("CREATE UNIQUE INDEX [wq_delivery_inflight_key_uq]")
    assert "ON [workqueue_delivery] ([subscription_id], [partition_key])" in compact
    where = compact.split(" WHERE ", 1)[1]
    assert "[status] = 'InFlight'" in where
    assert "[partition_key] IS NOT NULL" in where


def test_partition_and_deduplication_keys_use_the_binary_collation(ddl):
    for table, column in [
        ("workqueue_message", "partition_key"),
        ("workqueue_delivery", "partition_key"),
        ("workqueue_deduplication", "deduplication_key"),
    ]:
        create = _statement(ddl, rf"^CREATE TABLE \[{table}\]")
        assert re.fullmatch(
            rf"nvarchar\(200\)\s+COLLATE {BINARY} (NOT )?NULL", _column(create, column).strip()
        ), _column(create, column)


def test_other_indexes_the_procedures_rely_on_are_filtered_as_designed(ddl):
    for name, key_test in [("keyed", "IS NOT NULL"), ("keyless", "IS NULL")]:
        claim = re.sub(r"\s+", " ", _statement(ddl, rf"^CREATE INDEX \[wq_dlv_claim_{name}_ix\]"))
        assert "([subscription_id], [visible_at])" in claim, claim
        assert f"[partition_key] {key_test}" in claim and "[status] = 'Pending'" in claim, claim
    unique_dedup = _statement(ddl, r"\[wq_dedup_topic_key_uq\]")
    assert "UNIQUE ([topic_id], [deduplication_key])" in unique_dedup


def test_storage_types_match_what_the_procedures_assume(ddl):
    # The T-SQL converts UUIDs to Django's char(32) form and compares JSON as nvarchar text.
    delivery = _statement(ddl, r"^CREATE TABLE \[workqueue_delivery\]")
    assert _column(delivery, "id").startswith("char(32)")
    assert _column(delivery, "lease_token").startswith("char(32)")
    assert _column(delivery, "visible_at").startswith("datetimeoffset")
    message = _statement(ddl, r"^CREATE TABLE \[workqueue_message\]")
    assert _column(message, "payload").startswith("nvarchar(max)")
    assert _column(message, "publish_ordinal").startswith("bigint")


def test_migration_ddl_parses_with_microsofts_parser(ddl, tmp_path: Path):
    script = tmp_path / "migrations.sql"
    script.write_text("\nGO\n".join(s.rstrip().rstrip(";") + ";" for s in ddl) + "\nGO\n")
    result = parse_tsql(script)
    assert result.returncode == 0, result.stderr


def test_queue_table_foreign_keys_are_dropped_by_the_names_they_were_created_with(ddl):
    # Migrations 0017 and 0025 drop them by name; SQL Server's names are not PostgreSQL's
    # (no truncation at 63 characters), so a name that only fits PostgreSQL would fail there.
    created = {}
    for statement in ddl:
        for table, name, column in re.findall(
            r"ALTER TABLE \[?(\w+)\]? ADD CONSTRAINT \[?(\w+)\]? FOREIGN KEY \(\[?(\w+)\]?\)",
            statement,
        ):
            created[(table, column)] = name
    dropped = [
        name
        for statement in ddl
        for name in re.findall(r"DROP CONSTRAINT \[?(\w+_fk_\w+)\]?", statement)
    ]
    assert sorted(dropped) == sorted(
        created[key]
        for key in [
            ("workqueue_delivery", "message_id"),
            ("workqueue_message", "topic_id"),
            ("workqueue_delivery", "subscription_id"),
        ]
    )
