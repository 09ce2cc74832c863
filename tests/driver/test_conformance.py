"""The transport conformance suite (C01-C47) against the live PostgreSQL, one test per case,
plus proof that the runner reports failures (a suite that cannot fail proves nothing)."""

from __future__ import annotations

import re

import pytest

from tests.support.transports import LIMITED, limited_transport
from workqueue import publishing
from workqueue.models import Message, Topic
from workqueue.testing.conformance import (
    CASES,
    Case,
    CaseRegistry,
    ConformanceFailure,
    TransportTraits,
    all_passed,
    execute_case,
    format_table,
    run_conformance,
)
from workqueue.testing.conformance.harness import (
    TRAIT_CAPABILITIES,
    CaseContext,
    expect_equal,
)
from workqueue.transport import Receiver
from workqueue.types import SettleResult

pytestmark = pytest.mark.usefixtures("queue_db")

# C01-C26 restate the reference digest's cases; C27-C28 add the hot-key claim cases, C29-C30
# fencing at the expiry boundary, C31-C32 the deduplication window, C33-C40 scheduled and
# prioritised delivery, C41 the lease length a claim gives, C42 a cancelled holder's renewals,
# C43-C44 priority and due order across keyed and keyless work, C45-C46 a claim whose answer
# was lost, C47 a completion in the holder's transaction that holds its key.
CASE_IDS = [f"C{number:02d}" for number in range(1, 48)]

#: Cases failing because of a bug outside the suite: id -> "file:line, failing case, fix".
KNOWN_BUGS: dict[str, str] = {}


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


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
        params.append(pytest.param(case, id=f"{case.id}-{_slug(case.name)}", marks=marks))
    return params


@pytest.mark.parametrize("case", _case_params())
def test_postgresql_transport_meets_conformance_case(case):
    execute_case(case, alias="default")


@pytest.mark.parametrize("case", _case_params())
def test_a_second_transport_meets_every_case_its_capabilities_allow(case):
    # The same cases through the transport seam: LimitedTransport's receiver and operator
    # methods, gated by its capability flags (a skip names the flags it lacks).
    with limited_transport():
        traits = TransportTraits.of_transport(LIMITED)
        missing = [
            TRAIT_CAPABILITIES.get(trait, trait)
            for trait in case.requires
            if not getattr(traits, trait)
        ]
        if missing:
            pytest.skip(f"the {LIMITED} transport lacks {', '.join(missing)}")
        execute_case(case, alias="default", traits=traits)


def test_every_case_is_registered_once_with_a_behaviour_sentence():
    assert CASES.ids() == CASE_IDS
    assert all(len(case.name.split()) >= 5 for case in CASES)


def test_runner_table_lists_every_case_and_reports_the_run():
    # The checks themselves already ran once each above: here every case id and sentence goes
    # through the runner with a check that only touches its context, so no case runs twice.
    registry = CaseRegistry()
    contexts: list[str] = []
    for case in CASES:
        registry.add(Case(case.id, case.name, lambda ctx: contexts.append(ctx.case_id)))

    results = run_conformance("default", registry=registry)

    table = format_table(results)
    assert [r.case_id for r in results] == CASE_IDS == contexts
    for case in CASES:
        assert re.search(rf"^{case.id}\s+PASS\s+.*{re.escape(case.name)}$", table, re.M)
    count = len(CASE_IDS)
    assert table.splitlines()[-1].startswith(f"OK: {count} cases, {count} passed"), table
    assert all_passed(results)


