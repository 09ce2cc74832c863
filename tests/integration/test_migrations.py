"""Procedure versioning: a fresh install equals an upgraded one, and the models match the
migrations.

The fresh install is this worker's test database (pytest-django migrated it); the upgraded one
is a scratch database that a ``manage.py migrate`` subprocess takes to an old migration and
then to the latest, so the shared test database is never migrated backwards."""

from __future__ import annotations

import io
import json
import re
import sqlite3
import uuid
from pathlib import Path

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection, transaction

from tests.support.database import psycopg_params
from tests.support.processes import PROJECT_ROOT, run_manage, subprocess_environment
from tests.support.roles import database_role
from workqueue.driver import get_driver
from workqueue.driver.install import LATEST_PROCEDURE_MIGRATION

# Everything a migration decides about the schema, in comparable text.
#: What earlier releases left for these tests (their calls, their procedure files).
RELEASES = Path(__file__).resolve().parent / "releases"

CATALOG_QUERIES = {
    "columns": """
        SELECT table_name, column_name, data_type, character_maximum_length, is_nullable,
               column_default, collation_name, domain_name
          FROM information_schema.columns
         WHERE table_schema = current_schema() AND table_name LIKE 'workqueue\\_%%'
         ORDER BY 1, 2""",
    "indexes": """
        SELECT tablename, indexname, indexdef FROM pg_indexes
         WHERE schemaname = current_schema() AND tablename LIKE 'workqueue\\_%%'
         ORDER BY 1, 2""",
    "constraints": """
        SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) FROM pg_constraint
         WHERE connamespace = current_schema()::regnamespace
           AND conrelid::regclass::text LIKE 'workqueue\\_%%'
         ORDER BY 1, 2""",
    "domains": """
        SELECT t.typname, format_type(t.typbasetype, t.typtypmod),
               c.conname, pg_get_constraintdef(c.oid), c.convalidated
          FROM pg_type t LEFT JOIN pg_constraint c ON c.contypid = t.oid
         WHERE t.typnamespace = current_schema()::regnamespace AND t.typtype = 'd'
         ORDER BY 1, 4""",
    "table_options": """
        SELECT relname, reloptions FROM pg_class
         WHERE relnamespace = current_schema()::regnamespace AND relkind = 'r'
           AND relname LIKE 'workqueue\\_%%'
         ORDER BY 1""",
    "triggers": """
        SELECT tgrelid::regclass::text, tgname, pg_get_triggerdef(oid) FROM pg_trigger
         WHERE NOT tgisinternal AND tgrelid::regclass::text LIKE 'workqueue\\_%%'
         ORDER BY 1, 2""",
    "functions": """
        SELECT p.oid::regprocedure::text, pg_get_function_arguments(p.oid), md5(p.prosrc),
               p.prosecdef, p.proconfig, p.provolatile, pg_get_function_result(p.oid), p.proacl,
               obj_description(p.oid, 'pg_proc')
          FROM pg_proc p
         WHERE p.pronamespace = current_schema()::regnamespace AND p.proname LIKE 'wq\\_%%'
         ORDER BY 1""",
}


def _catalog() -> dict[str, list[tuple]]:
    """This worker's test database, as the migrations left it."""
    with connection.cursor() as cursor:
        result = {}
        for name, query in CATALOG_QUERIES.items():
            cursor.execute(query)
            result[name] = cursor.fetchall()
        return result


def _scratch_catalog(url: str) -> dict[str, list[tuple]]:
    with psycopg.connect(url, autocommit=True) as conn:
        return {name: conn.execute(query).fetchall() for name, query in CATALOG_QUERIES.items()}


def _migrate(url: str, *target: str) -> None:
    run_manage("migrate", *target, "-v0", env=subprocess_environment(url), check=True)


@pytest.mark.django_db
def test_models_and_migrations_agree():
    out = io.StringIO()
    call_command("makemigrations", "workqueue", "--check", "--dry-run", stdout=out)


