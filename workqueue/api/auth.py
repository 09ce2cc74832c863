"""Who is calling: an API key in the ``X-API-Key`` header, or a signed-in Django session.

Either way ``request.auth`` becomes an operators ``Actor``, so the REST API applies exactly the
rules of the CLI and the admin (``workqueue.operators.permissions``). A key acts as its owner:
its scopes and topic/subscription limits AND the owner's Django permissions must all allow an
action. A session user has no scopes (``Actor.scopes`` is None) and is held to Django
permissions alone.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja.security import APIKeyHeader
from ninja.security import SessionAuth as NinjaSessionAuth

from workqueue.models import ApiKey
from workqueue.models.apikeys import KEY_PREFIX
from workqueue.operators.permissions import Actor

API_KEY_HEADER = "X-API-Key"


class ApiKeyAuth(APIKeyHeader):
    """A key issued by ``manage.py workqueue apikey create``: found by its SHA-256 hash; revoked,
    expired or owner-deactivated keys authenticate nobody."""

    param_name = API_KEY_HEADER
    openapi_description = (
        "An API key (shown once by `manage.py workqueue apikey create`). It acts as its owner: "
        "each call needs the key's scope (workqueue:publish, workqueue:read or "
        "workqueue:operate) and the owner's Django permission."
    )

    def authenticate(self, request: HttpRequest, key: str | None) -> Actor | None:
        if not key:
            return None
        api_key = ApiKey.objects.authenticate(key)
        if api_key is None:
            return None
        return Actor(
            user=api_key.owner,
            scopes=frozenset(api_key.scopes),
            subscriptions=frozenset(api_key.subscriptions),
            topics=frozenset(api_key.topics),
            # The audit trail names the key (its public prefix) as well as its owner.
            label=f"API key {KEY_PREFIX}_{api_key.prefix}",
        )


class SessionAuth(NinjaSessionAuth):
    """A signed-in Django user (e.g. from the admin), held to Django permissions.

    CSRF stays on for unsafe methods: ninja checks it when the session is used. The check runs
    only for a signed-in user, so a request with no credentials at all gets 401, not a CSRF 403.
    """

    openapi_description = (
        "A Django session cookie (sign in through the admin); unsafe methods also need the "
        "CSRF token in the X-CSRFToken header."
    )

    def __call__(self, request: HttpRequest) -> Any:
        user = getattr(request, "user", None)
        if user is None or not user.is_authenticated:
            return None
        return super().__call__(request)

    def authenticate(self, request: HttpRequest, key: str | None) -> Actor | None:
        return Actor(user=request.user)
