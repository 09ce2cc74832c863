"""`make demo`'s core: seed, publish the samples, run a host until quiet, check every outcome."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command

from workqueue.models import Delivery

pytestmark = pytest.mark.usefixtures("queue_db")


def test_the_demo_processes_every_sample_to_its_expected_state_and_can_run_again():
    for run in (1, 2):
        out = io.StringIO()
        call_command("workqueue_samples", "demo", stdout=out)
        assert "All 21 sample deliveries ended as expected" in out.getvalue(), out.getvalue()
        assert Delivery.objects.count() == 21 * run

    assert not Delivery.objects.filter(status__in=["Pending", "InFlight"]).exists()
