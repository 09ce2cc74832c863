"""Shared fixtures: the embedded PostgreSQL (started by project.settings) and a psycopg
connection for tests that talk SQL directly. The suite's environment (settings isolation, the
embedded database opt-in) is set earlier, by tests/settings.py."""

from __future__ import annotations

import uuid

import pytest


@pytest.fixture
def pg_conn(django_db_setup, django_db_blocker):
    """An autocommit psycopg connection to this worker's test database (procedures installed)."""
    import psycopg

    from tests.support.database import psycopg_params

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

    from tests.support.database import database_url, psycopg_params

    name = f"wq_scratch_{uuid.uuid4().hex[:8]}"
    with django_db_blocker.unblock():
        params = psycopg_params()
        url = database_url(name)
    params["dbname"] = "postgres"
    with psycopg.connect(autocommit=True, **params) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    yield url
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
