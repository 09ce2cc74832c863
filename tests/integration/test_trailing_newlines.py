"""Names must match their pattern in full: a trailing newline is not part of a valid topic,
subscription, transport or attribute name, nor of a SQLSTATE (issue 10, item 13). Python's
``$`` also matches before a final newline, so ``re.match(r"^...$")`` and Django's
``RegexValidator`` (``search``) accepted ``"orders\\n"``."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError
from django.test import Client

from tests.factories import ApiKeyFactory, SubscriptionFactory, TopicFactory, TransportFactory
from workqueue import publish
from workqueue.driver.sqlserver import _sqlstate
from workqueue.models import Subscription, Topic, Transport

pytestmark = pytest.mark.usefixtures("queue_db")


def test_an_attribute_name_ending_in_a_newline_is_rejected():
    topic = TopicFactory()

    result = publish(topic.name, {"n": 1}, attributes={"region\n": "eu"})

    assert result.status == "Rejected"
    assert result.error is not None and result.error.code == "InvalidAttributes"


def test_rest_publish_to_a_topic_name_ending_in_a_newline_is_400(client: Client):
    TopicFactory(name="orders", allow_external_publish=True)
    key = ApiKeyFactory(scopes=["workqueue:publish"], topics=["orders"])

    response = client.post(
        "/work-queue/topics/orders%0A/messages",
        data={"messages": [{"payload": {"n": 1}}]},
        content_type="application/json",
        headers={"X-API-Key": key.raw_key},
    )

    assert response.status_code == 400, response.content
    assert "topic name is not valid" in response.json()["detail"]


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: Topic(name="orders\n", transport=TransportFactory()), id="topic"),
        pytest.param(
            lambda: Subscription(name="orders.audit\n", topic=TopicFactory(), handler_key="h"),
            id="subscription",
        ),
        pytest.param(
            lambda: Transport(name="Database2\n", driver_class="Database"), id="transport"
        ),
    ],
)
def test_topology_names_ending_in_a_newline_fail_validation(make):
    with pytest.raises(ValidationError) as excinfo:
        make().full_clean()

    assert "name" in excinfo.value.error_dict


def test_a_sqlstate_followed_by_a_newline_is_not_read_as_one():
    assert _sqlstate(Exception("08S01", "[08S01] link failure")) == "08S01"
    assert _sqlstate(Exception("08S01\n", "not a SQLSTATE")) is None


def test_existing_names_still_validate():
    SubscriptionFactory(name="orders.audit").full_clean()
