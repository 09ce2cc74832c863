"""Network paths to the test database that can go silent, for tests of dead-peer detection.

A database that vanishes without closing its connections (a failover behind a load balancer
that forgets old flows, a network path that drops) cannot be made on the loopback interface:
the kernel answers for both ends there. Here each path is a veth pair into a network namespace
of the test's own, where a small forwarder hands each TCP connection to the server's Unix
socket (the filesystem is shared across network namespaces). Taking a path's far end down
makes every connection on it silent, exactly as a peer that is gone: what is sent is never
acknowledged, and nothing is refused. Connections made over another path are unaffected, as
after a failover to a new address.

Needs root and iproute2 (``ip``); CI runs as root. Tests skip where either is missing.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PORT = 5432

# Runs in the namespace: accepts on each path's address, pipes each connection to the server.
FORWARDER = """
import socket, sys, threading

def pipe(source, sink):
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for end in (source, sink):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

def serve(listener, server_socket):
    while True:
        client, _ = listener.accept()
        server = socket.socket(socket.AF_UNIX)
        server.connect(server_socket)
        threading.Thread(target=pipe, args=(client, server), daemon=True).start()
        threading.Thread(target=pipe, args=(server, client), daemon=True).start()

server_socket, port, *addresses = sys.argv[1:]
for address in addresses:
    listener = socket.create_server((address, int(port)))
    threading.Thread(target=serve, args=(listener, server_socket), daemon=True).start()
print("ready", flush=True)
sys.stdin.read()  # until the test closes it
"""


@dataclass
class SilentNetwork:
    """Paths ``a``, ``b`` … to one database server; each reached at ``address(path)``:``PORT``."""

    namespace: str
    paths: dict[str, tuple[str, str]] = field(default_factory=dict)  # path: (far end, address)

    def address(self, path: str) -> str:
        return self.paths[path][1]

    def go_silent(self, path: str) -> None:
        """Every connection over ``path`` stops hearing anything back, and new ones cannot
        reach the server."""
        far_end, _ = self.paths[path]
        _ip("netns", "exec", self.namespace, "ip", "link", "set", far_end, "down")


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


@contextmanager
def silent_network(
    server_socket: Path, paths: tuple[str, ...] = ("a", "b")
) -> Iterator[SilentNetwork]:
    """Paths to the server listening on ``server_socket`` (its ``.s.PGSQL.<port>`` file),
    torn down afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("a silent network path needs root and iproute2 (ip)")
    tag = f"{os.getpid() % 100_000}"
    network = SilentNetwork(namespace=f"wq-silent-{tag}")
    try:
        _ip("netns", "add", network.namespace)
    except RuntimeError as exc:
        pytest.skip(f"cannot make a network namespace here: {exc}")
    forwarder = None
    near_ends: list[str] = []
    try:
        try:
            _ip("link", "add", f"wqs{tag}p0", "type", "veth", "peer", "name", f"wqs{tag}p1")
        except RuntimeError as exc:
            pytest.skip(f"cannot make veth pairs here: {exc}")
        _ip("link", "del", f"wqs{tag}p0")
        prefixes = _free_prefixes(len(paths))
        for path, prefix in zip(paths, prefixes, strict=True):
            near_end, far_end = f"wqs{tag}{path}0", f"wqs{tag}{path}1"
            _ip("link", "add", near_end, "type", "veth", "peer", "name", far_end)
            near_ends.append(near_end)
            _ip("link", "set", far_end, "netns", network.namespace)
            _ip("addr", "add", f"{prefix}.1/30", "dev", near_end)
            _ip("link", "set", near_end, "up")
            inside = ("netns", "exec", network.namespace, "ip")
            _ip(*inside, "addr", "add", f"{prefix}.2/30", "dev", far_end)
            _ip(*inside, "link", "set", far_end, "up")
            network.paths[path] = (far_end, f"{prefix}.2")
        forwarder = subprocess.Popen(
            ["ip", "netns", "exec", network.namespace, sys.executable, "-c", FORWARDER]
            + [str(server_socket), str(PORT)]
            + [address for _, address in network.paths.values()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert forwarder.stdout is not None and forwarder.stdout.readline() == "ready\n"
        yield network
    finally:
        if forwarder is not None:
            forwarder.kill()
            forwarder.communicate(timeout=10)  # reaps it and closes its pipes
        # A namespace outlives its name while connections in it still wait on a silent path,
        # and its far ends with it: delete the pairs from this end. Best effort, so that a
        # failure here never hides the test's own.
        for args in [("link", "del", near_end) for near_end in near_ends] + [
            ("netns", "del", network.namespace)
        ]:
            subprocess.run(["ip", *args], capture_output=True)


def _free_prefixes(count: int) -> list[str]:
    """``count`` /30 networks 10.213.<n>.0 that no interface of this machine uses (another
    test run's paths included), as ``10.213.<n>``."""
    listed = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True)
    taken = set(re.findall(r"inet 10\.213\.(\d+)\.", listed.stdout))
    start = random.randrange(256)
    free = [f"10.213.{n % 256}" for n in range(start, start + 256) if str(n % 256) not in taken]
    if len(free) < count:
        pytest.skip("no free 10.213.x.0/30 networks for silent paths")
    return free[:count]
