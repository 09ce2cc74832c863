"""Who reads the observability endpoints (review helper-142): ``/health``, ``/metrics`` and
``/bindings/validate`` need the read scope and ``workqueue.view_delivery``, whatever else a
caller holds; none of their refusals says anything of the queue."""

from __future__ import annotations

import pytest

from tests.factories import ApiKeyFactory, SubscriptionFactory, UserFactory
from tests.support.api import call
from tests.support.queue import dead_letter

pytestmark = pytest.mark.usefixtures("queue_db")

PATHS = ("/health", "/metrics", "/bindings/validate")


@pytest.fixture(autouse=True)
def secret_subscription(queue_db: None) -> str:
    subscription = SubscriptionFactory(name="payroll.secret")
    dead_letter(subscription)
    return subscription.name


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "caller",
    [
        "publish key",  # the key an external publisher holds
        "operate key",  # operating is not reading
        "read key of an owner without view_delivery",
    ],
)
def test_a_caller_without_read_access_is_refused_and_told_nothing(client, path, caller):
    key = {
        "publish key": lambda: ApiKeyFactory(scopes=["workqueue:publish"]),
        "operate key": lambda: ApiKeyFactory(scopes=["workqueue:operate"]),
        "read key of an owner without view_delivery": lambda: ApiKeyFactory(
            scopes=["workqueue:read"], owner=UserFactory(perms=["workqueue.add_message"])
        ),
    }[caller]()

    response = call(client, "get", path, key=key)

    assert response.status_code == 403
    assert b"payroll" not in response.content


@pytest.mark.parametrize("path", PATHS)
def test_no_credentials_or_a_session_without_the_permission_is_refused(client, path):
    assert call(client, "get", path).status_code == 401
    client.force_login(UserFactory(perms=["workqueue.add_message"]))
    response = call(client, "get", path)
    assert response.status_code == 403
    assert b"payroll" not in response.content
