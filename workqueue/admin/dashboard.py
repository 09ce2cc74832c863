"""The work queue dashboard: per-subscription counts, live hosts and an hour of throughput.

Served at ``<admin>/workqueue/delivery/dashboard/`` (URL name ``admin:workqueue_dashboard``)
from the Delivery admin's ``get_urls()``, and linked from the admin index. It needs the
operators' READ permission (``workqueue.view_delivery``); other staff users get 403 and no link.
The chart is inline SVG drawn on the server: no script, no CDN.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Q
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import NoReverseMatch, URLPattern, path, reverse
from django.utils import timezone

from workqueue.admin.display import visible_text
from workqueue.conf import get_settings
from workqueue.exceptions import PermissionDeniedError, WorkQueueConfigurationError
from workqueue.models import Delivery, HostRecord, Subscription
from workqueue.models.hosts import SERVING_STATES, database_now
from workqueue.operators import operations
from workqueue.operators.permissions import READ, Actor, require
from workqueue.runtime.handler_runs import what_to_do
from workqueue.types import DeliveryStatus

DASHBOARD_TEMPLATE = "workqueue/admin/dashboard.html"
INDEX_TEMPLATE = "workqueue/admin/index.html"
BUCKET = dt.timedelta(minutes=5)
BUCKETS = 12  # one hour
#: Subscriptions whose deliveries one throughput query counts.
SUBSCRIPTIONS_A_QUERY = 1000

# Chart geometry (SVG user units).
WIDTH, HEIGHT = 720, 220
LEFT, RIGHT, TOP, BOTTOM = 44, 8, 12, 28


def link_dashboard_from_index(site: admin.AdminSite) -> None:
    """Show a dashboard link on ``site``'s index page, unless the project chose its own index
    template (then it can link ``admin:workqueue_dashboard`` itself)."""
    if site.index_template is None:
        site.index_template = INDEX_TEMPLATE


@dataclass(frozen=True, slots=True)
class ThroughputBucket:
    start: dt.datetime
    end: dt.datetime
    completed: int
    dead_lettered: int


def throughput(now: dt.datetime | None = None) -> list[ThroughputBucket]:
    """Completions and dead letters per five minutes over the last hour, oldest first.

    Buckets sit on five-minute clock boundaries; the last is the current, partial one. A dead
    letter counts while it is dead-lettered or after it was discarded; a replay clears its
    dead-letter time, so replayed ones drop out. One query per thousand subscriptions, reading
    only rows the partial indexes on terminal and open deliveries cover.
    """
    now = now or timezone.now()
    current = now.replace(second=0, microsecond=0) - dt.timedelta(minutes=now.minute % 5)
    edges = [current - BUCKET * (BUCKETS - 1 - i) for i in range(BUCKETS + 1)]
    start = edges[0]
    aggregates: dict[str, Any] = {}
    for i in range(BUCKETS):
        low, high = edges[i], edges[i + 1]
        aggregates[f"completed_{i}"] = Count(
            "pk",
            filter=Q(status=DeliveryStatus.COMPLETED, completed_at__gte=low, completed_at__lt=high),
        )
        aggregates[f"dead_lettered_{i}"] = Count(
            "pk", filter=Q(dead_lettered_at__gte=low, dead_lettered_at__lt=high)
        )
    # Each subscription's rows along its own index entries (wq_dlv_settled_ix leads with the
    # subscription): a list of ids lets the database walk them one subscription at a time, in
    # chunks that stay far below SQL Server's 2,100 parameters a statement.
    subscriptions = list(Subscription.objects.values_list("pk", flat=True))
    counts = dict.fromkeys(aggregates, 0)
    for first in range(0, len(subscriptions), SUBSCRIPTIONS_A_QUERY):
        chunk = subscriptions[first : first + SUBSCRIPTIONS_A_QUERY]
        counted = (
            Delivery.objects.filter(subscription_id__in=chunk)
            .filter(
                Q(status=DeliveryStatus.COMPLETED, completed_at__gte=start)
                | Q(status=DeliveryStatus.DEAD_LETTERED, dead_lettered_at__gte=start)
                | Q(
                    status=DeliveryStatus.DISCARDED,
                    completed_at__gte=start,
                    dead_lettered_at__gte=start,
                )
            )
            .aggregate(**aggregates)
        )
        for name, value in counted.items():
            counts[name] += value
    return [
        ThroughputBucket(
            edges[i], edges[i + 1], counts[f"completed_{i}"], counts[f"dead_lettered_{i}"]
        )
        for i in range(BUCKETS)
    ]


def _nice_ceiling(value: int) -> int:
    """The axis maximum: the smallest 1, 2 or 5 times a power of ten that is >= ``value``."""
    step = 1
    while True:
        for factor in (1, 2, 5):
            if factor * step >= value:
                return factor * step
        step *= 10


def _clock(moment: dt.datetime) -> str:
    return timezone.localtime(moment).strftime("%H:%M")


def chart(buckets: list[ThroughputBucket]) -> dict[str, Any]:
    """Everything the template needs to draw the bar chart; coordinates are preformatted
    strings so number localisation cannot break the SVG."""
    plot_width, plot_height = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    values = [1, *(b.completed for b in buckets), *(b.dead_lettered for b in buckets)]
    top_value = _nice_ceiling(max(values))
    slot = plot_width / len(buckets)
    bar_width = slot * 0.38
    baseline = TOP + plot_height

    def bar(x: float, value: int, series: str, bucket: ThroughputBucket) -> dict[str, str]:
        height = plot_height * value / top_value
        return {
            "series": series,
            "x": f"{x:.1f}",
            "y": f"{baseline - height:.1f}",
            "width": f"{bar_width:.1f}",
            "height": f"{height:.1f}",
            "title": f"{_clock(bucket.start)} to {_clock(bucket.end)}: {value} {series}",
        }

    bars = []
    for i, bucket in enumerate(buckets):
        x = LEFT + i * slot + slot * 0.1
        bars.append(bar(x, bucket.completed, "completed", bucket))
        bars.append(bar(x + bar_width + slot * 0.04, bucket.dead_lettered, "dead-lettered", bucket))
    ticks = [0, top_value] if top_value < 2 else [0, top_value // 2, top_value]
    return {
        "width": WIDTH,
        "height": HEIGHT,
        "bars": bars,
        "plot": {
            "left": LEFT,
            "right": WIDTH - RIGHT,
            "top": TOP,
            "baseline": baseline,
            "label_y": baseline + 18,
        },
        "y_ticks": [
            {
                "y": f"{baseline - plot_height * t / top_value:.1f}",
                "text_y": f"{baseline - plot_height * t / top_value + 4:.1f}",
                "label": t,
            }
            for t in ticks
        ],
        "x_labels": [
            {"x": f"{LEFT + i * slot:.1f}", "label": _clock(buckets[i].start)}
            for i in range(0, len(buckets), 3)
        ],
        "completed": sum(b.completed for b in buckets),
        "dead_lettered": sum(b.dead_lettered for b in buckets),
    }


def _age(seconds: int | None) -> str:
    if seconds is None:
        return "—"
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m {seconds}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes}m"


def _host(record: HostRecord, now: dt.datetime) -> dict[str, Any]:
    """A live host's row; ``now`` is the database's clock, which stamped its report (the web
    server's own clock may be off by minutes)."""
    subscriptions = record.subscription_entries()
    for entry in subscriptions:
        oldest = entry["oldest_run_seconds"]
        entry["oldest_run"] = _age(None if oldest is None else int(oldest))
        for run in entry["stuck_runs"]:
            run["age"] = _age(int(run["seconds"]))
            # A cloud queue's delivery id is its message's text: drawn with what would not
            # show escaped, as the delivery list draws publishers' text.
            run["what_to_do"] = what_to_do(entry["name"], run["delivery_id"], run["cancellable"])
            run["delivery_id"] = visible_text(run["delivery_id"])
            run["handler_key"] = visible_text(run["handler_key"])
        # The runs past the ten a host names (it counts them all).
        entry["stuck_unlisted"] = entry["stuck_count"] - len(entry["stuck_runs"])
    seen_seconds_ago = max(0, int((now - record.last_seen_at).total_seconds()))
    return {
        "record": record,
        "seen_seconds_ago": seen_seconds_ago,
        "seen_ago": _age(seen_seconds_ago),
        "subscriptions": subscriptions,
        # A stuck handler run needs an operator as much as a subscription that cannot run.
        "healthy": all(
            s["state"] in SERVING_STATES and not s["stuck_count"] for s in subscriptions
        ),
        "in_flight": sum(s["in_flight"] for s in subscriptions),
    }


def dashboard_context(request: HttpRequest, site_name: str) -> dict[str, Any]:
    """Read everything the dashboard shows; raises PermissionDeniedError without READ."""
    actor = Actor(user=request.user)
    require(actor, READ)
    report = operations.subscription_stats(actor=actor)
    rows_by_name = {
        row.name: row for row in Subscription.objects.select_related("topic__transport")
    }
    changelist = reverse(f"{site_name}:workqueue_delivery_changelist")
    rows = []
    not_charted = []
    for stats in report.subscriptions:
        subscription = rows_by_name.get(stats.subscription_name)
        if subscription is not None and _deliveries_in_database(subscription):
            query = f"?subscription__id__exact={subscription.pk}"
            deliveries_url = changelist + query
            dead_letters_url = f"{changelist}{query}&status__exact=DeadLettered"
        else:
            # Its deliveries live in the transport (an SQS queue), not in the Delivery table:
            # the subscription's page, and its dead letters as the operator API lists them.
            not_charted.append(stats.subscription_name)
            deliveries_url = (
                reverse(f"{site_name}:workqueue_subscription_change", args=[subscription.pk])
                if subscription is not None
                else ""
            )
            dead_letters_url = _api_dead_letters_url(stats.subscription_name)
        rows.append(
            {
                "stats": stats,
                "oldest_pending_age": _age(stats.oldest_pending_age_seconds),
                "deliveries_url": deliveries_url,
                "dead_letters_url": dead_letters_url,
            }
        )
    database_clock = database_now()
    return {
        "rows": rows,
        "capped": [stats.subscription_name for stats in report.subscriptions if stats.capped],
        "stats_count_cap": get_settings().STATS_COUNT_CAP,
        "failures": report.failures,
        "hosts": [
            _host(record, database_clock) for record in HostRecord.objects.live(database_clock)
        ],
        "chart": chart(throughput(database_clock)),
        # The chart counts the Delivery table; these subscriptions' transports keep no
        # history of completions there.
        "not_charted": not_charted,
        "as_of": timezone.now(),
    }


def _api_dead_letters_url(subscription_name: str) -> str:
    """The operator API's dead-letter listing, or "" when the project does not mount the API."""
    try:
        return reverse("workqueue:dead_letters", kwargs={"name": subscription_name})
    except NoReverseMatch:
        return ""


def _deliveries_in_database(subscription: Subscription) -> bool:
    try:
        return subscription.topic.transport.transport_class.keeps_deliveries_in_database
    except WorkQueueConfigurationError:
        return False  # an unregistered transport: validate-bindings reports it


class DashboardMixin:
    """Adds the dashboard URL to the ModelAdmin it is mixed into (the Delivery admin)."""

    admin_site: admin.AdminSite

    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view(self.dashboard_view)
        # Before the model's own URLs: "<path:object_id>/" would otherwise match "dashboard/".
        return [path("dashboard/", view, name="workqueue_dashboard"), *super().get_urls()]  # type: ignore[misc]

    def dashboard_view(self, request: HttpRequest) -> TemplateResponse:
        try:
            data = dashboard_context(request, self.admin_site.name)
        except PermissionDeniedError as exc:
            raise PermissionDenied(str(exc)) from exc
        request.current_app = self.admin_site.name
        context = {
            **self.admin_site.each_context(request),
            "title": "Work queue dashboard",
            "subtitle": None,
            **data,
        }
        return TemplateResponse(request, DASHBOARD_TEMPLATE, context)
