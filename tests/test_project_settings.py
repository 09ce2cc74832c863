"""The sample project's settings fail closed (issue 10, items 5 and 12): DEBUG is off unless
asked for, a production process refuses a missing or published SECRET_KEY, and it never starts
the embedded PostgreSQL on its own when DATABASE_URL is missing.

Each case imports ``project.settings`` in a fresh interpreter with a controlled environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from workqueue import localdb

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[1]
# Parsed, never connected to: importing settings opens no connection.
SOME_DATABASE = "postgres://app@/app?host=/nonexistent&port=5432"
A_REAL_KEY = "x7!f" * 16
PUBLISHED_KEYS = {
    "development": "insecure-development-key-used-only-with-DJANGO_DEBUG-on",
    "earlier-default": "insecure-demo-key-change-me-in-production",
}
SHOW = "from django.conf import settings; print(settings.DEBUG, settings.DATABASES['default'])"


def load_settings(**variables: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WORKQUEUE_", "DJANGO_"))}
    env.pop("DATABASE_URL", None)
    env.update(DJANGO_SETTINGS_MODULE="project.settings", **variables)
    return subprocess.run(
        [sys.executable, "-c", SHOW],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def empty_cluster_dir() -> Iterator[Path]:
    # Under /tmp: as root the server runs as 'postgres', which must reach the folder.
    path = Path(tempfile.mkdtemp(prefix="wq-settings-test-", dir="/tmp"))
    try:
        yield path
    finally:
        previous = os.environ.get("WORKQUEUE_LOCALDB_DIR")
        os.environ["WORKQUEUE_LOCALDB_DIR"] = str(path)
        try:
            localdb.destroy()
        finally:
            if previous is None:
                del os.environ["WORKQUEUE_LOCALDB_DIR"]
            else:
                os.environ["WORKQUEUE_LOCALDB_DIR"] = previous


def test_debug_is_off_unless_asked_for():
    done = load_settings(DATABASE_URL=SOME_DATABASE, DJANGO_SECRET_KEY=A_REAL_KEY)

    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("False ")


@pytest.mark.parametrize(
    "key", [None, "", *PUBLISHED_KEYS.values()], ids=["unset", "empty", *PUBLISHED_KEYS]
)
def test_without_debug_a_missing_or_published_secret_key_is_refused(key):
    variables = {"DATABASE_URL": SOME_DATABASE}
    if key is not None:
        variables["DJANGO_SECRET_KEY"] = key

    done = load_settings(**variables)

    assert done.returncode != 0, done.stdout
    assert "ImproperlyConfigured" in done.stderr
    assert "DJANGO_SECRET_KEY" in done.stderr and "DJANGO_DEBUG=1" in done.stderr


def test_with_debug_on_the_development_key_is_allowed():
    done = load_settings(DATABASE_URL=SOME_DATABASE, DJANGO_DEBUG="1")

    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("True ")


def test_without_debug_a_missing_database_url_starts_nothing_and_names_the_fix(
    empty_cluster_dir,
):
    done = load_settings(
        DJANGO_DEBUG="0",
        DJANGO_SECRET_KEY=A_REAL_KEY,
        WORKQUEUE_LOCALDB_DIR=str(empty_cluster_dir),
    )

    assert done.returncode != 0, done.stdout
    assert "DATABASE_URL is not set and DEBUG is off" in done.stderr
    assert "WORKQUEUE_LOCALDB=1" in done.stderr
    assert list(empty_cluster_dir.iterdir()) == []  # no cluster was created


def test_an_unreadable_opt_in_value_is_refused(empty_cluster_dir):
    done = load_settings(
        DJANGO_DEBUG="0",
        DJANGO_SECRET_KEY=A_REAL_KEY,
        WORKQUEUE_LOCALDB_DIR=str(empty_cluster_dir),
        WORKQUEUE_LOCALDB="maybe",
    )

    assert done.returncode != 0, done.stdout
    assert "WORKQUEUE_LOCALDB='maybe' is not understood" in done.stderr
    assert list(empty_cluster_dir.iterdir()) == []


def test_opting_in_starts_the_embedded_database_on_its_private_socket(empty_cluster_dir):
    done = load_settings(
        DJANGO_DEBUG="0",
        DJANGO_SECRET_KEY=A_REAL_KEY,
        WORKQUEUE_LOCALDB_DIR=str(empty_cluster_dir),
        WORKQUEUE_LOCALDB="1",
    )

    assert done.returncode == 0, done.stderr
    socket_dir = str(localdb._socket_dir(Path(os.path.realpath(empty_cluster_dir))))
    assert f"'HOST': '{socket_dir}'" in done.stdout
    assert "'NAME': 'workqueue'" in done.stdout
