"""``GET /metrics``: Prometheus text for a scraper with a read-scoped API key (or a session).

A key limited to named subscriptions gets only those subscriptions' gauges and no host names.
For an unauthenticated scrape inside the network, run hosts with ``--metrics-port`` instead.
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from ninja import Router

from workqueue import metrics
from workqueue.api.schemas import ErrorOut
from workqueue.operators.permissions import READ, Actor, require

router = Router(tags=["health"])


@router.get(
    "/metrics",
    response={200: str, 401: ErrorOut, 403: ErrorOut},
    operation_id="getMetrics",
    summary="Prometheus metrics: this process's counters and the queue's gauges",
)
def prometheus_metrics(request: HttpRequest) -> HttpResponse:
    actor: Actor = request.auth  # type: ignore[attr-defined]
    require(actor, READ)
    return HttpResponse(metrics.render(actor), content_type=metrics.CONTENT_TYPE)
