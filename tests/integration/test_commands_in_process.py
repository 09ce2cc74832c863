"""The host commands run inside another program (``call_command``: a user's test suite, a
script) leave that process as they found it: its signal handlers, the metrics port they
served, its garbage collector (see tests/runtime/test_host_memory.py)."""

from __future__ import annotations

import io
import signal
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError

# Registers the factories' default handler (tests.noop) with the global registry, which the
# commands use.
import tests.support.handlers  # noqa: F401
from tests.factories import SubscriptionFactory
from workqueue import metrics

pytestmark = pytest.mark.usefixtures("queue_db")


def _ours(signum: int, frame: Any) -> None:
    """A handler the calling program had installed."""


@pytest.fixture
def own_signal_handlers() -> Iterator[None]:
    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGTERM, _ours)
    signal.signal(signal.SIGINT, _ours)
    yield
    signal.signal(signal.SIGTERM, previous[0])
    signal.signal(signal.SIGINT, previous[1])


@pytest.mark.usefixtures("own_signal_handlers")
def test_a_one_shot_run_puts_back_the_signal_handlers_it_found():
    # Left installed, the command's handlers set an event nobody waits on any more: Ctrl-C
    # and SIGTERM then no longer stop the test run that called it.
    get_user_model().objects.create_user("workqueue-system")
    s = SubscriptionFactory()

    call_command("workqueue_work", "-s", s.name, "--once", "--idle-exit-ms", "100")

    assert signal.getsignal(signal.SIGINT) is _ours
    assert signal.getsignal(signal.SIGTERM) is _ours


@pytest.mark.usefixtures("own_signal_handlers")
def test_a_host_that_cannot_start_stops_its_metrics_server_and_puts_back_the_handlers(
    monkeypatch,
):
    served: list[Any] = []
    serve = metrics.serve

    def recording(port: int, address: str = "127.0.0.1") -> Any:
        served.append(serve(port, address))
        return served[-1]

    monkeypatch.setattr(metrics, "serve", recording)
    s = SubscriptionFactory()  # and no system user: the host refuses to start

    with pytest.raises(CommandError, match="SYSTEM_USER"):
        call_command("workqueue_host", "-s", s.name, "--metrics-port", "0", stdout=io.StringIO())

    [server] = served
    assert server.socket.fileno() == -1, "the metrics port is still bound"
    assert signal.getsignal(signal.SIGINT) is _ours
    assert signal.getsignal(signal.SIGTERM) is _ours