def test_a_failing_case_fails_the_run_and_still_removes_its_data():
    registry = CASES.copy()
    seen: dict[str, str] = {}

    @registry.case("C98", "a deliberately wrong expectation is reported as a failure")
    def wrong_expectation(ctx: CaseContext) -> None:
        ctx.subscribe("a")
        ctx.publish()
        seen["C98"] = ctx.topic_name
        expect_equal(len(ctx.receive("a")), 2, "deliveries received")

    @registry.case("C99", "an unexpected error inside a case is reported as a failure")
    def crashes(ctx: CaseContext) -> None:
        ctx.subscribe("a")
        ctx.publish()
        seen["C99"] = ctx.topic_name
        raise RuntimeError("boom inside the case")

    results = run_conformance("default", only=["C01", "C98", "C99"], registry=registry)

    assert [(r.case_id, r.passed) for r in results] == [
        ("C01", True),
        ("C98", False),
        ("C99", False),
    ]
    assert results[1].error == "deliveries received: expected 2, got 1"
    assert "RuntimeError: boom inside the case" in (results[2].error or "")
    assert not all_passed(results)
    table = format_table(results)
    assert re.search(r"^C98\s+FAIL\b", table, re.M)
    assert "    deliveries received: expected 2, got 1" in table
    assert table.splitlines()[-1].startswith("FAILED: 3 cases, 1 passed, 2 failed")
    # The failed cases removed their topics, subscriptions and messages all the same.
    assert set(seen) == {"C98", "C99"}
    assert not Topic.objects.filter(name__in=seen.values()).exists()
    assert not Message.objects.filter(topic__name__in=seen.values()).exists()
    # The copy was extended, not the shared registry.
    assert CASES.ids() == CASE_IDS


def _complete_without_writing(self: Receiver, delivery: object) -> SettleResult:
    return SettleResult("Settled", "Completed")


def _release_like_retry(self: Receiver, delivery: object) -> SettleResult:
    return self.retry(delivery, 0)


_prepare = publishing._prepare


def _deduplication_ttl_dropped(
    message: publishing.OutgoingMessage, *args: object
) -> dict[str, object]:
    # the topic default instead
    return {**_prepare(message, *args), "deduplication_ttl_seconds": None}


def _deduplication_key_dropped(
    message: publishing.OutgoingMessage, *args: object
) -> dict[str, object]:
    return {**_prepare(message, *args), "deduplication_key": None}


def _schedule_dropped(message: publishing.OutgoingMessage, *args: object) -> dict[str, object]:
    return {**_prepare(message, *args), "not_before": None, "delay_seconds": None}


def _priority_dropped(message: publishing.OutgoingMessage, *args: object) -> dict[str, object]:
    return {**_prepare(message, *args), "priority": None}


@pytest.mark.parametrize(
    ("target", "name", "broken", "caught_by"),
    [
        pytest.param(
            Receiver, "complete", _complete_without_writing, ["C04", "C23"], id="complete-is-lost"
        ),
        pytest.param(
            Receiver, "release", _release_like_retry, ["C21"], id="release-spends-an-attempt"
        ),
        pytest.param(
            publishing,
            "_prepare",
            _deduplication_ttl_dropped,
            ["C31", "C32"],
            id="deduplication-ttl-ignored",
        ),
        pytest.param(
            publishing,
            "_prepare",
            _deduplication_key_dropped,
            ["C31", "C32"],
            id="deduplication-key-ignored",
        ),
        pytest.param(
            publishing,
            "_prepare",
            _schedule_dropped,
            ["C33", "C34", "C35", "C36", "C37"],
            id="schedule-ignored",
        ),
        pytest.param(
            publishing, "_prepare", _priority_dropped, ["C38", "C39"], id="priority-ignored"
        ),
    ],
)
def test_a_broken_transport_fails_the_cases_that_cover_it(
    monkeypatch, target, name, broken, caught_by
):
    monkeypatch.setattr(target, name, broken)

    results = run_conformance("default", only=caught_by)

    assert [r.case_id for r in results if not r.passed] == caught_by, format_table(results)
    with pytest.raises(ConformanceFailure):
        execute_case(CASES.get(caught_by[0]))


def test_cases_gated_off_by_transport_traits_are_skipped_not_failed():
    results = run_conformance(
        "default", only=["C14", "C16"], traits=TransportTraits(supports_ordered=False)
    )

    assert [(r.passed, r.skipped) for r in results] == [(True, True), (True, True)]
    assert "(skipped: transport lacks supports_ordered)" in format_table(results)


def test_unknown_case_ids_are_rejected_before_anything_runs():
    with pytest.raises(KeyError, match="no conformance case 'C77'"):
        run_conformance("default", only=["C01", "C77"])
