"""Shared fixtures: the embedded PostgreSQL (started by project.settings), settings isolation and
a psycopg connection for tests that talk SQL directly."""

from __future__ import annotations

import os
import uuid

import pytest

# Settings must not leak from the developer's shell into the suite.
for _name in [n for n in os.environ if n.startswith("WORKQUEUE_")]:
    if _name not in {"WORKQUEUE_LOCALDB_DIR", "WORKQUEUE_TEST_MSSQL_URL"}:
        del os.environ[_name]


@pytest.fixture
def pg_conn(django_db_setup, django_db_blocker):
    """An autocommit psycopg connection to this worker's test database (procedures installed)."""
    import psycopg

    from tests.database import psycopg_params

    with django_db_blocker.unblock():
        params = psycopg_params()
    with psycopg.connect(autocommit=True, **params) as conn:
        yield conn


@pytest.fixture
def queue_db(transactional_db):
    """Database access for tests that use the driver: the driver works on its own connection, so
    test data must be committed (a transactional test) for it to be seen."""
    from workqueue.driver import get_driver

    yield
    get_driver().close()


@pytest.fixture
def scratch_database(django_db_setup, django_db_blocker):
    """A fresh, empty database on the test server (for a subprocess project to migrate); its
    URL. Dropped afterwards."""
    import psycopg
    from django.db import connection

    from tests.database import psycopg_params

    with django_db_blocker.unblock():
        params = psycopg_params()
        settings = connection.settings_dict
    params["dbname"] = "postgres"
    name = f"wq_scratch_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(autocommit=True, **params) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    user = settings["USER"]
    yield f"postgres://{user}@{settings['HOST']}:{settings['PORT']}/{name}"
    with psycopg.connect(autocommit=True, **params) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def statements(monkeypatch):
    """Every statement the driver sends from now on (its ``execute`` is its only way to the
    database), to show what reached the database and what did not."""
    from workqueue.driver import get_driver

    driver = get_driver()
    sent: list[str] = []
    original = driver.execute

    def counting(sql, values, connection=None):
        sent.append(sql)
        return original(sql, values, connection)

    monkeypatch.setattr(driver, "execute", counting)
    return sent