@pytest.mark.processes
@pytest.mark.django_db
def test_an_upgraded_database_equals_a_fresh_one(scratch_database):
    fresh = _catalog()
    assert fresh["functions"], "the procedures should be installed by the migrations"
    tuned = {name for name, options in fresh["table_options"] if options}
    assert tuned == {"workqueue_message", "workqueue_delivery", "workqueue_deduplication"}

    # An older database (tables only, before any procedure migration) upgraded to the latest.
    _migrate(scratch_database, "workqueue", "0001")
    assert not _scratch_catalog(scratch_database)["functions"]
    _migrate(scratch_database)

    assert _scratch_catalog(scratch_database) == fresh


QUEUE_ON_ITS_OWN_ALIAS = """
import os

from project.settings import *  # noqa: F403

DATABASES = {
    "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ["WQ_TEST_APP_DB"]},
    "queue": env.db_url_config(os.environ["DATABASE_URL"]),  # noqa: F405
}
DATABASE_ROUTERS = ["queue_alias_settings.QueueRouter"]
WORKQUEUE = {**WORKQUEUE, "DATABASE_ALIAS": "queue"}  # noqa: F405


class QueueRouter:
    # The app's tables on "queue"; every other app's on both (the API keys name users).
    def db_for_read(self, model, **hints):
        return "queue" if model._meta.app_label == "workqueue" else None

    db_for_write = db_for_read

    def allow_relation(self, first, second, **hints):
        return True

    def allow_migrate(self, db, app_label, **hints):
        return db == "queue" if app_label == "workqueue" else None
"""


@pytest.mark.processes
@pytest.mark.django_db
def test_a_queue_on_an_alias_of_its_own_migrates_there_and_nowhere_else(scratch_database, tmp_path):
    """Audit helper-136: with the queue on its own alias (``DATABASE_ALIAS`` and a router, as
    workqueue.E006 advises) ``migrate`` of the default database failed at 0025, whose own
    operation dropped constraints whatever the router said (SQLite: a syntax error), and
    after it the grants were renewed on a database the router keeps the app off."""
    (tmp_path / "queue_alias_settings.py").write_text(QUEUE_ON_ITS_OWN_ALIAS)
    env = {
        **subprocess_environment(scratch_database),
        "DJANGO_SETTINGS_MODULE": "queue_alias_settings",
        "PYTHONPATH": f"{tmp_path}:{PROJECT_ROOT}",
        "WQ_TEST_APP_DB": str(tmp_path / "app.sqlite3"),
    }

    for database in ("default", "queue"):
        done = run_manage("migrate", "--database", database, "-v0", env=env)
        assert done.returncode == 0, f"{database}: {done.stdout}\n{done.stderr[-3000:]}"

    assert _scratch_catalog(scratch_database) == _catalog()
    with sqlite3.connect(tmp_path / "app.sqlite3") as app:
        tables = {row[0] for row in app.execute("SELECT name FROM sqlite_master")}
    assert "auth_user" in tables
    assert not {"workqueue_topic", "workqueue_delivery"} & tables


@pytest.mark.processes
@pytest.mark.django_db
def test_migrating_back_before_the_procedures_drops_them_and_forward_again_equals_fresh(
    scratch_database,
):
    fresh = _catalog()
    _migrate(scratch_database)
    _migrate(scratch_database, "workqueue", "0001")
    assert not _scratch_catalog(scratch_database)["functions"]
    _migrate(scratch_database)
    assert _scratch_catalog(scratch_database) == fresh


@pytest.mark.processes
@pytest.mark.django_db
def test_a_database_at_0005_with_its_procedures_upgrades_to_equal_a_fresh_one(scratch_database):
    fresh = _catalog()

    # 0005 as deployed: the old schema, and wq_claim still with its three-argument signature.
    _migrate(scratch_database, "workqueue", "0005")
    with psycopg.connect(scratch_database, autocommit=True) as conn:
        conn.execute(
            "CREATE FUNCTION wq_claim(p_subscription_id uuid, p_lease_owner text, "
            "p_max_rows integer) RETURNS SETOF workqueue_delivery LANGUAGE sql "
            "AS 'SELECT * FROM workqueue_delivery WHERE false'"
        )
    assert _scratch_catalog(scratch_database) != fresh
    _migrate(scratch_database)

    assert _scratch_catalog(scratch_database) == fresh


