"""Review helper-171: renewals refused for want of a grant (a DBA's REVOKE of wq_extend_lease,
or an upgrade whose grant-runtime was not run again) are a spell in which every handler that
outlives a third of its lease loses its outcome and runs again at lease expiry, attempt after
attempt, until it is dead-lettered LeaseExpired. Settles refused the same way are reported
(health Error, a one-shot job exits 2); refused renewals are not: health reads Running with no
reason, and a one-shot job exits 0."""

from __future__ import annotations

import io
import time

import pytest

from tests.support.handlers import probe
from tests.support.hosts import one, states, sub
from workqueue import publish

pytestmark = pytest.mark.usefixtures("queue_db")


def test_renewals_refused_for_a_grant_are_reported_in_health(make_host, pg_conn):
    from tests.support.roles import acting_as_granted_role

    s = sub(lease_seconds=5, max_attempts=5)
    with acting_as_granted_role(pg_conn, "wq_rt", "grant-runtime", ["wq_extend_lease"]) as role:
        pg_conn.execute(f'GRANT SELECT ON auth_user TO "{role}"')
        host = make_host(one(s, concurrency=1))
        host.start()
        publish(s.topic.name, {"sleepMs": 8000})
        # Its renewals (every 1.7 s) are refused; the horizon tells it LeaseLost at 5 s.
        [run] = probe.wait_for(1, timeout=10)
        assert run.finished.wait(10)
        assert run.signal_reason == "LeaseLost"
        time.sleep(1.0)  # a supervisor pass or two (every 0.5 s)
        state, reason = states(host)[s.name]
        host.shutdown()

    assert state == "Error", (
        f"health read {state!r} ({reason!r}) while every renewal was refused for want of a "
        "grant, so that every handler outliving its lease may run twice"
    )


def test_a_one_shot_job_whose_renewals_are_refused_does_not_exit_0(pg_conn):
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    import tests.support.handlers  # noqa: F401  (the commands' registry: tests.record)
    from tests.support.roles import acting_as_granted_role
    from workqueue.models import Delivery

    get_user_model().objects.create_user("workqueue-system")
    s = sub(handler_key="tests.record", lease_seconds=5, max_attempts=5)
    message = publish(s.topic.name, {"sleepMs": 8000}).message_id
    out = io.StringIO()
    outcome = "exit 0"
    with acting_as_granted_role(pg_conn, "wq_rt", "grant-runtime", ["wq_extend_lease"]) as role:
        pg_conn.execute(f'GRANT SELECT ON auth_user TO "{role}"')
        try:
            call_command(
                "workqueue_work", "-s", s.name, "--once", "--idle-exit-ms", "300", stdout=out
            )
        except BaseException as exc:  # CommandError(returncode=2), or SystemExit
            outcome = f"{type(exc).__name__}: {exc}"

    row = Delivery.objects.get(message_id=message)
    # Nobody took the delivery back, so the handler's outcome (told LeaseLost, it asks for a
    # retry) is recorded (review helper-180); the refused renewals are still the operator's.
    assert (row.status, row.attempt_count) == ("Pending", 1)
    assert outcome != "exit 0", (
        f"the job exited 0 ({out.getvalue().strip().splitlines()[-1]!r}) although every renewal "
        "was refused for want of a grant and the handler's outcome was lost"
    )
