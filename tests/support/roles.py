"""Real database roles for the security tests: create one, connect as it, drop it again."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from tests.support.database import psycopg_params


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