@pytest.mark.processes
@pytest.mark.django_db
def test_migrating_into_a_schema_whose_name_needs_quoting_installs_working_procedures(
    scratch_database,
):
    # The install names its own objects by schema, in string literals too ('x'::regclass):
    # a quote in the schema's name ended such a literal early and the migration failed.
    schema = '"Team\'s Queue"'
    with psycopg.connect(scratch_database, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f'ALTER DATABASE "{conn.info.dbname}" SET search_path = {schema}')
    _migrate(scratch_database)

    with psycopg.connect(scratch_database, autocommit=True) as conn:
        (installed,) = conn.execute(
            "SELECT count(*) FROM pg_proc WHERE pronamespace = %s::regnamespace "
            "AND proname = 'wq_claim'",
            [schema],
        ).fetchone()
        claimed = conn.execute(
            "SELECT kind FROM wq_claim(gen_random_uuid(), 'host', 1, NULL)"
        ).fetchall()
    assert installed == 1
    assert claimed == []  # an unknown subscription; the body compiled and ran


@pytest.mark.django_db(transaction=True)
def test_installing_drops_procedures_the_files_no_longer_declare():
    with connection.cursor() as cursor:
        cursor.execute("CREATE FUNCTION wq_obsolete() RETURNS integer LANGUAGE sql AS 'SELECT 1'")
    with transaction.atomic():
        get_driver().install_procedures(connection)
    names = [row[0] for row in _catalog()["functions"]]
    assert "wq_obsolete()" not in names
    assert "wq_claim(uuid,text,integer,text,uuid,uuid)" in names


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "installed",
    [
        # A parameter named otherwise, and a default the files no longer give: the changes
        # CREATE OR REPLACE refuses ("cannot change name of input parameter").
        "p_other uuid, p_cap integer",
        "p_subscription_id uuid, p_cap integer DEFAULT 5",
    ],
    ids=["renamed", "default"],
)
def test_installing_over_a_function_it_cannot_replace_recreates_it_with_its_grants(
    pg_conn, installed
):
    """A release whose procedure renamed a parameter (or dropped a default, or changed its
    result) would have stopped its own migrate, rolled back, until someone dropped the old
    function by hand."""
    signature = "wq_backlog(uuid, integer)"
    with database_role(pg_conn, "wq_scaler") as role:
        pg_conn.execute(f"DROP FUNCTION {signature}")
        pg_conn.execute(
            f"CREATE FUNCTION wq_backlog({installed}) "
            "RETURNS TABLE (claimable bigint, in_flight bigint) LANGUAGE sql "
            "AS $$ SELECT 0::bigint, 0::bigint $$"
        )
        pg_conn.execute(f'GRANT EXECUTE ON FUNCTION {signature} TO "{role}"')
        try:
            with transaction.atomic():
                get_driver().install_procedures(connection)
            arguments, granted = pg_conn.execute(
                "SELECT pg_get_function_arguments(%s::regprocedure), "
                "has_function_privilege(%s, %s, 'EXECUTE')",
                [signature, role, signature],
            ).fetchone()
        finally:  # this worker's later tests need the function as the files declare it
            pg_conn.execute(f"DROP FUNCTION IF EXISTS {signature}")
            with transaction.atomic():
                get_driver().install_procedures(connection)

    assert arguments == "p_subscription_id uuid, p_cap integer"
    assert granted is True


@pytest.mark.django_db(transaction=True)
def test_installing_inside_a_savepoint_keeps_what_it_installs():
    # A migrate run inside a transaction (a test that migrates back and forth, a deployment
    # script's atomic block) installs in a savepoint, whose rows carry the subtransaction's id.
    before = {row[0] for row in _catalog()["functions"]}
    with transaction.atomic(), transaction.atomic():
        get_driver().install_procedures(connection)
        get_driver().install_procedures(connection)  # twice in one savepoint: a script's
    assert {row[0] for row in _catalog()["functions"]} == before


