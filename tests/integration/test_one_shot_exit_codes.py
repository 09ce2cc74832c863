"""A one-shot job (``workqueue_work --once``) exits 2 when its subscription could not run, so a
container job or a KEDA ScaledJob shows the failure instead of succeeding while the backlog
grows. Its health was read after the drain, which reports every subscription as shut down:
a consumer that could not start, claims that kept failing and a planning that raised all
exited 0 with "processed=0 reason=Idle"."""

from __future__ import annotations

import io
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError

# Registers the factories' default handler (tests.noop) with the global registry, which the
# commands use.
import tests.support.handlers  # noqa: F401
from tests.factories import SubscriptionFactory
from tests.support.roles import acting_as_granted_role
from workqueue import publish
from workqueue.exceptions import TransientDriverError
from workqueue.models import Delivery
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")


@pytest.fixture
def waiting_work():
    get_user_model().objects.create_user("workqueue-system")
    subscription = SubscriptionFactory()
    publish(subscription.topic.name, {"n": 1})
    return subscription


def run_job(subscription_name: str) -> tuple[CommandError, str]:
    out = io.StringIO()
    with pytest.raises(CommandError) as raised:
        call_command(
            "workqueue_work", "-s", subscription_name, "--once", "--idle-exit-ms", "300", stdout=out
        )
    return raised.value, out.getvalue()


def test_a_job_whose_consumer_cannot_start_exits_2(waiting_work, settings):
    settings.WORKQUEUE = {
        **settings.WORKQUEUE,
        "SUBSCRIPTIONS": [{"name": "*", "concurrency": 2, "prefetch": -1}],
    }

    error, out = run_job(waiting_work.name)

    assert error.returncode == 2
    assert f"Could not run: {waiting_work.name}: Error" in str(error), str(error)
    assert "processed=0" in out
    assert Delivery.objects.get(subscription=waiting_work).status == "Pending"


def test_a_job_whose_claims_are_refused_exits_2(waiting_work, pg_conn):
    """The runtime role lacks EXECUTE on the claim procedure (an upgrade whose grants were not
    run again): every claim fails."""
    with acting_as_granted_role(pg_conn, "wq_runtime", "grant-runtime", ["wq_claim"]) as role:
        pg_conn.execute(f'GRANT SELECT ON auth_user TO "{role}"')  # the system user's lookup
        error, _ = run_job(waiting_work.name)

    assert error.returncode == 2
    assert "Error" in str(error) and "permission denied" in str(error), str(error)
    assert Delivery.objects.get(subscription=waiting_work).status == "Pending"


def test_a_job_whose_subscriptions_cannot_be_planned_exits_2(waiting_work, settings):
    settings.WORKQUEUE = {
        **settings.WORKQUEUE,
        "SUBSCRIPTIONS": [{"name": "*", "concurrency": "four"}],
    }

    error, _ = run_job(waiting_work.name)

    assert error.returncode == 2
    assert "Could not plan the subscriptions" in str(error), str(error)
    assert Delivery.objects.get(subscription=waiting_work).status == "Pending"


@pytest.mark.parametrize("FAILING_CALL", [2, 3])
def test_a_claim_that_fails_once_is_a_blip_not_a_failed_job(
    waiting_work, monkeypatch, FAILING_CALL
):
    """A dropped connection fails one claim and the next one gets past it: the job must not
    exit 2 because the run happened to end between the two."""
    real_receive, calls = Receiver.receive, []

    def dropped_once(self: Receiver, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == FAILING_CALL:
            raise TransientDriverError("server closed the connection unexpectedly (test)")
        return real_receive(self, *args, **kwargs)

    monkeypatch.setattr(Receiver, "receive", dropped_once)
    out = io.StringIO()

    call_command(
        "workqueue_work",
        "-s",
        waiting_work.name,
        "--once",
        "--max",
        "5",
        "--idle-exit-ms",
        "300",
        stdout=out,
    )

    assert len(calls) > FAILING_CALL and "processed=1 reason=Idle" in out.getvalue()
    assert Delivery.objects.get(subscription=waiting_work).status == "Completed"


@pytest.mark.parametrize("where", ["--concurrency", "WORKQUEUE['SUBSCRIPTIONS']"])
def test_a_concurrency_no_machine_can_run_exits_2_naming_it(waiting_work, settings, where):
    # 2 x 99,999,999,999 worker threads: "can't start new thread" half way, exit 1.
    arguments = ["--concurrency", "5000"] if where == "--concurrency" else []
    if where != "--concurrency":
        settings.WORKQUEUE = {
            **settings.WORKQUEUE,
            "SUBSCRIPTIONS": [{"name": "*", "concurrency": 5000}],
        }

    with pytest.raises(CommandError) as raised:
        call_command(
            "workqueue_work", "-s", waiting_work.name, "--once", *arguments, stdout=io.StringIO()
        )

    if where == "--concurrency":  # refused as an argument (exit 2 on the command line)
        assert "argument --concurrency: '5000' is not a concurrency from 1 to 1,000" in str(
            raised.value
        )
    else:  # call_command runs no system check (workqueue.E008 names it first otherwise)
        assert raised.value.returncode == 2
        assert f"{where} gives subscription" in str(raised.value)
        assert "at most 1,000 handlers" in str(raised.value)
    assert Delivery.objects.get(subscription=waiting_work).status == "Pending"


@pytest.mark.parametrize(
    ("abandoned", "unsettled"), [(1, 0), (0, 1)], ids=["handler-running", "outcome-unrecorded"]
)
def test_work_left_behind_of_either_kind_ends_the_process_with_exit_3(
    monkeypatch, abandoned, unsettled
):
    """Only a handler left running was ever tried: an outcome the database had not recorded by
    the end of the drain could have ended the job with 0 (helper-104)."""
    import types

    from workqueue.runtime import process

    class Exited(Exception):
        pass

    def exit_now(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(process.os, "_exit", exit_now)
    host = types.SimpleNamespace(abandoned_handlers=abandoned, unsettled_outcomes=unsettled)
    with pytest.raises(Exited) as exited:
        process.exit_now_if_work_left_behind(host)
    assert exited.value.args == (3,)


def test_an_idle_job_says_it_has_nothing_to_drain():
    """It announced "draining running handlers (up to 30000 ms; any still running are then
    aborted and given 30000 ms more)" with nothing running (helper-113)."""
    get_user_model().objects.create_user("workqueue-system")
    subscription = SubscriptionFactory()
    out = io.StringIO()

    call_command(
        "workqueue_work", "-s", subscription.name, "--once", "--idle-exit-ms", "300", stdout=out
    )

    assert "Stopping (Idle): no handler is running." in out.getvalue()
    assert "draining" not in out.getvalue()


@pytest.mark.parametrize("option", ["--idle-exit-ms", "--shutdown-drain-ms"])
def test_a_negative_wait_is_refused_naming_the_option(waiting_work, option):
    """Audit helper-134: accepted, a negative drain counted every running handler as left
    behind (exit 3) and was printed as "up to -5 ms"."""
    with pytest.raises(CommandError, match=f"{option} must be 0 or more") as refused:
        call_command("workqueue_work", "-s", waiting_work.name, "--once", option, "-5")

    assert refused.value.returncode == 2
    assert Delivery.objects.get(subscription=waiting_work).status == "Pending"
