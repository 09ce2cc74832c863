"""Review helper-174: the DO block of _revoke_owner_only_rights (workqueue/driver/postgresql.py)."""

from __future__ import annotations

import io
import uuid

import pytest
from django.core.management import call_command
from django.db import connection, transaction

from tests.support.roles import database_role
from workqueue.driver.install import grant_runtime_statements, renew_grants

pytestmark = pytest.mark.usefixtures("queue_db")


def _drop(pg_conn, role: str) -> None:
    pg_conn.execute(f'DROP OWNED BY "{role}" CASCADE')
    pg_conn.execute(f'DROP ROLE "{role}"')


def test_a_role_named_with_the_blocks_dollar_tag_is_granted_and_renewed(pg_conn):
    """The role's name is put into the DO body as a '...' literal, but the body is quoted
    $wq$...$wq$: a name holding $wq$ ends the body early. grant-runtime fails with a syntax
    error, and once such a role holds EXECUTE on wq_claim every migrate's renew_grants fails."""
    role = f"r174$wq${uuid.uuid4().hex[:6]}"
    pg_conn.execute(f'CREATE ROLE "{role}"')
    try:
        call_command("workqueue", "grant-runtime", role, stdout=io.StringIO())
        renew_grants(connection)
    finally:
        _drop(pg_conn, role)


def test_a_role_name_cannot_run_sql_as_the_granting_owner(pg_conn):
    """The literal escapes quotes only. Where standard_conforming_strings is off (a database
    or role setting), a backslash in the name ends the literal early and the rest of the name
    runs in the DO block as the owner running grant-runtime or migrate."""
    name = r"a\');EXECUTE $x$CREATE TABLE IF NOT EXISTS wq_i174()$x$;--"
    for role in (name, "a'"):
        pg_conn.execute(f'CREATE ROLE "{role}"')
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL standard_conforming_strings = off")
            try:
                for statement in grant_runtime_statements(name):
                    cursor.execute(statement)
            except Exception:
                pass  # refused: fine, as long as nothing of the name ran
            cursor.execute("SELECT to_regclass('wq_i174') IS NOT NULL")
            (injected,) = cursor.fetchone()
            transaction.set_rollback(True)
        assert not injected, "the role's name ran CREATE TABLE as the granting owner"
    finally:
        for role in (name, "a'"):
            _drop(pg_conn, role)


def test_grant_runtime_leaves_other_apps_tables_alone(pg_conn):
    """The block matches every visible table named workqueue_% : an app labelled workqueue_*
    (this repository's workqueue_samples, a project's workqueue_reports) loses them too."""
    table = f"workqueue_review174_{uuid.uuid4().hex[:6]}"
    with database_role(pg_conn, "r174") as role:
        pg_conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
        try:
            pg_conn.execute(f'GRANT TRUNCATE, REFERENCES ON {table} TO "{role}"')
            call_command("workqueue", "grant-runtime", role, stdout=io.StringIO())
            [(kept,)] = pg_conn.execute(
                "SELECT has_table_privilege(%s, %s, 'TRUNCATE')", [role, table]
            ).fetchall()
        finally:
            pg_conn.execute(f"DROP TABLE {table}")
        assert kept, f"grant-runtime took TRUNCATE on {table}, not a work-queue table"


def test_grant_runtime_leaves_an_installed_apps_workqueue_named_tables_alone(pg_conn):
    """The grants name the work queue's own tables from its app config: an installed app whose
    tables are named workqueue_* too (this repository's workqueue_samples) keeps what its roles
    hold. (Re-read: a list of every installed model's table named workqueue_% passed the test
    above, whose table belongs to no model.)"""
    from workqueue_samples.models import GuestbookEntry

    table = GuestbookEntry._meta.db_table
    with database_role(pg_conn, "r174s") as role:
        pg_conn.execute(f'GRANT TRUNCATE, REFERENCES ON {table} TO "{role}"')
        call_command("workqueue", "grant-runtime", role, stdout=io.StringIO())
        [(kept,)] = pg_conn.execute(
            "SELECT has_table_privilege(%s, %s, 'TRUNCATE')", [role, table]
        ).fetchall()
    assert kept, f"grant-runtime took TRUNCATE on {table}, another app's table"


def test_a_runtime_role_named_with_the_dollar_tag_does_not_fail_every_migrate(pg_conn):
    """Granted EXECUTE on wq_claim (by hand, or by grant-runtime of an earlier release), the
    role is renewed by every migrate's renew_grants, which then fails: migrate raises
    WorkQueueConfigurationError whenever a work-queue migration was applied."""
    role = f"r174$wq${uuid.uuid4().hex[:6]}"
    pg_conn.execute(f'CREATE ROLE "{role}"')
    try:
        [(claim,)] = pg_conn.execute(
            "SELECT oid::regprocedure::text FROM pg_proc WHERE proname = 'wq_claim' "
            "AND pg_function_is_visible(oid)"
        ).fetchall()
        pg_conn.execute(f'GRANT EXECUTE ON FUNCTION {claim} TO "{role}"')
        renew_grants(connection)
    finally:
        _drop(pg_conn, role)


def test_a_workqueue_named_table_the_owner_may_not_touch_does_not_break_the_grants(pg_conn):
    """Run by a work-queue owner that is no superuser (here: a member of the owning role), the
    block's REVOKE on a visible workqueue_% table it has no privilege on (another app's, owned
    by another role) fails with "permission denied": grant-runtime fails, and so does every
    migrate's renew_grants."""
    table = f"workqueue_review174_{uuid.uuid4().hex[:6]}"
    [(owner,)] = pg_conn.execute(
        "SELECT tableowner::text FROM pg_tables WHERE tablename = 'workqueue_delivery' "
        "AND schemaname = current_schema()"
    ).fetchall()
    with (
        database_role(pg_conn, "o174") as other,
        database_role(pg_conn, "m174") as migrator,
        database_role(pg_conn, "r174") as role,
    ):
        pg_conn.execute(f'GRANT "{owner}" TO "{migrator}"')
        pg_conn.execute(f"CREATE TABLE {table} (id int)")
        pg_conn.execute(f'ALTER TABLE {table} OWNER TO "{other}"')
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(f'SET LOCAL ROLE "{migrator}"')
                for statement in grant_runtime_statements(role):
                    cursor.execute(statement)
                transaction.set_rollback(True)
        finally:
            pg_conn.execute(f"DROP TABLE {table}")
