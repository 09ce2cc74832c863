"""Parsing T-SQL offline with Microsoft's own parser (the ``maxdop`` package, pinned in
requirements.txt), or ``sqlfluff`` where maxdop's binary cannot run: no SQL Server runs here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SQL_DIR = Path(__file__).resolve().parents[2] / "workqueue" / "sql" / "sqlserver"
PARSER_VERSION = "2022"
# The oldest grammar the files must also parse under: SQL Server 2016 SP1 brought CREATE OR ALTER
# (OPENJSON, STRING_ESCAPE and DATEDIFF_BIG are 2016 too; database compatibility level >= 130).
OLDEST_PARSER_VERSION = "2016"


def _tool(name: str) -> str | None:
    beside_python = Path(sys.executable).with_name(name)
    if beside_python.exists() and os.access(beside_python, os.X_OK):
        return str(beside_python)
    return shutil.which(name)


def parse_tsql(
    path: Path, *, prefer: str = "maxdop", version: str = PARSER_VERSION
) -> subprocess.CompletedProcess[str]:
    """Parse ``path`` with maxdop (or, where it cannot run, sqlfluff); never rewrites the file.

    Returns the finished process; ``returncode`` 0 means every batch parsed.
    """
    maxdop = _tool("maxdop") if prefer == "maxdop" else None
    if maxdop is not None:
        return subprocess.run(
            [maxdop, "--parser-version", version, str(path)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    sqlfluff = _tool("sqlfluff")
    if sqlfluff is None:
        pytest.fail("Neither maxdop nor sqlfluff is installed: pip install -r requirements.txt")
    result = subprocess.run(
        [sqlfluff, "parse", "--dialect", "tsql", "--nofail", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if "unparsable" in result.stdout or result.returncode != 0:
        return subprocess.CompletedProcess(result.args, 1, result.stdout, result.stderr)
    return result
