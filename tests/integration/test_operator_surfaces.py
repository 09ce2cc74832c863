"""The CLI and the admin as an operator reads them (issue 17 §12): attributes from the command
line, the dead-letters table naming the exception, ids that paste into the next command, and a
delivery list with short ids and the dead-letter reason and last error as columns."""

from __future__ import annotations

import io
import json
import traceback

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.urls import reverse

from tests.factories import SubscriptionFactory, TopicFactory
from workqueue import publish
from workqueue.models import Delivery, Message
from workqueue.operators.display import error_summary
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")


def run(*args: str) -> str:
    out = io.StringIO()
    call_command("workqueue", *args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def a_traceback() -> str:
    """What the executor stores for a handler exception: a chained traceback whose final
    exception has a two-line message."""
    try:
        try:
            {}["order"]
        except KeyError as exc:
            raise ValueError("card declined for order 42\nsecond line of detail") from exc
    except ValueError as exc:
        return "".join(traceback.format_exception(exc)).strip()
    raise AssertionError("unreachable")


def dead_letter_with(sub, error: str) -> str:
    publish(sub.topic.name, {"n": 1})
    receiver = Receiver(sub.id)
    [claimed] = receiver.receive(1).deliveries
    assert receiver.dead_letter(claimed, "MaxAttemptsExceeded", error).settled
    return claimed.delivery_id


def region(value: str) -> dict:
    return {
        "logic": "and",
        "filters": [{"field": "region", "operator": "eq", "value": value}],
    }


def test_publish_attributes_from_the_command_line_reach_the_message_and_its_filters():
    topic = TopicFactory()
    eu = SubscriptionFactory(topic=topic, filter=region("eu"))
    SubscriptionFactory(topic=topic, filter=region("us"))

    out = json.loads(
        run(
            "publish",
            "--topic",
            topic.name,
            "--payload",
            "{}",
            "--attribute",
            "region=eu",
            "--attribute",
            "tier=gold=plus",
            "--json",
        )
    )

    [result] = out
    message = Message.objects.get(id=result["message_id"])
    assert message.attributes == {"region": "eu", "tier": "gold=plus"}
    assert [d.subscription_id for d in Delivery.objects.filter(message=message)] == [eu.id]


@pytest.mark.parametrize(
    ("given", "problem"),
    [(["region"], "must be NAME=VALUE"), (["a=1", "a=2"], "given twice")],
)
def test_a_malformed_attribute_option_is_refused_before_publishing(given, problem):
    topic = TopicFactory()
    args = [arg for pair in given for arg in ("--attribute", pair)]

    with pytest.raises(CommandError, match=problem):
        run("publish", "--topic", topic.name, "--payload", "{}", *args)
    assert not Message.objects.filter(topic=topic).exists()


def test_the_dead_letters_table_names_the_exception_and_prints_a_command_to_paste():
    sub = SubscriptionFactory()
    delivery_id = dead_letter_with(sub, a_traceback())

    text = run("dead-letters", "-s", sub.name)

    assert "MaxAttemptsExceeded" in text
    assert "ValueError: card declined for order 42" in text
    assert "second line of detail" not in text and "KeyError" not in text
    assert f"replay: manage.py workqueue replay -s {sub.name} --delivery {delivery_id}" in text
    # ... and the line it printed works as printed.
    command = text.splitlines()[-1].split("manage.py workqueue ")[1].split()
    assert run(*command).strip() == f"Replayed {delivery_id}"


def test_error_summary_of_a_traceback_cut_to_its_ends_is_its_exception_line():
    """Review helper-138: a traceback longer than a delivery keeps (16,000 characters) is kept
    as its start and its end around a marker line; the summary (and a settle's log line) was
    the marker, "[... 8,024 characters left out ...]"."""
    from workqueue.runtime.executor import describe_error

    # Two functions in turn: Python folds a run of one repeated frame into a line.
    def down(n: int) -> None:
        if n == 0:
            raise ValueError("the real problem\nLINE 1: and more\n   ^")
        further(n - 1)

    def further(n: int) -> None:
        down(n)

    try:
        down(300)
    except ValueError as exc:
        stored = describe_error(exc)

    assert "characters left out" in stored  # cut, as the test means
    assert error_summary(stored) == "ValueError: the real problem"


@pytest.mark.parametrize(
    ("message", "summary"),
    [
        ("the real problem " + "x" * 20_000, "ValueError: the real problem " + "x" * 70 + "…"),
        ("the real problem\n" + "detail line\n" * 3_000, "ValueError: the real problem"),
    ],
    ids=["one long line", "many lines"],
)
def test_error_summary_of_an_exception_whose_own_message_was_cut_is_its_exception_line(
    message, summary
):
    """Found in the last read of round 40: the rule for a cut traceback took the lines after
    the cut for the exception's, so an exception whose own message was cut (a long error, a
    payload in it) was summed up as "" or as a line of its message."""
    from workqueue.runtime.executor import describe_error

    def fail() -> None:
        raise ValueError(message)

    try:
        fail()
    except ValueError as exc:
        stored = describe_error(exc)

    assert "characters left out" in stored  # cut, as the test means
    assert error_summary(stored) == summary


def test_error_summary_of_plain_text_is_its_first_line():
    assert error_summary("Poison message\nmore") == "Poison message"
    assert error_summary(None) == ""
    assert error_summary("x" * 200, width=10) == "x" * 9 + "…"


def test_the_admin_delivery_list_shows_short_ids_reason_and_last_error(client):
    sub = SubscriptionFactory()
    delivery_id = dead_letter_with(sub, a_traceback())
    client.force_login(get_user_model().objects.create_superuser("boss"))

    page = client.get(reverse("admin:workqueue_delivery_changelist")).content.decode()

    assert f">{delivery_id[:8]}<" in page
    assert f">{delivery_id}<" not in page  # the full id only as the link target and title
    assert "MaxAttemptsExceeded" in page
    assert "ValueError: card declined for order 42" in page


def test_a_discard_sent_again_to_a_running_delivery_says_its_cancel_is_still_pending(client):
    """An operator whose handler ignores its cancel discards again (or a second operator does):
    the cancel already asked matches nothing more, and every surface said the delivery was not
    running (REST ``cancelRequested: false``, the CLI "is not a Pending, running or
    dead-lettered delivery", the admin "already finished") while it ran on, holding its key
    (review helper-156)."""
    from tests.admin.test_admin import OPERATOR_PERMISSIONS, _act, _messages, _staff
    from tests.api.test_operator_api import discard_path
    from tests.support.api import call, operator

    sub = SubscriptionFactory()
    publish(sub.topic.name, {"n": 1})
    [running] = Receiver(sub.id).receive(1).deliveries
    delivery_id = running.delivery_id
    body = {"reason": "hung"}
    first = call(client, "post", discard_path(sub, delivery_id), body, key=operator())
    assert first.json()["cancelRequested"] is True

    again = call(client, "post", discard_path(sub, delivery_id), body, key=operator())
    said = run("discard", "-s", sub.name, "--delivery", delivery_id, "--reason", "hung")
    client.force_login(_staff("op", *OPERATOR_PERMISSIONS))
    admin = _act(client, "discard_deliveries", [delivery_id], post="yes", reason="hung")

    assert Delivery.objects.get(pk=delivery_id).status == "InFlight"  # it runs on
    assert again.json() == {
        "supported": True,
        "discarded": False,
        "cancelRequested": True,
        "holdsKey": False,
    }
    assert said.startswith(f"A cancel was already requested: {delivery_id} is still running")
    assert _messages(admin) == ["Discarded 0; cancel already requested, still running: 1"]
    # Nothing changed the second time: the first request's note and actor stand.
    assert Delivery.objects.get(pk=delivery_id).resolution_note == "hung"
