"""A new project's first mistakes, as real processes: commands run against a database nobody
migrated, or one that cannot be reached, exit with one line naming the fix (`migrate`, the
DATABASE_URL), not a traceback through the ORM (helper-113's first-hour review: `workqueue_host`
printed 95 lines, or said only that `auth_user` did not exist; `workqueue publish` that
function wq_publish did not exist; `workqueue stats` that a relation did not exist)."""

from __future__ import annotations

import pytest

from tests.support.processes import run_manage, subprocess_environment

pytestmark = pytest.mark.processes

COMMANDS = {
    "host": ("workqueue_host",),
    "one-shot": ("workqueue_work", "-s", "orders.billing", "--once"),
    "stats": ("workqueue", "stats"),
    "publish": ("workqueue", "publish", "--topic", "orders.created", "--payload", "{}"),
    # A sweep job printed the driver's traceback (review helper-204).
    "sweep": ("workqueue_sweep", "--once"),
}


@pytest.mark.parametrize("command", COMMANDS.values(), ids=COMMANDS.keys())
def test_a_command_before_migrate_says_to_run_migrate(scratch_database, command):
    done = run_manage(*command, env=subprocess_environment(scratch_database), timeout=60)

    assert done.returncode == 1, done.stdout + done.stderr
    assert "is not migrated" in done.stderr and "Run `manage.py migrate`" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr


# Nobody listens at either. SQL Server: from Django 6.1 on, a command's system checks hand
# every alias to the model checks, and a JSONField's check asks a SQL Server alias for its
# version: the connection failed there, before the command could retry it or say what to do,
# in a traceback of a hundred lines (review helper-203); the queue's commands check no
# database. A refused connection takes that driver's whole login timeout (15 s by default): 1 s.
NOWHERE = {
    "postgresql": "postgres://postgres@/workqueue?host={tmp_path}&port=5432",
    "sqlserver": "mssql://scaler:x@127.0.0.1:9/app?python_driver=mssql_python&connection_timeout=1",
}


@pytest.mark.parametrize("vendor", NOWHERE)
@pytest.mark.parametrize("command", COMMANDS.values(), ids=COMMANDS.keys())
def test_a_command_against_a_database_that_is_not_there_says_so_in_a_line(
    tmp_path, command, vendor
):
    nowhere = NOWHERE[vendor].format(tmp_path=tmp_path)

    done = run_manage(*command, env=subprocess_environment(nowhere), timeout=90)

    assert done.returncode == 1, done.stdout + done.stderr
    assert "check that it runs and that DATABASE_URL" in done.stderr or (
        "TransportUnavailable" in done.stderr  # a publish: retryable, as the README says
    ), done.stderr
    assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("command", COMMANDS.values(), ids=COMMANDS.keys())
def test_a_command_whose_odbc_driver_is_missing_says_how_to_get_one_in_a_line(command):
    """mssql-django's default, pyodbc, needs Microsoft's ODBC driver installed: without it
    every command died in a traceback of pyodbc's own Error, which no retry mends."""
    import pyodbc

    nowhere = "mssql://scaler:x@127.0.0.1:9/app?connection_timeout=1"

    done = run_manage(*command, env=subprocess_environment(nowhere), timeout=90)

    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    if any("SQL Server" in driver for driver in pyodbc.drivers()):
        assert "check that it runs and that DATABASE_URL" in done.stderr, done.stderr
    else:
        assert "ODBC driver could not be loaded" in done.stderr, done.stderr
        assert "msodbcsql18" in done.stderr and "python_driver" in done.stderr, done.stderr


@pytest.fixture
def queue_not_migrated(scratch_database: str) -> str:
    """A database where Django's own apps are migrated and the system user exists, but the
    work queue is not: its app left out of a migrate, or added to INSTALLED_APPS after."""
    env = subprocess_environment(scratch_database)
    run_manage("migrate", "auth", "-v0", env=env, check=True)
    run_manage("workqueue", "create-system-user", env=env, check=True)
    return scratch_database


@pytest.mark.parametrize(
    ("command", "code"),
    [(COMMANDS["host"], 1), (COMMANDS["one-shot"], 2), (COMMANDS["stats"], 1)],
    ids=["host", "one-shot", "stats"],
)
def test_a_command_on_a_database_without_the_queues_tables_says_to_run_migrate(
    queue_not_migrated, command, code
):
    """The host started, ran nothing and logged a failed planning with a traceback at every
    re-plan; the one-shot job exited 2 with "Could not plan the subscriptions:
    ProgrammingError" (helper-115's review)."""
    done = run_manage(*command, env=subprocess_environment(queue_not_migrated), timeout=60)

    assert done.returncode == code, done.stdout + done.stderr
    assert "migrate" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_one_shot_job_on_a_database_an_upgrade_did_not_migrate_says_to_run_migrate(
    scratch_database,
):
    """New code on a database still at an early release (a deploy that skipped `migrate`):
    planning read a column not there yet and the job exited 2 with "Could not plan the
    subscriptions: ProgrammingError: column ... does not exist" (helper-116's review)."""
    env = subprocess_environment(scratch_database)
    run_manage("migrate", "auth", "-v0", env=env, check=True)
    run_manage("migrate", "workqueue", "0006_claim_key_walk", "-v0", env=env, check=True)
    run_manage("workqueue", "create-system-user", env=env, check=True)

    done = run_manage(*COMMANDS["one-shot"], env=env, timeout=60)

    assert done.returncode == 2, done.stdout + done.stderr
    assert "is not migrated" in done.stderr and "Run `manage.py migrate`" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("call", "refused_with"),
    [
        ("from tests.task_functions import add\n    add.enqueue(1, 2)", "TaskEnqueueError"),
        (
            "from workqueue import publish\n    publish('orders.created', {'order': 1})",
            "WorkQueueConfigurationError",
        ),
    ],
    ids=["enqueue", "publish"],
)
def test_publishing_from_code_on_a_database_without_the_queues_tables_says_to_run_migrate(
    queue_not_migrated, call, refused_with
):
    """The enqueue's first step, making the queue's topic, met the missing table and its
    error said to look at the role's privileges (helper-120); ``publish()`` from a view or a
    shell gave the database's own words, that function wq_publish(p_topic_name => text, ...)
    did not exist, with a hint about type casts (audit helper-136)."""
    code = (
        f"try:\n    {call}\n"
        "except Exception as refused:\n    print(type(refused).__name__, refused)\n"
    )

    done = run_manage(
        "shell", "-c", code, env=subprocess_environment(queue_not_migrated), timeout=60
    )

    (said,) = [line for line in done.stdout.splitlines() if "Error" in line]
    assert said.startswith(f"{refused_with} The database 'default' is not migrated"), said
    assert "Run `manage.py migrate`" in said and "privilege" not in said
