"""Retry delays: the handler's own, else full jitter rounded up to a whole second; and the
backoff of a failed claim loop or plan."""

from __future__ import annotations

import pytest

from workqueue.runtime.backoff import retry_delay_seconds
from workqueue.runtime.consumer import restart_delay_seconds


@pytest.mark.parametrize("draw", [0.0, 0.01, 0.049])
def test_a_drawn_delay_is_never_zero_when_the_subscription_has_a_backoff(draw):
    """Audit helper-98: the draw was rounded to the nearest second, so with a 10 s base one
    retry in twenty was due at once, and the README's way of testing a retry (assert the
    Pending run, the test's clock standing still) failed one run in twenty."""
    assert retry_delay_seconds(1, 10, 900, rand=lambda: draw) == 1


@pytest.mark.parametrize(
    ("attempt", "draw", "expected"),
    [(1, 0.5, 5), (1, 0.999, 10), (3, 0.5, 20), (10, 1.0, 900), (1, 0.42, 5)],
)
def test_a_drawn_delay_is_rounded_up_within_the_ceiling(attempt, draw, expected):
    assert retry_delay_seconds(attempt, 10, 900, rand=lambda: draw) == expected


def test_no_backoff_and_a_requested_delay_are_kept_as_they_are():
    assert retry_delay_seconds(3, 0, 0, rand=lambda: 0.7) == 0
    assert retry_delay_seconds(1, 10, 900, requested=0) == 0
    assert retry_delay_seconds(1, 10, 900, requested=2.1) == 3
    assert retry_delay_seconds(1, 10, 30, requested=60) == 30


@pytest.mark.parametrize(("failures", "expected"), [(1, 1.0), (2, 2.0), (5, 16.0), (6, 30.0)])
def test_a_failed_consumer_or_plan_waits_one_then_twice_as_long_up_to_thirty_seconds(
    failures, expected
):
    assert restart_delay_seconds(failures) == expected


def test_the_restart_delay_stays_at_its_cap_through_an_outage_of_any_length():
    """Review helper-154: 1 s doubled per failure in a row overflowed a float at the 1,025th
    (8.5 hours of failed re-plans, 85 minutes of failed claims polling every 5 s), and the
    OverflowError crashed the claim loop."""
    assert restart_delay_seconds(1_025) == restart_delay_seconds(10**6) == 30.0
