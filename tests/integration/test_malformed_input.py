"""Attack tests (issue 10, item 8) through the Python API and the CLI: text the database cannot
store (a NUL character, a lone surrogate), JSON nested deeper than 64 levels and NaN are refused
before any database work with an error naming the field: ``InvalidInputError`` (a
``ValueError``) from ``publish``/``publish_many`` and the operator functions, a
``CommandError`` (stderr, exit 1) from ``manage.py workqueue``. Nothing of a refused call is
stored. Against the real queue."""

from __future__ import annotations

import io
import math
import os
import subprocess
import sys
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from tests.factories import SubscriptionFactory, TopicFactory
from tests.support.processes import PROJECT_ROOT, subprocess_environment
from tests.support.queue import dead_letter
from workqueue import publish, publish_many
from workqueue.exceptions import InvalidInputError
from workqueue.models import Delivery, Message
from workqueue.operators import operations
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")

NUL = "\x00"
LONE_SURROGATE = "\ud800"


def nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.fixture
def topic():
    topic = TopicFactory()
    SubscriptionFactory(topic=topic)
    return topic


# -- publish / publish_many -------------------------------------------------------------------


MALFORMED = [
    ("payload", {"payload": f"a{NUL}b"}, "NUL"),
    ("payload", {"payload": {"outer": {f"key{NUL}": 1}}}, "NUL"),
    ("payload", {"payload": [LONE_SURROGATE]}, "lone surrogate"),
    ("partition_key", {"payload": 1, "partition_key": f"customer{NUL}"}, "NUL"),
    ("partition_key", {"payload": 1, "partition_key": "\udcff"}, "lone surrogate"),
    ("deduplication_key", {"payload": 1, "deduplication_key": f"{NUL}"}, "NUL"),
    ("correlation_id", {"payload": 1, "correlation_id": LONE_SURROGATE}, "lone surrogate"),
    ("attributes", {"payload": 1, "attributes": {"region": f"eu{NUL}"}}, "NUL"),
    ("payload_ref", {"payload_ref": {"uri": f"s3://b/{LONE_SURROGATE}"}}, "lone surrogate"),
    ("payload", {"payload": nested(65)}, "nested more than 64 levels deep"),
    ("payload", {"payload": nested(950)}, "nested more than 64 levels deep"),
    ("payload", {"payload": {"ratio": math.nan}}, "NaN or Infinity"),
]
IDS = [f"{field}-{n}" for n, (field, _, _) in enumerate(MALFORMED)]


@pytest.mark.parametrize(("field", "message", "problem"), MALFORMED, ids=IDS)
def test_publish_refuses_what_the_database_cannot_store_before_any_database_work(
    topic, statements, field, message, problem
):
    with pytest.raises(InvalidInputError) as refused:
        publish(topic.name, **message)

    assert str(refused.value).startswith(f"{field} of message 0 ")
    assert problem in str(refused.value)
    assert refused.value.field == field and refused.value.index == 0
    assert statements == []
    assert Message.objects.count() == 0


@pytest.mark.parametrize(("field", "message", "problem"), MALFORMED, ids=IDS)
def test_publish_many_names_the_message_and_publishes_none_of_the_batch(
    topic, statements, field, message, problem
):
    with pytest.raises(InvalidInputError, match=rf"^{field} of message 2 "):
        publish_many(topic.name, [{"payload": 1}, {"payload": 2}, message])

    assert statements == []
    assert Message.objects.count() == 0


@pytest.mark.parametrize("name", [f"orders{NUL}", f"orders{LONE_SURROGATE}"])
def test_a_topic_name_the_database_cannot_store_is_refused(name, statements):
    with pytest.raises(InvalidInputError, match=r"^topic holds a"):
        publish(name, {"n": 1})

    assert statements == []


@pytest.mark.parametrize("given", [None, 123, b"orders", ["orders"]])
def test_a_topic_that_is_neither_a_name_nor_a_topic_is_refused_naming_its_type(given, statements):
    """It raised AttributeError from deep in the transport ('int' object has no attribute
    'name'), or came back as a TopicNotFound saying nothing of the type."""
    refusal = rf"^topic must be a topic's name \(a str\) or a Topic, not {type(given).__name__}"
    for valid_or_not in ({}, {"priority": 500}):
        with pytest.raises(InvalidInputError, match=refusal):
            publish(given, {"n": 1}, **valid_or_not)

    assert statements == []


def test_what_looks_like_malformed_text_but_is_not_is_published_and_delivered_exactly(topic):
    payload = {"deep": nested(63), "emoji": "\U0001f600", "text": "\\u0000 \\ud800"}

    result = publish(topic.name, payload, partition_key="\\u0000", attributes={"a": "\\x00"})

    assert result.status == "Accepted"
    [delivery] = Receiver(topic.subscriptions.get().id).receive(1).deliveries
    assert delivery.decoded_payload() == payload
    assert delivery.partition_key == "\\u0000"
    assert delivery.attributes == {"a": "\\x00"}


