"""What publishers and handlers chose (a partition key, a dead-letter reason, an error's text)
shown on an operator's terminal by ``manage.py workqueue``'s tables: a newline in a cell broke
its row in two (the second passing for a row of its own) and an ANSI escape repainted the
terminal, e.g. cleared the screen above the listing (review helper-142). Each cell is written
with its control characters escaped; ``--json`` keeps the values as they are."""

from __future__ import annotations

import io
import json

import pytest
from django.core.management import call_command

from tests.factories import SubscriptionFactory
from tests.support.queue import dead_letter

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
