"""The work queue's REST API: one NinjaAPI assembled from a router per resource.

Mount it with ``path("work-queue/", include("workqueue.api.urls"))``; the OpenAPI docs are then
at ``/work-queue/docs``, with Swagger UI served from the installed packages (``api.docs``).
Every other endpoint needs an API key (``X-API-Key``) or a Django session.

Errors are mapped to status codes here, in one place: bad input 400 (a value the database
refuses too), missing scope or permission 403, unknown name 404, a database failure 503. Error
bodies are ``{"detail": "..."}`` with a message written for the
caller; anything unexpected is logged and answered with a fixed text, never with internals.
"""

from __future__ import annotations

import logging

from django.core.exceptions import RequestDataTooBig, SuspiciousOperation
from django.http import Http404, HttpRequest, HttpResponse
from django.http.request import RawPostDataException
from django.views.decorators.cache import never_cache
from ninja import NinjaAPI
from ninja.errors import HttpError, ValidationError

from workqueue.api import docs, health, metrics, publish, subscriptions
from workqueue.api.auth import ApiKeyAuth, SessionAuth
from workqueue.api.schemas import field_errors
from workqueue.driver import database_away, in_driver_terms, refused_a_grant
from workqueue.exceptions import (
    BulkOperationInterrupted,
    DeliveryBusyError,
    DriverError,
    InvalidInputError,
    NotFoundError,
    PermissionDeniedError,
    UnstorableValueError,
    UnsupportedByTransportError,
    WorkQueueError,
    one_line,
)

logger = logging.getLogger(__name__)

api = NinjaAPI(
    title="Work queue",
    version="1",
    description="Publish messages and operate the work queue's subscriptions.",
    urls_namespace="workqueue",
    auth=[ApiKeyAuth(), SessionAuth()],
    docs_url="/docs",
    docs=docs.OfflineSwagger(),
)
# Every answer but the docs page's files is the caller's own (payloads, dead letters, error
# texts) and kept by no cache, as the admin keeps its pages: the dashboard links a browser to
# the dead-letter listing, which a browser stored and showed again from its history after the
# session had ended (review helper-143). Before add_router, which freezes the routers.
for _router in (publish.router, subscriptions.router, health.router, metrics.router):
    _router.add_decorator(never_cache, mode="view")
api.add_router("", publish.router)
api.add_router("/subscriptions", subscriptions.router)
api.add_router("", health.router)
api.add_router("", metrics.router)
api.add_router("", docs.router)

# The caller's mistakes: the operators' messages are written for the caller, so they are shown.
_CALLER_ERRORS: dict[type[WorkQueueError], int] = {
    InvalidInputError: 400,
    PermissionDeniedError: 403,
    NotFoundError: 404,
}
SERVER_ERROR = "The request could not be completed; the error was logged."
DATABASE_UNAVAILABLE = "The work queue's database is unavailable; try again shortly."
UNSTORABLE_VALUE = (
    "The request holds a value the work queue's database cannot store (such as a NUL "
    "character); nothing was stored. Sending it again will fail the same way."
)


def _error(request: HttpRequest, status: int, detail: str, **extra: object) -> HttpResponse:
    return api.create_response(request, {"detail": detail, **extra}, status=status)


