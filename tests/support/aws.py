"""A local SNS + SQS endpoint for the AWS transport's tests: moto's standalone server
(``moto_server``) as a subprocess on 127.0.0.1 and a free port, reached through real boto3
HTTP calls, the way the embedded PostgreSQL stands in for a database server.

With ``WORKQUEUE_TEST_AWS_REGION`` set (and credentials in the usual boto3 places), the same
tests run against real AWS instead: no server is started and resources are named with a
random prefix. Never in CI.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REAL_AWS_REGION = "WORKQUEUE_TEST_AWS_REGION"
EMULATOR_REGION = "eu-west-1"
# moto accepts any credentials; these only keep boto3 from looking for real ones.
EMULATOR_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


@dataclass(frozen=True, slots=True)
class AwsEndpoint:
    """Where the AWS transport's tests send SNS and SQS calls."""

    region: str
    #: None for real AWS.
    endpoint_url: str | None

    @property
    def emulated(self) -> bool:
        return self.endpoint_url is not None

    def configuration(self, prefix: str | None = None) -> dict[str, Any]:
        """A ``Transport.configuration`` for this endpoint with a fresh resource prefix."""
        found: dict[str, Any] = {
            "region": self.region,
            "prefix": prefix or f"wqt{uuid.uuid4().hex[:8]}",
        }
        if self.endpoint_url is not None:
            found["endpoint_url"] = self.endpoint_url
        return found

    def environment(self) -> dict[str, str]:
        """What a subprocess needs to reach the endpoint with boto3."""
        return dict(EMULATOR_CREDENTIALS) if self.emulated else {}


def moto_server_command() -> list[str] | None:
    """How to start moto's standalone server here, or None when moto[server] is missing."""
    beside = Path(sys.executable).with_name("moto_server")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("moto_server")
    return [found] if found else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def moto_server(timeout: float = 30) -> Iterator[AwsEndpoint]:
    """Run ``moto_server`` on 127.0.0.1 and a free port until the block ends."""
    command = moto_server_command()
    if command is None:
        raise RuntimeError("moto_server is not installed: pip install 'moto[server]'.")
    port = _free_port()
    process = subprocess.Popen(
        [*command, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{url}/moto-api/", timeout=1):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start on port {port}.") from None
                time.sleep(0.1)
        yield AwsEndpoint(EMULATOR_REGION, url)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def aws_endpoint() -> Iterator[AwsEndpoint]:
    """Real AWS when ``WORKQUEUE_TEST_AWS_REGION`` is set, else a moto server."""
    region = os.environ.get(REAL_AWS_REGION)
    if region:
        yield AwsEndpoint(region, None)
        return
    previous = {k: os.environ.get(k) for k in EMULATOR_CREDENTIALS}
    os.environ.update(EMULATOR_CREDENTIALS)
    try:
        with moto_server() as endpoint:
            yield endpoint
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
