"""A PgBouncer in transaction pooling in front of the test database.

Debian 12's pgbouncer is 1.18: before 1.21 it keeps no prepared statement for its clients, so a
statement a client prepares lives on whichever server connection parsed it, where any client
whose calls reach that server connection later can bind to it by name. Installed with the test
suite's system packages (``.ci/install-system-packages --for-tests``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

from tests.support.database import psycopg_params

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def transaction_pooler(pool_size: int = 2) -> Iterator[dict[str, Any]]:
    """Run a PgBouncer (transaction pooling, ``pool_size`` server connections, the most recently
    released one handed out first) in front of the test database; yield the psycopg connection
    parameters that go through it."""
    if not Path(PGBOUNCER).exists():
        raise RuntimeError(
            "pgbouncer is not installed: run .ci/install-system-packages --for-tests "
            "(apt-get install pgbouncer)"
        )
    params = psycopg_params()
    port = _free_port()
    folder = Path(tempfile.mkdtemp(prefix="wq-pgbouncer-"))
    user = params.get("user") or "postgres"
    (folder / "users.txt").write_text(f'"{user}" ""\n')
    (folder / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={params['host']} port={params.get('port') or 5432}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {folder / 'users.txt'}\n"
        f"pool_mode = transaction\ndefault_pool_size = {pool_size}\n"
        "server_round_robin = 0\n"
        f"logfile = {folder / 'pgbouncer.log'}\npidfile = {folder / 'pgbouncer.pid'}\n"
    )
    command = [PGBOUNCER, str(folder / "pgbouncer.ini")]
    if os.geteuid() == 0:
        # PgBouncer will not run as root; -u makes it drop to the database's owner.
        shutil.chown(folder, "postgres")
        for path in folder.iterdir():
            shutil.chown(path, "postgres")
        command[1:1] = ["-u", "postgres"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    pooled = {**params, "host": "127.0.0.1", "port": port}
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                psycopg.connect(**pooled, autocommit=True).close()
                break
            except psycopg.OperationalError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"pgbouncer did not start: {process.stderr.read().decode()[-2000:]}"
                    ) from None
                time.sleep(0.05)
        yield pooled
    finally:
        process.terminate()
        process.communicate(timeout=10)  # waits, and closes the stderr pipe
        shutil.rmtree(folder, ignore_errors=True)
