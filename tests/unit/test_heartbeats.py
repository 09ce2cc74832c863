"""How often a held delivery's lease is renewed: the README promises a cancel or a lost lease
is heard "at its next heartbeat", at most 30 s away whatever the lease."""

from __future__ import annotations

import pytest

from workqueue.runtime.plan import heartbeat_interval_seconds


@pytest.mark.parametrize(
    ("lease_seconds", "interval"), [(3, 1.0), (30, 10.0), (90, 30.0), (300, 30.0), (3600, 30.0)]
)
def test_a_lease_is_renewed_three_times_a_lease_and_at_least_every_30_seconds(
    lease_seconds, interval
):
    """Audit helper-107: without the cap (a third of the lease) no test failed; a 300 s lease
    heard its cancel up to 100 s late on a transport without notifications."""
    assert heartbeat_interval_seconds(lease_seconds) == interval
