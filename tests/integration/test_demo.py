"""`make demo`'s core: seed, publish the samples, run a host until quiet, check every outcome."""

from __future__ import annotations

import io
import re

import pytest
from django.core.management import call_command

from workqueue.models import Delivery

pytestmark = pytest.mark.usefixtures("queue_db")


def test_the_demo_processes_every_sample_to_its_expected_state_and_can_run_again():
    for run in (1, 2):
        out = io.StringIO()
        call_command("workqueue_samples", "demo", stdout=out)
        text = out.getvalue()
        assert "All 21 sample deliveries ended as expected: 18 completed (3 after a retry)" in text
        # The host's count and the summary's agree (issue 17 §12): each counts handler runs.
        [ran] = re.findall(r"Host ran handlers (\d+) times", text)
        [runs] = re.findall(r"(\d+) handler runs in all", text)
        assert ran == runs == "24", text
        assert Delivery.objects.count() == 21 * run

    assert not Delivery.objects.filter(status__in=["Pending", "InFlight"]).exists()
