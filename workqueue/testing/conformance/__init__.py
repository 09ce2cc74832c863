"""The transport conformance suite: one set of behaviour cases (C01-C47) run against every driver.

Each case creates its own topic and subscriptions, drives the transport through
``workqueue.transport`` and ``workqueue.publishing`` exactly as a consumer or operator would
(C45 and C46 call the claim procedure itself, to drop an answer as a lost connection does), and
removes everything it created. Run them with :func:`run_conformance`; print the outcome
with :func:`format_table`.
"""

from __future__ import annotations

# Importing the area modules registers their cases in CASES.
from workqueue.testing.conformance import (
    claim,
    operators,
    partitions,
    publish,
    scheduling,
    settle,
)
from workqueue.testing.conformance.harness import (
    DATABASE_TRAITS,
    CaseContext,
    ConformanceFailure,
    TransportTraits,
    case_context,
)
from workqueue.testing.conformance.registry import CASES, Case, CaseRegistry
from workqueue.testing.conformance.runner import (
    CaseResult,
    all_passed,
    execute_case,
    format_table,
    run_case,
    run_conformance,
)

del claim, operators, partitions, publish, scheduling, settle

__all__ = [
    "CASES",
    "DATABASE_TRAITS",
    "Case",
    "CaseContext",
    "CaseRegistry",
    "CaseResult",
    "ConformanceFailure",
    "TransportTraits",
    "all_passed",
    "case_context",
    "execute_case",
    "format_table",
    "run_case",
    "run_conformance",
]