@api.exception_handler(WorkQueueError)
def _work_queue_error(request: HttpRequest, exc: WorkQueueError) -> HttpResponse:
    if isinstance(exc, DeliveryBusyError):
        # Sound, but the delivery's row is held by its handler's open transaction: 409, and the
        # same request succeeds (or finds the delivery settled) once that transaction ends.
        return _error(request, 409, str(exc), deliveryId=exc.delivery_id)
    if isinstance(exc, UnsupportedByTransportError):
        # The request is sound but the subscription's transport cannot do it: 409 Conflict
        # with the state of the topology, naming the missing capability.
        return _error(request, 409, str(exc), capability=exc.capability)
    for error_class, status in _CALLER_ERRORS.items():
        if isinstance(exc, error_class):
            return _error(request, status, str(exc))
    if isinstance(exc, UnstorableValueError):
        # The caller's value, refused by the database rather than by the input checks: 400, not
        # a 503 that invites the same request again. Logged, since a check let it through; the
        # database's text may quote the value, so the caller gets a fixed message.
        logger.warning(
            "The database refused a value in a work queue API request",
            exc_info=exc,
            extra={"action": "api_unstorable_value"},
        )
        return _error(request, 400, UNSTORABLE_VALUE)
    if refused_a_grant(exc) or database_away(exc):
        return _database_unavailable(request, exc)
    logger.exception("Work queue API request failed", extra={"action": "api_error"})
    if isinstance(exc, BulkOperationInterrupted):
        # Its committed batches stay applied: the caller is told how much they did, with the
        # answer the failure itself gets (not its text).
        done = {"matched": exc.matched, "examined": exc.examined, "batches": exc.batches}
        if isinstance(exc.__cause__, DriverError):
            return _error(request, 503, DATABASE_UNAVAILABLE, **done)
        return _error(request, 500, SERVER_ERROR, **done)
    if isinstance(exc, DriverError):
        return _error(request, 503, DATABASE_UNAVAILABLE)
    return _error(request, 500, SERVER_ERROR)


@api.exception_handler(HttpError)
def _http_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
    errors = getattr(exc, "errors", None)
    extra = {"errors": errors} if errors is not None else {}
    return _error(request, exc.status_code, exc.message, **extra)


@api.exception_handler(ValidationError)
def _validation_error(request: HttpRequest, exc: ValidationError) -> HttpResponse:
    # ninja's own parameter checks (e.g. page_size=abc): 400 like every other bad input, with
    # where and what, but not the input itself.
    return _error(request, 400, "The request is not valid.", errors=field_errors(exc.errors))


@api.exception_handler(Http404)
def _not_found(request: HttpRequest, exc: Http404) -> HttpResponse:
    return _error(request, 404, "Not found.")


@api.exception_handler(SuspiciousOperation)
def _refused_request(request: HttpRequest, exc: SuspiciousOperation) -> HttpResponse:
    # Raised by Django reading the body, before any of the API's own checks (django-ninja reads
    # it outside its validation): the caller's mistake, not a server error. Logged where Django
    # logs it when it answers such a request itself, for whoever watches django.security.
    status = 413 if isinstance(exc, RequestDataTooBig) else 400
    logging.getLogger(f"django.security.{type(exc).__name__}").error(
        str(exc), exc_info=exc, extra={"status_code": status, "request": request}
    )
    if status == 413:
        return _error(
            request,
            413,
            "The request body is larger than this server accepts "
            "(Django's DATA_UPLOAD_MAX_MEMORY_SIZE).",
        )
    return _error(request, 400, "The request is not valid.")


@api.exception_handler(RawPostDataException)
def _form_body(request: HttpRequest, exc: RawPostDataException) -> HttpResponse:
    # A signed-in session's form post (multipart): the CSRF check read the form, which uses up
    # the body, before django-ninja could read it as JSON (a 500 until audit helper-137).
    return _error(request, 400, "Send the request body as JSON (Content-Type: application/json).")


@api.exception_handler(Exception)
def _unexpected(request: HttpRequest, exc: Exception) -> HttpResponse:
    if database_away(exc) or refused_a_grant(exc):
        # Django's own reads and writes (the API key, topology, host records) with the
        # database away, read-only or refusing the role a grant: the 503 the queue's own calls
        # answer then, so a load balancer or on-call engineer can tell an outage from a bug.
        return _database_unavailable(request, exc)
    logger.exception("Work queue API request failed", extra={"action": "api_error"})
    return _error(request, 500, SERVER_ERROR)


def _database_unavailable(request: HttpRequest, exc: Exception) -> HttpResponse:
    # The database away, refusing writes or refusing this role a grant: every request fails
    # alike until that is fixed, and the error's text says which; a traceback for each one (a
    # client retrying, a dashboard polling) added nothing but volume.
    logger.warning(
        "Work queue API request failed: %s",
        one_line(in_driver_terms(exc)),  # the ORM's errors too, with what to do about them
        extra={"action": "api_database_unavailable"},
    )
    return _error(request, 503, DATABASE_UNAVAILABLE)
