"""Every SQL Server procedure file parses with Microsoft's own T-SQL parser.

No SQL Server runs here, so syntax is proven statically: the ``maxdop`` package (pinned in
requirements.txt) embeds Microsoft's ScriptDom parser, and ``maxdop --parser-version 2022 FILE``
exits 1 with line:column when any batch of FILE does not parse (its ``--check`` mode is not used:
that also fails on mere formatting). When the maxdop binary is not available for this platform,
``sqlfluff parse --dialect tsql`` is the fallback. Neither checks names, types or locking; the
parity test and a live server do the rest.
"""

from __future__ import annotations

import pytest

from tests.support.tsql import OLDEST_PARSER_VERSION, PARSER_VERSION, SQL_DIR, parse_tsql
from workqueue.sql import INSTALL_ORDER


@pytest.mark.parametrize("version", [PARSER_VERSION, OLDEST_PARSER_VERSION])
@pytest.mark.parametrize("name", INSTALL_ORDER)
def test_tsql_file_parses_with_microsofts_parser(name, version):
    path = SQL_DIR / f"{name}.sql"
    result = parse_tsql(path, version=version)
    assert result.returncode == 0, f"{path.name} does not parse ({version}):\n{result.stderr}"


def test_a_broken_tsql_file_is_rejected(tmp_path):
    # The check must bite: one misplaced keyword inside one procedure fails the whole file.
    broken = tmp_path / "settle.sql"
    text = (SQL_DIR / "settle.sql").read_text("utf-8")
    broken.write_text(text.replace("OUTPUT inserted.id INTO @changed", "OUTPUT INTO @changed", 1))
    result = parse_tsql(broken)
    assert result.returncode == 1, result.stdout[-2000:]


@pytest.mark.parametrize("break_it", [False, True], ids=["intact", "broken"])
def test_sqlfluff_fallback_accepts_good_and_rejects_broken_tsql(tmp_path, break_it):
    path = tmp_path / "settle.sql"
    text = (SQL_DIR / "settle.sql").read_text("utf-8")
    if break_it:
        text = text.replace("OUTPUT inserted.id INTO @changed", "OUTPUT INTO @changed", 1)
    path.write_text(text, "utf-8")
    result = parse_tsql(path, prefer="sqlfluff")
    assert result.returncode == (1 if break_it else 0), result.stdout[-2000:]


def test_every_tsql_batch_sets_nocount_and_xact_abort():
    # Procedures must not leak row-count messages ahead of their result set and must roll back
    # whole on any error.
    from workqueue.driver.sqlserver import split_batches

    for name in INSTALL_ORDER:
        for batch in split_batches((SQL_DIR / f"{name}.sql").read_text("utf-8")):
            if "CREATE OR ALTER PROCEDURE" in batch:
                assert "SET NOCOUNT ON;" in batch and "SET XACT_ABORT ON;" in batch, (
                    f"{name}.sql: {batch.splitlines()[0]}"
                )


def test_tsql_files_avoid_the_banned_constructs():
    # One clock, no dynamic SQL, nothing mssql-django would rewrite, no sp_ prefix.
    for name in INSTALL_ORDER:
        text = (SQL_DIR / f"{name}.sql").read_text("utf-8")
        code = "\n".join(line.split("--", 1)[0] for line in text.splitlines())
        upper = code.upper()
        for banned in (
            "GETDATE(",
            "SYSDATETIME()",
            "SYSUTCDATETIME(",
            "GETUTCDATE(",
            "CURRENT_TIMESTAMP",
        ):
            assert banned not in upper, f"{name}.sql uses {banned}"
        for banned in ("SP_EXECUTESQL", "EXEC (", "EXEC(", "EXECUTE (", "EXECUTE("):
            assert banned not in upper, f"{name}.sql uses dynamic SQL ({banned})"
        assert "%s" not in text, f"{name}.sql contains %s"
        assert "PROCEDURE DBO.SP_" not in upper, f"{name}.sql names a procedure sp_..."
