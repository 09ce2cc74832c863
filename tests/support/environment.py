"""The suite's environment: what the fail-closed project settings need, said explicitly."""

from __future__ import annotations

import os
import secrets


def prepare() -> None:
    """Set the suite's environment; tests/settings.py calls it before the project's settings
    load. Subprocesses (and xdist workers) inherit it."""
    # Settings must not leak from the developer's shell into the suite.
    for name in [n for n in os.environ if n.startswith("WORKQUEUE_")]:
        if name not in {"WORKQUEUE_LOCALDB_DIR", "WORKQUEUE_TEST_MSSQL_URL"}:
            del os.environ[name]
    # The embedded PostgreSQL, although DEBUG is off (as in production, and as Django's test
    # runner sets it anyway).
    os.environ["WORKQUEUE_LOCALDB"] = "1"
    # Random per run: nothing signed with it outlives the run.
    os.environ.setdefault("DJANGO_SECRET_KEY", secrets.token_urlsafe(50))


def project_environment() -> dict[str, str]:
    """This process's environment without the developer's ``WORKQUEUE_*`` and ``DJANGO_*``
    settings, but with the suite's ``DJANGO_SECRET_KEY`` (project/settings.py refuses to start
    without a real one while ``DEBUG`` is off)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WORKQUEUE_", "DJANGO_"))}
    env["DJANGO_SECRET_KEY"] = os.environ["DJANGO_SECRET_KEY"]
    return env
