"""A publish from inside an open transaction that made its topic (a test's, typically): the
queue's own connection cannot see the topic, and the rejection says so."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

from tests.factories import TopicFactory
from workqueue import publish, publish_many
from workqueue.testing import use_test_connection

pytestmark = pytest.mark.django_db(transaction=False)


def test_a_topic_the_callers_open_transaction_made_is_unknown_and_the_error_says_why():
    """Topology made in a test's transaction (a TestCase, pytest-django's db) is invisible to
    the queue's own connection: the publish said only "No topic has this name.", naming
    neither the topic nor test mode."""
    topic = TopicFactory(name="orders.created")  # not committed: the test's transaction

    result = publish(topic.name, {"n": 1})

    assert result.error.code == "TopicNotFound"
    assert "No topic is named 'orders.created'." in result.error.message
    assert "cannot see a topic your open transaction made" in result.error.message
    assert "workqueue.testing.use_test_connection()" in result.error.message
    assert "context manager in a pytest fixture" in result.error.message
    # It read back the caller's own rows: "Did you mean 'orders.created'?" (helper-118).
    assert "Did you mean" not in result.error.message
    with use_test_connection():
        assert publish(topic.name, {"n": 1}).status == "Accepted"


def test_a_misspelt_topic_inside_a_transaction_gets_no_transaction_hint():
    """ATOMIC_REQUESTS puts every view's publish inside a transaction: the hint is for a topic
    the transaction holds, not for every name nobody made."""
    TopicFactory(name="orders.created")

    result = publish("orders.craeted", {"n": 1})

    assert result.error.message.startswith(
        "No topic is named 'orders.craeted'. Did you mean 'orders.created'? Create it"
    )
    assert "transaction" not in result.error.message


def test_in_test_mode_a_publish_with_no_delay_is_due_in_its_own_transaction():
    """A delay counted from the call made `delay_seconds=0` due at the call, after the
    transaction's start that claims read as now: run_until_idle in the same test ran nothing."""
    from tests.factories import SubscriptionFactory
    from tests.support import handlers  # registers "tests.noop"
    from workqueue.testing import run_until_idle

    assert handlers.NoopHandler
    get_user_model().objects.create_user("workqueue-system")  # WORKQUEUE["SYSTEM_USER"]
    sub = SubscriptionFactory(handler_key="tests.noop")
    with use_test_connection():
        publish(sub.topic.name, {"n": 1}, delay_seconds=0)
        publish_many(sub.topic, [{"payload": {"n": 2}, "delay_seconds": 0}] * 2)
        runs = run_until_idle(sub.name)

    assert [run.status for run in runs] == ["Completed"] * 3


@pytest.mark.parametrize("many", [False, True], ids=["publish", "publish_many"])
# Its atomic block only starts a transaction early; what that warning is about, the block's
# rollback taking the publish, is not in question here.
@pytest.mark.filterwarnings("ignore::workqueue.exceptions.PublishInsideAtomicInTestWarning")
def test_a_delay_of_the_whole_retention_is_taken_late_in_a_transaction(many):
    """The delay runs from the call and the retention from the transaction's start: the
    longest delay (the retention in seconds) was refused as InvalidSchedule when enlisted."""
    import time

    from django.db import connection, transaction

    from tests.factories import SubscriptionFactory

    topic = SubscriptionFactory(topic=TopicFactory(retention_days=1)).topic
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SELECT now()")  # the transaction starts here
        time.sleep(0.2)
        with use_test_connection():
            if many:
                results = publish_many(
                    topic, [{"payload": {"n": n}, "delay_seconds": 86_400} for n in range(2)]
                )
            else:
                results = [publish(topic.name, {"n": 1}, delay_seconds=86_400)]
            too_far = publish(topic.name, {"n": 9}, delay_seconds=86_401)

    assert {r.status for r in results} == {"Accepted"}, results
    assert too_far.error.code == "InvalidSchedule"
