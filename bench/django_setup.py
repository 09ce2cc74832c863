"""How every benchmark script starts Django, so each runs on a fresh clone as the README gives it.

The project's settings fail closed. A benchmark runs them with DEBUG off (DEBUG would keep every
query in memory), opts in to the embedded PostgreSQL when DATABASE_URL is unset, and signs
nothing that outlives the run. ``start_django`` only sets Django up, so importing a script (as
``bench/aims.py`` imports ``bench/drain.py``, or ``--help``) touches no database;
``prepare_database``, called once a script has read its arguments, migrates the embedded
database when it is behind (a fresh cluster, say: the benchmarks create topics and
subscriptions of their own, and a traceback about a missing ``auth_user`` table tells nobody
what to run), installs this checkout's procedures there when the ones installed came from
other files (see ``_install_this_checkouts_procedures``), and makes the system user that
benchmarks publish and run handlers as. A database that DATABASE_URL names is never migrated
or reinstalled behind its owner's back: when it is behind, the script stops and says so.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys


def start_django() -> None:
    # Stopped by `timeout` or `kill`, a script ends through its cleanup (each removes the topics
    # it created, with their deliveries), as after Ctrl-C: killed outright, it left them in the
    # database, thousands of pending deliveries that the next `make demo` listed.
    signal.signal(signal.SIGTERM, _stop)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    os.environ.setdefault("WORKQUEUE_LOCALDB", "1")
    os.environ.setdefault("DJANGO_SECRET_KEY", secrets.token_urlsafe(50))

    import django

    django.setup()


def _stop(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def prepare_database() -> None:
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connection)
    if executor.migration_plan(executor.loader.graph.leaf_nodes()):
        _migrate()
    _install_this_checkouts_procedures()
    _ensure_system_user()


def _migrate() -> None:
    from django.core.management import call_command

    if os.environ.get("DATABASE_URL"):
        raise SystemExit(
            "The database DATABASE_URL names is behind this checkout's migrations: run "
            "`python manage.py migrate` against it first, or unset DATABASE_URL to benchmark "
            "the embedded PostgreSQL."
        )
    print("Migrating the embedded database first (manage.py migrate).", file=sys.stderr)
    call_command("migrate", verbosity=0)


def _install_this_checkouts_procedures() -> None:
    """A database migrated before the procedure files last changed without a migration of their
    own (between releases) runs the older bodies, and a benchmark would time those: the
    embedded one gets this checkout's (their stamp says which files were installed)."""
    from django.core.management import call_command

    from workqueue.driver import get_driver

    problem = get_driver().procedures_problem()
    if problem is None:
        return
    if os.environ.get("DATABASE_URL"):
        raise SystemExit(f"{problem} A benchmark would time those procedures, not this checkout's.")
    print(
        "Installing this checkout's procedures in the embedded database first "
        "(manage.py workqueue install-procedures).",
        file=sys.stderr,
    )
    # Its report to standard error, with this one: a script's standard output is its figures.
    call_command("workqueue", "install-procedures", stdout=sys.stderr)


def _ensure_system_user() -> None:
    """The user that publishes, and that hosts' handlers run as, by default (SYSTEM_USER)."""
    from django.contrib.auth import get_user_model

    from workqueue.conf import get_settings

    User = get_user_model()
    User._default_manager.get_or_create(**{User.USERNAME_FIELD: get_settings().SYSTEM_USER})
