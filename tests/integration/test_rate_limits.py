"""Per-subscription rate limits: one token bucket in the database shared by every host. Takers
racing on real threads never get more than the burst plus the rate over the time they ran; two
host processes together start deliveries at the configured rate; limited deliveries wait
Pending and never fail; the limit shows in stats.
"""

from __future__ import annotations

import threading
import time

import pytest
from django.core.exceptions import ValidationError

from tests.factories import SubscriptionFactory
from tests.support.processes import hello
from tests.support.waiting import wait_until
from workqueue import publish_many
from workqueue.models import Delivery
from workqueue.operators.operations import subscription_stats
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")


def test_an_unlimited_subscription_is_granted_what_it_asks_for():
    receiver = Receiver(SubscriptionFactory().id)

    assert receiver.take_rate_tokens(500) == (500, 0.0)


def test_a_bucket_starts_full_then_refills_at_the_rate_up_to_the_burst():
    receiver = Receiver(SubscriptionFactory(rate_limit_per_second=10, rate_limit_burst=4).id)

    assert receiver.take_rate_tokens(9)[0] == 4  # a new bucket holds its burst
    granted, wait = receiver.take_rate_tokens(1)
    assert granted == 0 and 0 < wait <= 0.1  # the next token is due within 1/rate
    time.sleep(0.25)
    assert 2 <= receiver.take_rate_tokens(9)[0] <= 4  # 0.25 s at 10/s, never past the burst
    receiver.return_rate_tokens(50)
    assert receiver.take_rate_tokens(9)[0] == 4  # given back, but only up to the burst


def test_the_burst_defaults_to_the_rate_rounded_up():
    slow = Receiver(SubscriptionFactory(rate_limit_per_second=0.5).id)
    fast = Receiver(SubscriptionFactory(rate_limit_per_second=2.5).id)

    assert slow.take_rate_tokens(10)[0] == 1
    granted, wait = slow.take_rate_tokens(1)
    assert granted == 0 and 1.5 < wait <= 2.0  # one token every two seconds
    assert fast.take_rate_tokens(10)[0] == 3


def test_racing_takers_never_get_more_than_the_burst_plus_the_rate_over_their_run():
    rate, burst = 40.0, 5
    subscription = SubscriptionFactory(rate_limit_per_second=rate, rate_limit_burst=burst)
    granted: list[int] = []
    lock = threading.Lock()
    began = time.monotonic()

    def take() -> None:
        receiver = Receiver(subscription.id)  # its own connection, as each host has
        try:
            while time.monotonic() - began < 1.5:
                got, _wait = receiver.take_rate_tokens(3)
                with lock:
                    granted.append(got)
        finally:
            receiver.driver.close()

    threads = [threading.Thread(target=take) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - began

    assert sum(granted) <= burst + rate * elapsed
    assert sum(granted) >= burst + rate * 1.5 * 0.9  # and the takers did get the rate
    assert granted.count(0) > 0  # they really contended for tokens


def test_a_limit_out_of_range_is_refused_like_any_topology_mistake():
    for fields in (
        {"rate_limit_per_second": 0},
        {"rate_limit_per_second": -1},
        {"rate_limit_per_second": 5, "rate_limit_burst": 0},
    ):
        with pytest.raises(ValidationError):
            SubscriptionFactory(**fields)


@pytest.mark.processes
def test_two_hosts_together_start_deliveries_at_the_subscriptions_rate(processes):
    rate, burst = 20.0, 4
    subscription = hello(rate_limit_per_second=rate, rate_limit_burst=burst)
    publish_many(subscription.topic.name, [{"payload": {"n": n}} for n in range(120)])
    for _ in range(2):
        processes.start("workqueue_host", "-s", subscription.name, "--concurrency", "8")

    def completed() -> list:
        return sorted(
            Delivery.objects.filter(subscription=subscription, status="Completed").values_list(
                "completed_at", flat=True
            )
        )

    wait_until(lambda: len(completed()) >= 100, timeout=30)
    # The steady rate, once the burst the full bucket allowed at the start is spent.
    times = completed()[2 * burst :]
    achieved = (len(times) - 1) / (times[-1] - times[0]).total_seconds()

    # Within 10% of the limit: never (meaningfully) above it, and not starved below it.
    assert rate * 0.9 <= achieved <= rate * 1.1, achieved
    assert not Delivery.objects.filter(subscription=subscription, status="DeadLettered").exists()
    [stats] = subscription_stats(subscription.name).subscriptions
    assert stats.rate_limit_per_second == rate