@pytest.mark.django_db(transaction=True)
def test_installing_leaves_the_topology_readable_and_writable_until_it_commits():
    # An upgrade reinstalls every procedure in the migrate's transaction. Claims and publishes
    # read workqueue_subscription and workqueue_topic: a lock that stops readers, held until the
    # migrate commits (and queued behind any reader already open), would stall every host.
    params = psycopg_params()
    with psycopg.connect(autocommit=True, **params) as reader:
        reader.execute("SET lock_timeout = '2s'")
        with transaction.atomic():
            get_driver().install_procedures(connection)
            for table in ("workqueue_subscription", "workqueue_topic"):
                reader.execute(f"SELECT count(*) FROM {table}")
                # Nor writers (an operator pausing a subscription in the admin meanwhile).
                reader.execute(f"UPDATE {table} SET name = name WHERE false")


@pytest.mark.django_db
def test_every_call_of_the_previous_release_still_binds_to_the_procedures(pg_conn):
    """A rolling deploy runs the previous release's processes on this release's procedures: each
    call they make (named arguments, the columns they read, as its registry rendered them) must
    still bind. A renamed parameter, a new one without a default, or a dropped column fails to
    bind here; the install itself no longer stops at the first two (it drops and recreates), so
    nothing else would say so before the old processes failed call by call."""
    previous = json.loads((RELEASES / "previous_release_calls.json").read_text("utf-8"))
    failed = {}
    for name, sql in sorted(previous["calls"].items()):
        pieces = sql.split("%s")  # PREPARE numbers its parameters
        prepared = pieces[0] + "".join(f"${n}{piece}" for n, piece in enumerate(pieces[1:], 1))
        try:
            with pg_conn.transaction():
                pg_conn.execute(f"PREPARE wq_previous_call AS {prepared}")
                pg_conn.execute("DEALLOCATE wq_previous_call")
        except psycopg.Error as exc:
            failed[name] = str(exc).splitlines()[0]

    assert failed == {}, f"calls of release {previous['release']} that no longer bind"


def test_only_the_latest_procedure_migration_installs():
    migrations = Path(__file__).resolve().parents[2] / "workqueue" / "migrations"
    installing = sorted(
        path.stem
        for path in migrations.glob("0*.py")
        if re.search(r"install_procedures_step\(", path.read_text())
    )
    assert installing, "some migration must install the procedures"
    assert installing[-1] == LATEST_PROCEDURE_MIGRATION


def test_messages_stored_before_publishers_were_recorded_read_as_published_by_a_key(
    scratch_database,
):
    """Migration 0049 cannot know who published the messages already stored; the Tasks API's
    handler rule reads the column, so they must read as possibly a key's (the safe side), and
    only messages published afterwards as the application's by default."""
    _migrate(scratch_database, "workqueue", "0048")
    before, after = uuid.uuid4(), uuid.uuid4()
    insert = "INSERT INTO workqueue_message (id, publish_ordinal, topic_id) VALUES (%s, %s, %s)"
    with psycopg.connect(scratch_database, autocommit=True) as conn:
        conn.execute(insert, (before, 1, uuid.uuid4()))
    _migrate(scratch_database)
    with psycopg.connect(scratch_database, autocommit=True) as conn:
        conn.execute(insert, (after, 2, uuid.uuid4()))
        stored = dict(
            conn.execute("SELECT id, published_externally FROM workqueue_message").fetchall()
        )
    assert stored == {before: True, after: False}


def test_a_topic_kept_longer_than_the_cap_is_capped_by_the_upgrade(scratch_database):
    """Migration 0053's range needs the rows stored before it inside it: a topic set to keep
    its work "for ever" is set to the longest retention, and the upgrade goes through."""
    _migrate(scratch_database, "workqueue", "0052")
    with psycopg.connect(scratch_database, autocommit=True) as conn:
        transport = conn.execute("SELECT id FROM workqueue_transport LIMIT 1").fetchone()[0]
        conn.execute(
            "INSERT INTO workqueue_topic (id, name, description, transport_id, is_fifo, "
            "retention_days, max_payload_bytes, default_deduplication_ttl_seconds, status, "
            "allow_external_publish) VALUES (%s, 'kept.for-ever', '', %s, false, 4000000, "
            "1024, 3600, 'Active', false)",
            (uuid.uuid4(), transport),
        )
    _migrate(scratch_database)
    with psycopg.connect(scratch_database, autocommit=True) as conn:
        kept = conn.execute(
            "SELECT retention_days FROM workqueue_topic WHERE name = 'kept.for-ever'"
        ).fetchone()
    assert kept == (36_500,)
