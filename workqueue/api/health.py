"""``GET /health`` (live hosts and what each subscription is doing) and
``GET /bindings/validate`` (configuration problems). Both need read access; a key limited to
named subscriptions sees only what concerns those subscriptions."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja import Router

from workqueue.api.schemas import BindingIssuesOut, ErrorOut, HealthOut
from workqueue.models import HostRecord
from workqueue.models.hosts import SERVING_STATES, STUCK_RUNS_LISTED, reason_for_a_limited_caller
from workqueue.operators import operations
from workqueue.operators.display import host_pseudonym
from workqueue.operators.permissions import READ, Actor, require

router = Router(tags=["health"])

RUNNING = "Running"
#: A subscription with due work that no live host runs.
NOT_RUNNING = "NotRunning"


@router.get(
    "/health",
    response={200: HealthOut, 401: ErrorOut, 403: ErrorOut},
    by_alias=True,
    operation_id="getHealth",
    summary="Live hosts and per-subscription states",
)
def health(request: HttpRequest) -> dict[str, Any]:
    """Read from the records that running hosts refresh every few seconds; a host that stopped
    or has not reported recently is left out. A subscription with due work that no live host
    runs is listed as NotRunning and makes the status degraded, as do a handler run past its
    threshold (``stuckRuns`` names its delivery and handler key) and a threat to the queue
    tables' upkeep (``database_warnings``: unrestricted readers only). A key limited to named
    subscriptions sees only those subscriptions and the hosts that run one of them, each under
    a pseudonym instead of its instance id, without hostname or pid."""
    actor: Actor = request.auth  # type: ignore[attr-defined]
    require(actor, READ)
    limited = bool(actor.subscriptions)
    hosts = []
    summary: dict[str, dict[str, Any]] = {}
    live_hosts = list(HostRecord.objects.live().order_by("instance_id"))
    for record in live_hosts:
        entries = [e for e in record.subscription_entries() if _visible(actor, e["name"])]
        if limited and not entries:
            continue
        if limited:
            for entry in entries:
                entry["reason"] = reason_for_a_limited_caller(entry["reason"])
        # Machine names and process ids map the deployment (and the instance id is made of
        # them): only callers who may see every subscription get them.
        hosts.append(
            {
                "instance_id": host_pseudonym(record.instance_id)
                if limited
                else record.instance_id,
                "hostname": None if limited else record.hostname,
                "pid": None if limited else record.pid,
                "started_at": record.started_at,
                "last_seen_at": record.last_seen_at,
                "subscriptions": entries,
            }
        )
        for entry in entries:
            _merge(summary, entry)
    for unserved in operations.unserved_subscriptions(actor=actor, live_hosts=live_hosts):
        if unserved.due is None:
            # Its transport could not count the backlog: validate-bindings says why.
            continue
        # Work is due and no live host runs the subscription (none lists it, or those that do
        # are not running it: they already report why). Nothing will process that work.
        summary.setdefault(
            unserved.name,
            {
                "name": unserved.name,
                "state": NOT_RUNNING,
                "reason": f"No live host runs it; {unserved.waiting()}.",
                "running_hosts": 0,
                "in_flight": 0,
                "oldest_run_seconds": None,
                "stuck_count": 0,
                "stuck_runs": [],
            },
        )
    subscriptions = [summary[name] for name in sorted(summary)]
    database_warnings = operations.database_warnings(actor=actor)
    if not hosts:
        status = "down"
    elif (
        all(s["state"] in SERVING_STATES and not s["stuck_count"] for s in subscriptions)
        and not database_warnings
    ):
        status = "ok"
    else:
        status = "degraded"
    return {
        "status": status,
        "hosts": hosts,
        "subscriptions": subscriptions,
        "database_warnings": database_warnings,
    }


def _visible(actor: Actor, name: str) -> bool:
    return not actor.subscriptions or name.strip().lower() in actor.subscriptions


def _merge(summary: dict[str, dict[str, Any]], entry: dict[str, Any]) -> None:
    running = entry["state"] == RUNNING
    current = summary.setdefault(
        entry["name"],
        {
            "name": entry["name"],
            "state": entry["state"],
            "reason": entry["reason"],
            "running_hosts": 0,
            "in_flight": 0,
            "oldest_run_seconds": None,
            "stuck_count": 0,
            "stuck_runs": [],
        },
    )
    if running:
        current["running_hosts"] += 1
        current["state"], current["reason"] = RUNNING, ""
    current["in_flight"] += entry["in_flight"]
    # Each host runs handlers of its own: the oldest of them all, and every host's stuck ones.
    ages = [
        a for a in (current["oldest_run_seconds"], entry["oldest_run_seconds"]) if a is not None
    ]
    current["oldest_run_seconds"] = max(ages, default=None)
    current["stuck_count"] += entry["stuck_count"]
    stuck = sorted([*current["stuck_runs"], *entry["stuck_runs"]], key=lambda r: -r["seconds"])
    current["stuck_runs"] = stuck[:STUCK_RUNS_LISTED]


@router.get(
    "/bindings/validate",
    response={200: BindingIssuesOut, 400: ErrorOut, 401: ErrorOut, 403: ErrorOut, 404: ErrorOut},
    by_alias=True,
    operation_id="validateBindings",
    summary="Configuration problems that would stop work from flowing",
)
def validate_bindings(request: HttpRequest, transport: str | None = None) -> dict[str, Any]:
    """Errors and Warnings, e.g. a handler key that no live host has registered. ``transport``
    limits the check to one transport."""
    issues = operations.validate_bindings(transport, actor=request.auth)  # type: ignore[attr-defined]
    return {"issues": issues}
