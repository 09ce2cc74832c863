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
from ninja.errors import HttpError
from ninja.security import APIKeyHeader
from ninja.security import SessionAuth as NinjaSessionAuth

from workqueue.input_limits import holds_more_json_values
from workqueue.models import ApiKey
from workqueue.models.apikeys import KEY_PREFIX
from workqueue.operators.permissions import OPERATE, Actor, require

API_KEY_HEADER = "X-API-Key"


class ApiKeyAuth(APIKeyHeader):
    """A key issued by ``manage.py workqueue apikey create``: found by its SHA-256 hash; revoked,
    expired or owner-deactivated keys authenticate nobody. With a ``scope``, a key (or its
    owner) that may not use it is refused (403) before the request's body is read."""

    param_name = API_KEY_HEADER

    def __init__(self, scope: str | None = None) -> None:
        super().__init__()
        self.scope = scope

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
        return _allowed(
            Actor(
                user=api_key.owner,
                scopes=frozenset(api_key.scopes),
                subscriptions=frozenset(api_key.subscriptions),
                topics=frozenset(api_key.topics),
                # The audit trail names the key (its public prefix) as well as its owner.
                label=f"API key {KEY_PREFIX}_{api_key.prefix}",
            ),
            self.scope,
            request,
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

    def __init__(self, scope: str | None = None) -> None:
        super().__init__()
        self.scope = scope

    def __call__(self, request: HttpRequest) -> Any:
        user = getattr(request, "user", None)
        if user is None or not user.is_authenticated:
            return None
        return super().__call__(request)

    def authenticate(self, request: HttpRequest, key: str | None) -> Actor | None:
        return _allowed(Actor(user=request.user), self.scope, request)


#: The most JSON values and keys an operator's request body may hold: its filters, reason and
#: note are a few dozen; a body is refused by counting them, before it is parsed.
OPERATOR_BODY_MAX_JSON_VALUES = 1_000


def _allowed(actor: Actor, scope: str | None, request: HttpRequest) -> Actor:
    """``actor``, once it may use ``scope`` at all (the view then checks it on the resource).

    Checked here, before django-ninja reads and validates the body: a key without the scope
    was answered 400 for a body of unknown fields, at the cost of validating each of them
    (audit helper-137), where 403 was the answer to give. An operator's body is counted here
    too: one of 300,000 unknown fields cost 0.7 s and 390 MB to parse and validate into its
    400, for any key that may operate (review helper-190)."""
    if scope is not None:
        require(actor, scope)
    if scope == OPERATE and holds_more_json_values(request.body, OPERATOR_BODY_MAX_JSON_VALUES):
        raise HttpError(
            413,
            f"The request body holds more than {OPERATOR_BODY_MAX_JSON_VALUES} JSON values and "
            "keys (counted before it is parsed); an operator's request takes a few filters, a "
            "reason and a note.",
        )
    return actor


#: The authentication of the endpoints that take a body and operate: a caller that may not
#: operate at all is refused before the body is read.
OPERATOR_AUTH = [ApiKeyAuth(OPERATE), SessionAuth(OPERATE)]
