"""The suite's environment: what the fail-closed project settings need, said explicitly."""

from __future__ import annotations

import os


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
