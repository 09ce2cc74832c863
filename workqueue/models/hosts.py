"""Host health: each running host records its state here so any web process can report it."""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.db import models

# A host that has not reported for this long is shown as gone (it reports every 10 s).
STALE_AFTER = dt.timedelta(seconds=45)
#: The states a host reports for a subscription that need no attention: running, or paused on
#: purpose (the subscription, its topic or its transport is Paused or Disabled: its work waits).
#: The others: HandlerNotRegistered, Unsupported, Error.
SERVING_STATES = frozenset({"Running", "Paused"})
#: Reasons a host records with an error's text after them (``"<headline>: <error>"``). That text
#: can name the database's host and address, or an AWS queue's URL: a caller limited to named
#: subscriptions, which is not shown the deployment's hosts, reads the headline alone.
CLAIM_LOOP_FAILED = "Claim loop failed"
RECEIVE_FAILED = "Not claiming: receive failed"
RATE_TOKENS_FAILED = "Not claiming: taking rate-limit tokens failed"
START_FAILED = "Consumer could not start"
SETTLES_REFUSED = "Claiming little: the database refuses to record outcomes"
_ERROR_HEADLINES = (
    CLAIM_LOOP_FAILED,
    RECEIVE_FAILED,
    RATE_TOKENS_FAILED,
    START_FAILED,
    SETTLES_REFUSED,
)
#: The most stuck handler runs a host lists per subscription (the oldest): it may run a
#: thousand handlers of one, and its record is rewritten every few seconds.
STUCK_RUNS_LISTED = 10


#: How a host's reason begins the names it suggests, which come last.
SUGGESTION_PREFIX = "; did you mean "


def reason_for_a_limited_caller(reason: str) -> str:
    """``reason`` as a caller limited to named subscriptions reads it: without the error text a
    host recorded after its headline, and without the names it suggested ("did you mean"),
    which a host picks among every subscription and handler key (review helper-167)."""
    for headline in _ERROR_HEADLINES:
        if reason.startswith(f"{headline}: "):
            return f"{headline} (the error is shown to callers not limited to subscriptions)"
    return reason.split(SUGGESTION_PREFIX, 1)[0]


def database_now() -> dt.datetime:
    """The database's clock, which hosts stamp their reports with: a host whose own clock is
    off is still judged by one clock. (Read as a value: SQL Server's rendering of Django's
    ``Now()`` arithmetic drops the time zone offset.)"""
    from workqueue.conf import get_settings
    from workqueue.driver import get_driver

    return get_driver(get_settings().DATABASE_ALIAS).database_now()


class HostRecordQuerySet(models.QuerySet):
    def live(self, now: dt.datetime | None = None) -> HostRecordQuerySet:
        """Hosts that reported within STALE_AFTER of ``now`` (default: the database's clock)."""
        now = database_now() if now is None else now
        return self.filter(stopped_at__isnull=True, last_seen_at__gte=now - STALE_AFTER)

    def purge_unseen(self, limit: int) -> int:
        """Delete up to ``limit`` records of hosts not seen for HOST_RECORD_RETENTION_DAYS
        (stopped, or killed before they could say so), oldest first; return how many. Each
        host start writes one: without this, a job started every minute left half a million
        rows a year."""
        from workqueue.conf import setting

        retention = dt.timedelta(days=setting("HOST_RECORD_RETENTION_DAYS"))
        unseen = self.filter(last_seen_at__lt=database_now() - retention).order_by("last_seen_at")
        return self.filter(pk__in=list(unseen.values_list("pk", flat=True)[:limit])).delete()[0]


class HostRecord(models.Model):
    instance_id = models.CharField(max_length=200, primary_key=True)
    hostname = models.CharField(max_length=255)
    pid = models.IntegerField()
    started_at = models.DateTimeField()
    last_seen_at = models.DateTimeField()
    stopped_at = models.DateTimeField(null=True, blank=True)
    #: [{"name", "state", "reason", "in_flight", "concurrency", "oldest_run_seconds",
    #: "stuck_count", "stuck_runs": [{"delivery_id", "handler_key", "seconds",
    #: "threshold_seconds"}, ...]}, ...] (runtime.host.Host.health)
    subscriptions = models.JSONField(default=list)
    #: Handler keys this host has registered (validate-bindings reports unserved ones).
    handler_keys = models.JSONField(default=list)

    objects = HostRecordQuerySet.as_manager()

    class Meta:
        ordering = ["-last_seen_at"]
        indexes = [models.Index(fields=["last_seen_at"], name="wq_host_seen_ix")]

    def __str__(self) -> str:
        return self.instance_id

    def subscription_entries(self) -> list[dict[str, Any]]:
        """The subscriptions as the host recorded them, each field in its type. A record is
        the host's own word, written by the runtime role: what is malformed in it is left out
        or read as nothing, so that it cannot break the pages and checks that read it."""
        entries = self.subscriptions if isinstance(self.subscriptions, list) else []
        return [
            {
                "name": str(entry.get("name") or ""),
                "state": str(entry.get("state") or ""),
                "reason": str(entry.get("reason") or ""),
                "in_flight": _count(entry.get("in_flight")),
                "concurrency": _count(entry.get("concurrency")),
                "oldest_run_seconds": _seconds(entry.get("oldest_run_seconds")),
                "stuck_count": _count(entry.get("stuck_count")),
                "stuck_runs": _stuck_runs(entry.get("stuck_runs")),
            }
            for entry in entries
            if isinstance(entry, dict)
        ]

    def registered_handler_keys(self) -> set[str]:
        """The handler keys the host recorded (read as the subscriptions are)."""
        keys = self.handler_keys if isinstance(self.handler_keys, list) else []
        return {key for key in keys if isinstance(key, str)}


def _count(value: Any) -> int:
    """A count as a host recorded it: a whole number of at least 0, else 0."""
    return value if type(value) is int and value >= 0 else 0


def _seconds(value: Any) -> float | None:
    """A duration as a host recorded it: a number of at least 0, else None (none known)."""
    if type(value) not in (int, float) or not 0 <= value < float("inf"):
        return None
    return float(value)


def _stuck_runs(value: Any) -> list[dict[str, Any]]:
    """The stuck runs as a host recorded them (``runtime.handler_runs``), those malformed
    left out, at most as many as a host lists."""
    runs = value if isinstance(value, list) else []
    return [
        {
            "delivery_id": run["delivery_id"],
            "handler_key": str(run.get("handler_key") or ""),
            "seconds": _seconds(run.get("seconds")) or 0.0,
            "threshold_seconds": _count(run.get("threshold_seconds")),
            # Recorded by this release on: a run an older host named was cancellable there.
            "cancellable": run.get("cancellable") is not False,
        }
        for run in runs[:STUCK_RUNS_LISTED]
        if isinstance(run, dict) and isinstance(run.get("delivery_id"), str)
    ]