# -- operator functions -----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [NUL, LONE_SURROGATE], ids=["nul", "lone-surrogate"])
def test_operator_functions_refuse_names_notes_and_reasons_the_database_cannot_store(bad):
    sub = SubscriptionFactory()
    delivery_id = dead_letter(sub)
    calls = [
        lambda: operations.subscription_stats(f"a{bad}"),
        lambda: operations.list_dead_letters(f"a{bad}"),
        lambda: operations.list_partitions(f"a{bad}"),
        lambda: operations.backlog(f"a{bad}"),
        lambda: operations.validate_bindings(f"a{bad}"),
        lambda: operations.replay(f"a{bad}", delivery_id),
        lambda: operations.replay(sub.name, delivery_id, note=f"ok{bad}"),
        lambda: operations.discard(sub.name, delivery_id, reason=f"poison{bad}"),
    ]
    for call in calls:
        with pytest.raises(InvalidInputError, match="holds a"):
            call()

    assert Delivery.objects.get(id=delivery_id).status == "DeadLettered"


# -- manage.py workqueue ----------------------------------------------------------------------


def run(*args: str) -> str:
    out = io.StringIO()
    call_command("workqueue", *args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


# Python decodes command-line bytes that are not UTF-8 into lone surrogates (PEP 383); this is
# what `manage.py workqueue publish --partition-key $'\xff'` hands the command.
ARGV_NOT_UTF8 = os.fsdecode(b"key-\xff")


def test_the_cli_decodes_bytes_that_are_not_utf8_into_lone_surrogates():
    assert ARGV_NOT_UTF8 == "key-\udcff"


@pytest.mark.processes
def test_a_real_command_line_with_bytes_that_are_not_utf8_exits_1_without_a_traceback(topic):
    env = subprocess_environment(LC_ALL="C.UTF-8")
    argv = [sys.executable, "manage.py", "workqueue", "publish", "--topic", topic.name]
    done = subprocess.run(
        [*argv, "--payload", "1", "--partition-key", b"key-\xff"],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        timeout=120,
    )

    stderr = done.stderr.decode(errors="replace")
    assert done.returncode == 1, stderr
    assert "--partition-key holds a lone surrogate" in stderr
    assert "Traceback" not in stderr
    assert Message.objects.count() == 0


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--payload", '"\\u0000"'], "payload of message 0 holds a NUL"),
        (["--payload", '{"a": "\\ud800"}'], "payload of message 0 holds a lone surrogate"),
        (["--payload", "[" * 70 + "]" * 70], "nested more than 64 levels deep"),
        (["--payload", "[" * 100_000 + "]" * 100_000], "nested too deeply"),
        (["--payload", "NaN"], "NaN"),
        (["--payload", "1", "--partition-key", ARGV_NOT_UTF8], "--partition-key holds a lone"),
        (["--payload", "1", "--dedup-key", f"k{NUL}"], "--dedup-key holds a NUL"),
        (["--payload-ref", '{"uri": "s3://b/\\u0000"}'], "payload_ref of message 0 holds a NUL"),
    ],
    ids=["nul", "surrogate", "deep", "too-deep", "nan", "argv-surrogate", "nul-key", "ref-nul"],
)
def test_cli_publish_refuses_with_a_command_error_naming_the_field(
    topic, statements, args, expected
):
    with pytest.raises(CommandError) as refused:
        run("publish", "--topic", topic.name, *args)

    assert expected in str(refused.value)
    assert statements == []
    assert Message.objects.count() == 0


@pytest.mark.parametrize(
    "args",
    [
        ["stats", "-s", f"a{NUL}"],
        ["backlog", "-s", ARGV_NOT_UTF8],
        ["dead-letters", "-s", ARGV_NOT_UTF8],
        ["partitions", "-s", f"a{NUL}"],
        ["validate-bindings", "--transport", ARGV_NOT_UTF8],
        ["publish", "--topic", f"t{NUL}", "--payload", "{}"],
        ["apikey", "revoke", ARGV_NOT_UTF8],
        ["apikey", "create", "--user", f"ada{NUL}", "--scopes", "workqueue:read"],
    ],
    ids=["stats", "backlog", "dead-letters", "partitions", "bindings", "topic", "revoke", "user"],
)
def test_every_cli_verb_refuses_text_arguments_the_database_cannot_store(args):
    with pytest.raises(CommandError, match=r"holds a (NUL|lone surrogate)"):
        run(*args)


def test_cli_replay_and_discard_refuse_a_note_or_reason_and_change_nothing():
    sub = SubscriptionFactory()
    delivery_id = dead_letter(sub)

    with pytest.raises(CommandError, match="--note holds a NUL"):
        run("replay", "-s", sub.name, "--delivery", delivery_id, "--note", f"x{NUL}")
    with pytest.raises(CommandError, match="--reason holds a lone surrogate"):
        run("discard", "-s", sub.name, "--delivery", delivery_id, "--reason", ARGV_NOT_UTF8)

    assert Delivery.objects.get(id=delivery_id).status == "DeadLettered"
