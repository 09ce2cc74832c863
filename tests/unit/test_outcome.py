"""What a handler may put in its outcome: numbers of seconds and text, checked where it is built."""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction

import pytest
from django.utils.translation import gettext_lazy

from workqueue.runtime.outcome import Outcome, TransientWorkError


@pytest.mark.parametrize("delay", [None, 0, 2.5, Decimal("2.5"), Fraction(5, 2), float("inf")])
def test_any_real_number_of_seconds_is_a_delay(delay):
    assert Outcome.retry("later", delay).delay_seconds == delay
    assert TransientWorkError("later", delay).retry_after_seconds == delay


def test_a_translated_reason_is_text():
    """gettext_lazy gives no str but a proxy of one: taken as the text it stands for."""
    assert Outcome.dead_letter(gettext_lazy("poison pill")).reason == "poison pill"


@pytest.mark.parametrize("delay", ["30", b"30", True, [30], 3j])
def test_a_delay_that_is_no_number_names_the_field(delay):
    with pytest.raises(TypeError, match="delay_seconds must be a number of seconds"):
        Outcome.retry("later", delay)
    with pytest.raises(TypeError, match="retry_after_seconds must be a number of seconds"):
        TransientWorkError("later", delay)


@pytest.mark.parametrize("reason", [ValueError("boom"), 42, {"code": 503}])
def test_a_reason_that_is_no_text_names_the_field(reason):
    with pytest.raises(TypeError, match="reason must be text or None"):
        Outcome.retry(reason)
