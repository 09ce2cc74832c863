"""The ``workqueue.deliveries`` log lines hold values that publishers and handlers chose: a
partition key (any REST publisher's, or a message's attribute on a cloud queue), a dead-letter
reason and an error's text (often a payload's data). Written as they came, a newline in one
forged a line of its own in the host's log (a fake ``ERROR`` line, say) and an ANSI escape
repainted the terminal that shows it (review helper-142). Each such value is written on the
line with its control characters escaped; the record's attributes keep it as it is."""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth import get_user_model

from tests.factories import SubscriptionFactory
from tests.support.executions import ExecutionRig
from tests.support.handlers import probe, registry
from workqueue.logtext import log_text, log_value
from workqueue.runtime.executor import report_lease_expired_dead_letter

pytestmark = pytest.mark.usefixtures("queue_db")

FORGED = "\n2026-12-06 03:00:00 ERROR workqueue.deliveries: Delivery dead-lettered: forged"
#: A key a publisher chose: a forged line, an ANSI escape that clears the screen, a carriage
#: return, and the line separators str.splitlines (and many log viewers) break lines at.
HOSTILE_KEY = f"cust-7{FORGED}\x1b[2J\r\u2028\x85end"


@pytest.fixture
def rig() -> Iterator[ExecutionRig]:
    probe.reset()
    rig = ExecutionRig(registry, get_user_model().objects.create_user("workqueue-system"))
    yield rig
    rig.close()


def delivery_lines(caplog: Any) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "workqueue.deliveries"]


def assert_one_clean_line(text: str) -> None:
    assert "\n" not in text and all(c.isprintable() for c in text), repr(text)


@pytest.mark.parametrize(
    ("payload", "max_attempts"),
    [
        ({"then": "crash", "message": "boom"}, 3),  # WARNING, retried
        ({"then": "complete"}, 3),  # DEBUG, completed
        ({"then": "dead_letter", "reason": "poison"}, 3),  # ERROR, dead-lettered
    ],
)
def test_a_partition_key_cannot_forge_a_log_line(rig, caplog, payload, max_attempts):
    sub = SubscriptionFactory(handler_key="t.script", max_attempts=max_attempts)
    receiver, delivery = rig.claim(sub, payload, key=HOSTILE_KEY)
    caplog.set_level(logging.DEBUG, logger="workqueue.deliveries")

    rig.execution(sub, receiver, delivery).run()

    (record,) = delivery_lines(caplog)
    message = record.getMessage()
    assert_one_clean_line(message)
    # Still there to search for, escaped; and exact in the structured attribute.
    assert "key='cust-7\\n2026-12-06 03:00:00 ERROR" in message
    assert record.partition_key == HOSTILE_KEY


@pytest.mark.parametrize(
    "payload",
    [
        # A FatalWorkError's message is the dead letter's reason, every line of it.
        {"then": "fatal", "message": f"bad email in the payload{FORGED}"},
        {"then": "dead_letter", "reason": f"poison{FORGED}"},
        # An error's summary is one line, but kept its escapes.
        {"then": "crash", "message": "boom \x1b[31mred\x1b[0m \x08\x08\x08"},
    ],
)
def test_a_handlers_reason_or_error_cannot_forge_a_log_line(rig, caplog, payload):
    sub = SubscriptionFactory(handler_key="t.script", max_attempts=3)
    receiver, delivery = rig.claim(sub, payload, key="k")
    caplog.set_level(logging.WARNING, logger="workqueue.deliveries")

    rig.execution(sub, receiver, delivery).run()

    (record,) = delivery_lines(caplog)
    assert_one_clean_line(record.getMessage())


# Fixed ids: pytest-xdist's workers must collect the same test names.
@pytest.mark.parametrize(
    "delivery_id",
    ["6f1c2a3e-8d4b-4c7e-9a0f-1b2c3d4e5f60", f"d-1{FORGED}"],
    ids=["a uuid", "a forged line"],
)
def test_a_lease_expiry_dead_letter_cannot_forge_a_log_line(caplog, delivery_id):
    """Lease expiry on a cloud queue reports the delivery id its message's body names."""
    caplog.set_level(logging.ERROR, logger="workqueue.deliveries")

    report_lease_expired_dead_letter(
        object, "orders.email", str(uuid.uuid4()), delivery_id, HOSTILE_KEY, reason="LeaseExpired"
    )

    (record,) = delivery_lines(caplog)
    assert_one_clean_line(record.getMessage())
    assert record.partition_key == HOSTILE_KEY


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("cust-7", "cust-7"),  # the common case stays as it was
        ("émile/42", "émile/42"),  # printable text of any script too
        ("a b", "'a b'"),  # a space could otherwise pass for the line's next field
        ("a\nb", "'a\\nb'"),
        ("\x1b[2J", "'\\x1b[2J'"),
        ("x\u2028y", "'x\\u2028y'"),
        (None, "None"),
        ("", "''"),
    ],
)
def test_a_value_is_left_alone_when_plain_and_quoted_otherwise(value, shown):
    assert log_value(value) == shown


def test_free_text_keeps_its_words_and_escapes_its_control_characters():
    assert log_text("bad data: émile") == "bad data: émile"
    assert log_text("a\nb\x1b[2J\r\u2028") == "a\\nb\\x1b[2J\\r\\u2028"


class _AsTheQueueSaid:
    """A receiver that settles the real delivery behind one whose ids a queue message set."""

    def __init__(self, receiver: Any, real: Any) -> None:
        self._receiver, self._real = receiver, real

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._receiver, name)
        if not callable(method):
            return method

        def call(*args: Any, **kwargs: Any) -> Any:
            if args and isinstance(args[0], type(self._real)):
                args = (self._real, *args[1:])
            return method(*args, **kwargs)

        return call


def test_ids_a_cloud_queues_message_carries_cannot_forge_a_log_line(rig, caplog):
    """On a cloud transport the delivery and message ids come from the message's body, which
    whoever may send to the queue wrote."""
    sub = SubscriptionFactory(handler_key="t.script", max_attempts=3)
    receiver, delivery = rig.claim(sub, {"then": "crash", "message": "boom"}, key="k")
    forged = dataclasses.replace(
        delivery, delivery_id=f"d-1{FORGED}", message_id=f"m-1{FORGED}\x1b[2J"
    )
    caplog.set_level(logging.DEBUG, logger="workqueue.deliveries")

    rig.execution(sub, _AsTheQueueSaid(receiver, delivery), forged).run()

    (record,) = delivery_lines(caplog)
    assert "retrying in" in record.getMessage()
    assert_one_clean_line(record.getMessage())
