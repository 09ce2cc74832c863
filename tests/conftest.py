"""Shared fixtures: the embedded PostgreSQL (started by project.settings), a psycopg connection
for tests that talk SQL directly, scratch databases and private clusters, hosts in this process
and as processes. The suite's environment (settings isolation, the embedded database opt-in) is
set earlier, by tests/settings.py; the helpers behind these fixtures are in tests/support/."""

from __future__ import annotations

import gc
import inspect
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session", autouse=True)
def cheap_transactional_reset() -> Iterator[None]:
    """Transactional tests end with tests.support.reset's row deletes instead of Django's
    flush, where those leave the same database (about 0.15 s less a test)."""
    from tests.support.reset import install

    undo = install()
    yield
    undo()


@pytest.fixture(autouse=True)
def drivers_as_their_classes_make_them() -> Iterator[None]:
    """A test's ``monkeypatch.setattr(driver, "call", ...)`` on the cached driver is undone by
    setting the method it read back on the instance, where it shadows the class for the rest
    of the worker: a later test's patch of ``PostgresDriver.open_listener`` was never called
    (it failed in full runs only, after the test that patched the instance). Those leftovers
    go before each test (after it, the test's monkeypatch may not have been undone yet)."""
    from workqueue import driver as drivers

    for cached in list(drivers._drivers.values()):
        for name, value in list(vars(cached).items()):
            if (
                inspect.ismethod(value)
                and value.__self__ is cached
                and getattr(type(cached), name, None) is value.__func__
            ):
                delattr(cached, name)
    yield


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
def truncated_queue_tables(pg_conn) -> None:
    """The queue tables as a fresh install has them, not as the suite's reset after the last
    test leaves them (rows deleted, their pages and dead-row counts still there): for tests
    of plans, the pages and rows they read, and table statistics."""
    from workqueue.driver.base import QUEUE_TABLES

    pg_conn.execute(f"TRUNCATE {', '.join(QUEUE_TABLES)}")


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


@pytest.fixture
def private_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A throwaway PostgreSQL cluster of this test's own (its URL), for tests that stop or
    restart the server: nothing else in the suite is disturbed. Destroyed afterwards."""
    from workqueue import localdb

    # Under /tmp, not tmp_path: as root the server runs as 'postgres', which must reach it.
    path = Path(tempfile.mkdtemp(prefix="wq-cluster-test-", dir="/tmp"))
    monkeypatch.setenv("WORKQUEUE_LOCALDB_DIR", str(path))
    try:
        yield localdb.ensure_running()
    finally:
        localdb.destroy()


@pytest.fixture
def make_host(queue_db, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Any]]:
    """Build hosts in this process with the private test registry, fast polling and no
    background services; shut them all down after."""
    from django.contrib.auth import get_user_model

    from tests.support.handlers import probe, registry
    from tests.support.hosts import listening_sessions, runtime_threads
    from tests.support.waiting import wait_until
    from workqueue.driver import get_driver
    from workqueue.runtime import wakeup
    from workqueue.runtime.host import Host, HostConfig

    # The notification listener looks at its stop flag (and re-reads its channels) between
    # waits of POLL_SECONDS: at the 0.5 s default every host's shutdown waited out most of one,
    # a minute of the suite. A test that needs the wider window sets its own after this.
    monkeypatch.setattr(wakeup, "POLL_SECONDS", 0.05)
    probe.reset()
    get_user_model().objects.create_user("workqueue-system")
    hosts: list[Host] = []

    def make(subscriptions: list[dict[str, Any]], **config: Any) -> Host:
        settings = {
            "idle_poll_min_ms": 50,
            "idle_poll_max_ms": 200,
            "shutdown_drain_ms": 300,
            "sweeper_interval_ms": 0,
            "reconcile_interval_ms": 0,
            **config,
        }
        host = Host(HostConfig(subscriptions=subscriptions, **settings), registry=registry)
        hosts.append(host)
        return host

    yield make
    for host in hosts:
        host.shutdown()  # idempotent; harmless on a host that never started
    wait_until(lambda: not runtime_threads(), timeout=15)
    # A listener's session outlives its close for a moment on the server (under load, for
    # longer): the next test's search for its host's listener (listener_pid) must not find it.
    settled_by = time.monotonic() + 5
    while listening_sessions() and time.monotonic() < settled_by:
        time.sleep(0.02)
    gc.collect()
    get_driver().close()


@pytest.fixture
def processes(queue_db, tmp_path: Path) -> Iterator[Any]:
    """Starts ``manage.py`` commands (hosts, one-shot jobs) against the test database as
    :class:`tests.support.processes.Processes`; kills whatever is left at the end."""
    from django.contrib.auth import get_user_model

    from tests.support.processes import SYSTEM_USER, Processes
    from workqueue.driver import get_driver

    get_user_model().objects.create_user(SYSTEM_USER)
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.close()
        get_driver().close()


@pytest.fixture(scope="session")
def aws_server() -> Iterator[Any]:
    """SNS and SQS for the AWS transport: moto's standalone server on 127.0.0.1 for the whole
    session (real AWS with WORKQUEUE_TEST_AWS_REGION set); skips when moto is not installed."""
    from tests.support.aws import REAL_AWS_REGION, aws_endpoint, moto_server_command

    if not os.environ.get(REAL_AWS_REGION) and moto_server_command() is None:
        pytest.skip("moto[server] is not installed: pip install -r requirements.txt")
    with aws_endpoint() as endpoint:
        yield endpoint


@pytest.fixture
def aws_endpoint(aws_server, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The session's AWS endpoint, with boto3 clients of this test's own. The transport keeps
    one set of clients per configuration for the life of the process, and each test's fresh
    prefix is a configuration: some 30,000 objects each (botocore's service models), which
    every later full garbage collection of the worker walked, 2 s a host teardown by the end."""
    from workqueue.transports import aws

    monkeypatch.setattr(aws, "_clients", {})
    return aws_server
