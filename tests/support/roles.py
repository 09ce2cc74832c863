"""Real database roles for the security tests: create one, connect as it, drop it again."""

from __future__ import annotations

import io
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import psycopg
from django.core.management import call_command
from django.db import connections

from tests.support.database import psycopg_params, queue_connection_settings
from workqueue.driver import get_driver


@contextmanager
def database_role(admin: psycopg.Connection, prefix: str) -> Iterator[str]:
    """A new LOGIN role (no privileges of its own) named ``<prefix>_<random>``; dropped, with
    everything it owns and every privilege it holds, when the block ends."""
    role = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin.execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        yield role
    finally:
        admin.execute(f'DROP OWNED BY "{role}" CASCADE')
        admin.execute(f'DROP ROLE "{role}"')


def connect_as(role: str) -> psycopg.Connection:
    """An autocommit connection to the test database as ``role``."""
    params = psycopg_params()
    params["user"] = role
    return psycopg.connect(autocommit=True, **params)


@contextmanager
def queue_connections_as(role: str) -> Iterator[None]:
    """The queue alias's connections, Django's and the queue's own, opened as ``role`` while
    the block runs (as a host or web process with that role's grants). Those open before and
    after are closed, so none crosses into or out of the block."""
    driver = get_driver()
    connections[driver.alias].close()
    driver.close_all()
    try:
        with queue_connection_settings(options={}, USER=role):
            try:
                yield
            finally:
                driver.close_all()
    finally:
        driver.close_all()


@contextmanager
def acting_as_granted_role(
    admin: psycopg.Connection, prefix: str, grant: str, revoked: Iterable[str] = ()
) -> Iterator[str]:
    """A new role given ``manage.py workqueue <grant>`` (``grant-runtime``, ``grant-operator``)
    less EXECUTE on the procedures ``revoked`` (as after an upgrade whose grants were not run
    again), with the queue alias's connections opened as it while the block runs."""
    with database_role(admin, prefix) as role:
        call_command("workqueue", grant, role, stdout=io.StringIO())
        for procedure in revoked:
            admin.execute(f'REVOKE EXECUTE ON FUNCTION {procedure} FROM "{role}"')
        with queue_connections_as(role):
            yield role
