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
}


@pytest.mark.parametrize("command", COMMANDS.values(), ids=COMMANDS.keys())
def test_a_command_before_migrate_says_to_run_migrate(scratch_database, command):
    done = run_manage(*command, env=subprocess_environment(scratch_database), timeout=60)

    assert done.returncode == 1, done.stdout + done.stderr
    assert "is not migrated" in done.stderr and "Run `manage.py migrate`" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("command", COMMANDS.values(), ids=COMMANDS.keys())
def test_a_command_against_a_database_that_is_not_there_says_so_in_a_line(tmp_path, command):
    nowhere = f"postgres://postgres@/workqueue?host={tmp_path}&port=5432"

    done = run_manage(*command, env=subprocess_environment(nowhere), timeout=60)

    assert done.returncode == 1, done.stdout + done.stderr
    assert "check that it runs and that DATABASE_URL" in done.stderr or (
        "TransportUnavailable" in done.stderr  # a publish: retryable, as the README says
    ), done.stderr
    assert "Traceback" not in done.stderr, done.stderr
