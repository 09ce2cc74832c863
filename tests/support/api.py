"""Requests to the REST API through Django's test client, as a client would send them."""

from __future__ import annotations

import json
from typing import Any

from django.test import Client

from tests.factories import ApiKeyFactory
from workqueue.models import ApiKey, Message
from workqueue.operators.permissions import OPERATE, READ


def url(topic: str) -> str:
    """The publish endpoint of ``topic``."""
    return f"/work-queue/topics/{topic}/messages"


def post(
    client: Client,
    topic: str,
    body: Any = None,
    *,
    key: ApiKey | None = None,
    raw: str | bytes | None = None,
    **extra: Any,
) -> Any:
    """A publish request: ``body`` as JSON, or ``raw`` bytes as they are."""
    headers = {"X-API-Key": key.raw_key} if key is not None else {}
    data = raw if raw is not None else json.dumps(body)
    return client.post(
        url(topic), data=data, content_type="application/json", headers=headers, **extra
    )


def assert_refused(response: Any, status: int) -> dict[str, Any]:
    """``response`` is a refusal with ``status`` that names its problem, and nothing was
    stored; its body."""
    assert response.status_code == status, response.content
    assert Message.objects.count() == 0
    body = response.json()
    assert isinstance(body["detail"], str)
    return body


def call(
    client: Client, method: str, path: str, body: Any = None, *, key: Any = None, **params: Any
) -> Any:
    """``GET`` (``params`` as the query) or ``POST`` (``body`` as JSON) of an operator
    endpoint under ``/work-queue``, with API key ``key`` when given."""
    headers = {"X-API-Key": key.raw_key} if key is not None else {}
    path = f"/work-queue{path}"
    if method == "get":
        return client.get(path, params, headers=headers)
    data = json.dumps(body) if body is not None else ""
    return client.post(path, data=data, content_type="application/json", headers=headers)


def reader(**kwargs: Any) -> ApiKey:
    """A key with the read scope (its owner holds every permission unless ``owner`` says)."""
    return ApiKeyFactory(scopes=[READ], **kwargs)


def operator(**kwargs: Any) -> ApiKey:
    """A key with the operate scope (its owner holds every permission unless ``owner`` says)."""
    return ApiKeyFactory(scopes=[OPERATE], **kwargs)
