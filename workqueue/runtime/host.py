"""The host: plans which subscriptions this process runs, runs a consumer for each, re-plans
while running, drains on shutdown and records its health for other processes to read.

Planning, per requested subscription (first match wins): not found → Error; not a work-queue
host subscription → Unsupported; subscription, topic or transport not Active → Paused (the
reason says which); not the Database transport → Unsupported; no registered handler for its key
→ HandlerNotRegistered (its deliveries stay Pending for hosts that have one); else Running.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from django.contrib.auth import get_user_model
from django.db import close_old_connections
from django.utils import timezone

from workqueue import signals
from workqueue.conf import WorkQueueSettings, get_settings
from workqueue.driver import get_driver
from workqueue.exceptions import WorkQueueConfigurationError
from workqueue.runtime.consumer import Consumer, ConsumerConfig, RunBudget
from workqueue.runtime.handlers import HandlerRegistry, autodiscover, handler_registry
from workqueue.runtime.plan import SubscriptionPlan
from workqueue.runtime.service import PeriodicService
from workqueue.runtime.sweeper import Sweeper
from workqueue.runtime.timers import TimerQueue
from workqueue.runtime.wakeup import Wakeup
from workqueue.transport import new_instance_id

logger = logging.getLogger(__name__)

HEALTH_INTERVAL_SECONDS = 10.0
WILDCARD = "*"


class PlanState:
    RUNNING = "Running"
    PAUSED = "Paused"
    HANDLER_NOT_REGISTERED = "HandlerNotRegistered"
    UNSUPPORTED = "Unsupported"
    ERROR = "Error"


@dataclass(frozen=True, slots=True)
class PlanEntry:
    name: str
    state: str
    reason: str = ""
    concurrency: int = 1
    plan: SubscriptionPlan | None = None


@dataclass(frozen=True, slots=True)
class RunOnceResult:
    processed: int
    reason: str  # MaxDeliveries | Idle | MaxDuration | Shutdown


@dataclass(slots=True)
class HostConfig:
    subscriptions: list[dict[str, Any]]
    idle_poll_min_ms: int = 250
    idle_poll_max_ms: int = 5000
    shutdown_drain_ms: int = 8000
    sweeper_interval_ms: int = 60000
    reconcile_interval_ms: int = 30000
    instance_id: str = field(default_factory=new_instance_id)

    @classmethod
    def from_settings(
        cls, conf: WorkQueueSettings, names: list[str] | None = None, **overrides: Any
    ) -> HostConfig:
        subscriptions = (
            [{"name": name, "concurrency": overrides.pop("concurrency", 1)} for name in names]
            if names
            else [dict(entry) for entry in conf.SUBSCRIPTIONS]
        )
        config = cls(
            subscriptions=subscriptions,
            idle_poll_min_ms=conf.IDLE_POLL_MIN_MS,
            idle_poll_max_ms=conf.IDLE_POLL_MAX_MS,
            shutdown_drain_ms=conf.SHUTDOWN_DRAIN_MS,
            sweeper_interval_ms=conf.SWEEPER_INTERVAL_MS if conf.SWEEPER_ENABLED else 0,
            reconcile_interval_ms=conf.RECONCILE_INTERVAL_MS,
        )
        for key, value in overrides.items():
            setattr(config, key, value)
        return config


def resolve_system_user(conf: WorkQueueSettings | None = None) -> Any:
    """The user handlers run as (WORKQUEUE['SYSTEM_USER'], a username or e-mail)."""
    conf = conf or get_settings()
    name = (conf.SYSTEM_USER or "").strip()
    if not name:
        raise WorkQueueConfigurationError(
            "WORKQUEUE['SYSTEM_USER'] is not set. Set it (or WORKQUEUE_SYSTEM_USER) to the "
            "username or e-mail of an existing user; handlers and the sweeper run as that user."
        )
    User = get_user_model()
    user = User._default_manager.filter(**{User.USERNAME_FIELD: name}).first()
    if user is None and hasattr(User, "email"):
        user = User._default_manager.filter(email__iexact=name).first()
    if user is None:
        raise WorkQueueConfigurationError(
            f"WORKQUEUE['SYSTEM_USER'] is {name!r}, but no user has that username or e-mail. "
            "Create the user (e.g. `manage.py createsuperuser`) or change the setting."
        )
    return user


class Host:
    def __init__(self, config: HostConfig, registry: HandlerRegistry = handler_registry) -> None:
        self.config = config
        self.instance_id = config.instance_id
        self.registry = registry
        self.started_at = timezone.now()
        self._lock = threading.RLock()
        self._consumers: dict[str, Consumer] = {}
        self._plans: dict[str, PlanEntry] = {}
        self._started = False
        self._shut_down = threading.Event()
        self._shutting_down = False
        self._services: list[PeriodicService] = []
        self._timers: TimerQueue | None = None
        self._wakeup: Wakeup | None = None
        self._budget: RunBudget | None = None
        self.user: Any = None
        #: Handlers still running when shutdown gave up waiting (left to lease expiry).
        self.abandoned_handlers = 0

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, *, once: bool = False) -> None:
        """Discover handlers, check the system user, plan and start the consumers.

        Raises WorkQueueConfigurationError (naming the setting) when the host cannot run.
        """
        with self._lock:
            if self._started:
                raise RuntimeError("This host has already been started")
            self._started = True
            conf = get_settings()
            autodiscover(conf.HANDLER_MODULES)
            self.user = resolve_system_user(conf)
            self._timers = TimerQueue()
            self._wakeup = Wakeup(get_driver(conf.DATABASE_ALIAS))
            self._wakeup.on_cancel(self._on_cancel)
            self._wakeup.start()
            signals.published.connect(self._on_published, dispatch_uid=self.instance_id)
            self.reconcile()
            self._services.append(
                PeriodicService("wq-health", HEALTH_INTERVAL_SECONDS, self.record_health)
            )
            if not once:
                self._services.append(
                    PeriodicService(
                        "wq-reconcile", self.config.reconcile_interval_ms / 1000, self.reconcile
                    )
                )
                self._services.append(
                    PeriodicService(
                        "wq-sweeper", self.config.sweeper_interval_ms / 1000, Sweeper().run_once
                    )
                )
            for service in self._services:
                service.start()
        self.record_health()
        logger.info(
            "Host %s started: %s",
            self.instance_id,
            ", ".join(f"{e.name}={e.state}" for e in self._plans.values()) or "no subscriptions",
            extra={"action": "host_started"},
        )

    def shutdown(self) -> None:
        """Stop claiming, drain running handlers, abort the rest, drain again. Idempotent:
        every caller returns once the drain is over."""
        with self._lock:
            first = not self._shutting_down
            self._shutting_down = True
        if not first:
            self._shut_down.wait()
            return
        try:
            for service in self._services:
                service.stop()
            signals.published.disconnect(dispatch_uid=self.instance_id)
            with self._lock:
                consumers = list(self._consumers.values())
                self._consumers.clear()
                self._plans = {
                    name: PlanEntry(name, PlanState.PAUSED, "Host is shut down", entry.concurrency)
                    if entry.state == PlanState.RUNNING
                    else entry
                    for name, entry in self._plans.items()
                }
            stoppers = [threading.Thread(target=c.stop) for c in consumers]
            for thread in stoppers:
                thread.start()
            for thread in stoppers:
                thread.join()
            self.abandoned_handlers = sum(c.abandoned for c in consumers)
            if self._wakeup is not None:
                self._wakeup.stop()
            if self._timers is not None:
                self._timers.stop()
            self.record_health(stopped=True)
        finally:
            self._shut_down.set()
            close_old_connections()
        logger.info("Host %s stopped", self.instance_id, extra={"action": "host_stopped"})

    # -- planning --------------------------------------------------------------------------

    def plan(self) -> dict[str, PlanEntry]:
        """Decide what each requested subscription should do now (reads topology)."""
        from workqueue.models import Subscription

        requested: dict[str, int] = {}
        wildcard: int | None = None
        for entry in self.config.subscriptions:
            name = str(entry.get("name", "")).strip().lower()
            concurrency = max(int(entry.get("concurrency", 1)), 1)
            if name == WILDCARD:
                wildcard = concurrency
            elif name:
                requested[name] = concurrency
        subscriptions = Subscription.objects.select_related("topic__transport")
        found = {s.name: s for s in subscriptions.filter(name__in=list(requested))}
        if wildcard is not None:
            for subscription in subscriptions.filter(host_type="Worker"):
                found.setdefault(subscription.name, subscription)
                requested.setdefault(subscription.name, wildcard)
        return {
            name: self._plan_one(name, found.get(name), concurrency)
            for name, concurrency in sorted(requested.items())
        }

    def _plan_one(self, name: str, subscription: Any, concurrency: int) -> PlanEntry:
        def entry(state: str, reason: str = "") -> PlanEntry:
            return PlanEntry(name, state, reason, concurrency)

        if subscription is None:
            return entry(PlanState.ERROR, "Subscription not found")
        if subscription.host_type != "Worker":
            return entry(PlanState.UNSUPPORTED, "Consumed by an external host, not this one")
        topic, transport = subscription.topic, subscription.topic.transport
        if subscription.status != "Active":
            return entry(PlanState.PAUSED, f"Subscription is {subscription.status}")
        if topic.status != "Active":
            return entry(PlanState.PAUSED, f"Topic {topic.name} is {topic.status}")
        if transport.status != "Active":
            return entry(PlanState.PAUSED, f"Transport {transport.name} is {transport.status}")
        if not transport.is_database:
            return entry(PlanState.UNSUPPORTED, f"Transport driver {transport.driver_class}")
        if not subscription.handler_key.strip():
            return entry(PlanState.HANDLER_NOT_REGISTERED, "The subscription has no handler key")
        if self.registry.get(subscription.handler_key) is None:
            return entry(
                PlanState.HANDLER_NOT_REGISTERED,
                f"No handler registered for key {subscription.handler_key!r}",
            )
        return PlanEntry(
            name,
            PlanState.RUNNING,
            "",
            concurrency,
            SubscriptionPlan.from_subscription(subscription),
        )

    def reconcile(self) -> None:
        """Re-plan and make the consumers match: start new ones, stop paused ones, restart the
        ones whose settings changed (lease, handler key, concurrency, ...)."""
        try:
            plans = self.plan()
        except Exception:
            logger.exception("Planning failed; keeping the current consumers")
            return
        finally:
            close_old_connections()
        with self._lock:
            if self._shutting_down:
                return
            to_stop = []
            for name, consumer in list(self._consumers.items()):
                new = plans.get(name)
                if (
                    new is None
                    or new.plan != consumer.plan
                    or new.concurrency != consumer.config.concurrency
                ):
                    to_stop.append(self._consumers.pop(name))
            self._plans = plans
        for consumer in to_stop:
            self._detach(consumer)
            consumer.stop()
        with self._lock:
            for name, entry in plans.items():
                if entry.state == PlanState.RUNNING and name not in self._consumers:
                    self._consumers[name] = self._start_consumer(entry)

    def _start_consumer(self, entry: PlanEntry) -> Consumer:
        assert entry.plan is not None and self._timers is not None
        consumer = Consumer(
            entry.plan,
            ConsumerConfig(
                concurrency=entry.concurrency,
                idle_poll_min_ms=self.config.idle_poll_min_ms,
                idle_poll_max_ms=self.config.idle_poll_max_ms,
                shutdown_drain_ms=self.config.shutdown_drain_ms,
            ),
            lease_owner=self.instance_id,
            handlers=self.registry,
            user=self.user,
            timers=self._timers,
            budget=self._budget,
        )
        consumer.start()
        if self._wakeup is not None:
            self._wakeup.subscribe(entry.plan.topic_id, consumer.kick)
        return consumer

    def _detach(self, consumer: Consumer) -> None:
        if self._wakeup is not None:
            self._wakeup.unsubscribe(consumer.plan.topic_id, consumer.kick)

    def _on_published(self, sender: Any, topic: str, **kwargs: Any) -> None:
        if self._wakeup is not None and self._wakeup.connected.is_set():
            return  # the publish's NOTIFY wakes the consumers; a kick too would claim twice
        name = topic.strip().lower()
        with self._lock:
            consumers = [c for c in self._consumers.values() if c.plan.topic_name == name]
        for consumer in consumers:
            consumer.kick()

    def _on_cancel(self, delivery_id: str) -> None:
        with self._lock:
            consumers = list(self._consumers.values())
        for consumer in consumers:
            consumer.check_lease(delivery_id)

    # -- health ----------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        with self._lock:
            consumers = dict(self._consumers)
            plans = dict(self._plans)
        return {
            "instance_id": self.instance_id,
            "started_at": self.started_at,
            "subscriptions": [
                {
                    "name": entry.name,
                    "state": entry.state,
                    "reason": entry.reason,
                    "in_flight": consumers[name].in_flight if name in consumers else 0,
                    "concurrency": entry.concurrency,
                }
                for name, entry in plans.items()
            ],
        }

    def record_health(self, stopped: bool = False) -> None:
        from workqueue.models import HostRecord

        now = timezone.now()
        try:
            HostRecord.objects.update_or_create(
                instance_id=self.instance_id,
                defaults={
                    "hostname": socket.gethostname(),
                    "pid": os.getpid(),
                    "started_at": self.started_at,
                    "last_seen_at": now,
                    "stopped_at": now if stopped else None,
                    "subscriptions": self.health()["subscriptions"],
                    "handler_keys": self.registry.keys(),
                },
            )
        except Exception:
            logger.exception("Recording host health failed")
        finally:
            close_old_connections()

    # -- one-shot mode ---------------------------------------------------------------------

    def run_once(
        self,
        *,
        max_deliveries: int | None = None,
        idle_exit_ms: int = 5000,
        max_duration_ms: int | None = None,
        stop_requested: threading.Event | None = None,
    ) -> RunOnceResult:
        """Run until the budget is received and done, the queue stays empty for
        ``idle_exit_ms``, ``max_duration_ms`` passes, or ``stop_requested`` is set; then drain.

        The budget counts deliveries received (each claim is capped to what remains); the run
        never ends while a claim is pending or a handler is running, except by drain.
        """
        if self._started:
            raise RuntimeError("run_once needs a host that has not been started")
        if max_deliveries is not None and max_deliveries < 1:
            raise ValueError("max_deliveries must be at least 1")
        self._budget = RunBudget(max_deliveries)
        stop_requested = stop_requested or threading.Event()
        began = time.monotonic()
        self.start(once=True)
        reason = "Idle"
        consumers: list[Consumer] = []
        try:
            while True:
                with self._lock:
                    consumers = list(self._consumers.values())
                if not consumers:
                    reason = "Idle"  # nothing could run; health says why
                    break
                busy = any(c.in_flight or c.receive_pending for c in consumers)
                if stop_requested.is_set():
                    reason = "Shutdown"
                    break
                if max_duration_ms is not None and time.monotonic() - began >= (
                    max_duration_ms / 1000
                ):
                    reason = "MaxDuration"
                    break
                if self._budget.spent and not busy:
                    reason = "MaxDeliveries"
                    break
                quiet = min(time.monotonic() - c.last_activity for c in consumers)
                if (
                    not busy
                    and all(c.last_receive_empty for c in consumers)
                    and quiet >= idle_exit_ms / 1000
                ):
                    reason = "Idle"
                    break
                stop_requested.wait(0.02)
        finally:
            processed = sum(c.processed for c in consumers)
            self.shutdown()
            processed = max(processed, sum(c.processed for c in consumers))
        return RunOnceResult(processed, reason)
