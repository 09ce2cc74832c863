"""The conformance suite (C01-C47) on the AWS transport, against moto's standalone server
through real boto3 HTTP calls: every case whose capabilities the transport has (a skip names
the traits it lacks). Time passes for real here (SQS keeps its own clock)."""

from __future__ import annotations

import re

import pytest

from workqueue.testing.conformance import CASES, TransportTraits, execute_case

pytestmark = [pytest.mark.processes, pytest.mark.usefixtures("queue_db")]


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


@pytest.mark.parametrize("case", [pytest.param(c, id=f"{c.id}-{_slug(c.name)}") for c in CASES])
def test_the_aws_transport_meets_every_case_its_capabilities_allow(case, aws_endpoint):
    traits = TransportTraits.of_transport("AWS", aws_endpoint.configuration())
    reason = case.skip_reason(traits)
    if reason is not None:
        pytest.skip(f"the AWS {reason}")
    execute_case(case, alias="default", traits=traits)
