"""Run conformance cases against a database alias and report a pass/fail table.

Used by ``manage.py workqueue conformance`` and by the pytest wrappers; it never imports
pytest. A case fails when its check raises anything (a :class:`ConformanceFailure` carries the
expected-versus-got message; any other exception is reported with its traceback). Every case
removes its own topic and data, passed or failed.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from workqueue.testing.conformance.harness import (
    DATABASE_TRAITS,
    ConformanceFailure,
    TransportTraits,
    case_context,
)
from workqueue.testing.conformance.registry import CASES, Case, CaseRegistry


@dataclass(frozen=True, slots=True)
class CaseResult:
    """The outcome of one case. ``skipped`` cases (gated off by traits) count as passed."""

    case_id: str
    name: str
    passed: bool
    duration_s: float
    error: str | None = None
    skipped: bool = False

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values (for ``manage.py workqueue conformance --json``)."""
        return {
            "case_id": self.case_id,
            "name": self.name,
            "passed": self.passed,
            "skipped": self.skipped,
            "duration_s": round(self.duration_s, 4),
            "error": self.error,
        }


def execute_case(
    case: Case, alias: str = "default", traits: TransportTraits = DATABASE_TRAITS
) -> None:
    """Run ``case`` on ``alias``, letting its failure propagate (for test runners)."""
    with case_context(case.id, alias, traits) as ctx:
        case.check(ctx)


def run_case(
    case: Case, alias: str = "default", traits: TransportTraits = DATABASE_TRAITS
) -> CaseResult:
    """Run ``case`` on ``alias`` and capture its outcome; never raises for a failing case."""
    reason = case.skip_reason(traits)
    if reason is not None:
        return CaseResult(case.id, case.name, True, 0.0, reason, skipped=True)
    started = time.perf_counter()
    try:
        execute_case(case, alias, traits)
    except ConformanceFailure as failure:
        error: str | None = str(failure)
    except Exception as exc:
        # An unexpected error is still a failure of this case, not of the whole run.
        error = "".join(traceback.format_exception(exc)).rstrip()
    else:
        error = None
    return CaseResult(case.id, case.name, error is None, time.perf_counter() - started, error)


def run_conformance(
    alias: str = "default",
    only: Sequence[str] | None = None,
    *,
    registry: CaseRegistry | None = None,
    traits: TransportTraits = DATABASE_TRAITS,
) -> list[CaseResult]:
    """Run every registered case (or the ids in ``only``) against database ``alias``.

    Cases run one after another in id order; each uses its own topic, so the run is safe on a
    database that also serves live traffic. Unknown ids in ``only`` raise ``KeyError`` before
    anything runs.
    """
    cases = registry if registry is not None else CASES
    selected = [cases.get(case_id) for case_id in only] if only else list(cases)
    return [run_case(case, alias, traits) for case in selected]


def all_passed(results: Iterable[CaseResult]) -> bool:
    """True when no case failed (skipped cases do not fail a run); False for an empty run."""
    results = list(results)
    return bool(results) and all(r.passed for r in results)


def format_table(results: Sequence[CaseResult]) -> str:
    """A fixed-width table, one row per case, failures' errors beneath it, then a summary."""
    width = max([len(r.name) for r in results] + [len("behaviour")])
    header = f"{'case':<5} {'result':<6} {'time':>7}  behaviour"
    lines = [header, "-" * (len(header) - len("behaviour") + width)]
    for r in results:
        status = "SKIP" if r.skipped else ("PASS" if r.passed else "FAIL")
        why = f" (skipped: {r.error})" if r.skipped else ""
        lines.append(f"{r.case_id:<5} {status:<6} {r.duration_s:>6.2f}s  {r.name}{why}")
    failures = [r for r in results if not r.passed]
    for r in failures:
        lines += [
            "",
            f"{r.case_id} {r.name}",
            *(f"    {line}" for line in (r.error or "").splitlines()),
        ]
    skipped = sum(r.skipped for r in results)
    passed = sum(r.passed and not r.skipped for r in results)
    total = sum(r.duration_s for r in results)
    verdict = "OK" if all_passed(results) else "FAILED"
    lines += [
        "",
        f"{verdict}: {len(results)} cases, {passed} passed, {len(failures)} failed, "
        f"{skipped} skipped in {total:.2f}s",
    ]
    return "\n".join(lines)
