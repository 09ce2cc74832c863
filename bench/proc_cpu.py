"""CPU time of a local process from /proc, for the benchmarks that report PostgreSQL backend CPU
per message or delivery (the server must run on this machine)."""

from __future__ import annotations

import os

TICKS = os.sysconf("SC_CLK_TCK")


def backend_cpu_seconds(pid: int) -> float | None:
    """User + system CPU of a local PostgreSQL backend, or None when it is not readable."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS
