"""A publish from inside an open transaction that made its topic (a test's, typically): the
queue's own connection cannot see the topic, and the rejection says so."""

from __future__ import annotations

import pytest

from tests.factories import TopicFactory
from workqueue import publish
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
    with use_test_connection():
        assert publish(topic.name, {"n": 1}).status == "Accepted"


def test_a_misspelt_topic_inside_a_transaction_gets_no_transaction_hint():
    """ATOMIC_REQUESTS puts every view's publish inside a transaction: the hint is for a topic
    the transaction holds, not for every name nobody made."""
    TopicFactory(name="orders.created")

    result = publish("orders.craeted", {"n": 1})

    assert result.error.message == "No topic is named 'orders.craeted'."
