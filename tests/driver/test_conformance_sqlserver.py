"""The transport conformance suite (C01-C47) against SQL Server, when one is configured.

Runs only when ``WORKQUEUE_TEST_MSSQL_URL`` is set *and* the settings define a database alias
``mssql`` built from it (pytest-django then creates its test database); otherwise every test is
skipped with the reason shown.
"""

from __future__ import annotations

import re

import pytest

from tests.support.database import MSSQL_ALIAS, mssql_skip_reason
from workqueue.testing.conformance import CASES, ConformanceFailure, execute_case

#: Cases failing on SQL Server because of a bug outside the suite: id -> "file:line, case, fix".
KNOWN_BUGS: dict[str, str] = {}


SKIP_REASON = mssql_skip_reason()
if SKIP_REASON is not None:
    pytestmark = pytest.mark.skip(reason=SKIP_REASON)
else:
    pytestmark = pytest.mark.django_db(transaction=True, databases=["default", MSSQL_ALIAS])


def _case_params() -> list[object]:
    params = []
    for case in CASES:
        marks = []
        if case.id in KNOWN_BUGS:
            marks.append(
                pytest.mark.xfail(
                    reason=KNOWN_BUGS[case.id], raises=ConformanceFailure, strict=True
                )
            )
        slug = re.sub(r"[^a-z0-9]+", "-", case.name.lower()).strip("-")
        params.append(pytest.param(case, id=f"{case.id}-{slug}", marks=marks))
    return params


@pytest.fixture
def mssql_driver():
    from workqueue.driver import get_driver

    driver = get_driver(MSSQL_ALIAS)
    yield driver
    driver.close()


@pytest.mark.parametrize("case", _case_params())
def test_sqlserver_transport_meets_conformance_case(case, mssql_driver):
    execute_case(case, alias=MSSQL_ALIAS)
