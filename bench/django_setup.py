"""How every benchmark script starts Django, so each runs on a fresh clone as the README gives it.

The project's settings fail closed. A benchmark runs them with DEBUG off (DEBUG would keep every
query in memory), opts in to the embedded PostgreSQL when DATABASE_URL is unset, and signs
nothing that outlives the run. A database whose migrations are behind (a fresh embedded cluster,
say) is migrated first: the benchmarks create topics and subscriptions of their own, and a
traceback about a missing ``auth_user`` table tells nobody what to run.
"""

from __future__ import annotations

import os
import secrets
import sys


def start_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    os.environ.setdefault("WORKQUEUE_LOCALDB", "1")
    os.environ.setdefault("DJANGO_SECRET_KEY", secrets.token_urlsafe(50))

    import django

    django.setup()

    from django.core.management import call_command
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connection)
    if executor.migration_plan(executor.loader.graph.leaf_nodes()):
        print("Migrating the benchmark's database first (manage.py migrate).", file=sys.stderr)
        call_command("migrate", verbosity=0)
