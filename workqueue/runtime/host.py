"""The host: plans which subscriptions this process runs, runs a consumer for each, re-plans
while running, drains on shutdown and records its health for other processes to read.

Planning, per requested subscription (first match wins): not found → Error; not a work-queue
host subscription → Unsupported; subscription, topic or transport not Active → Paused (the
reason says which); not the Database transport → Unsupported; no registered handler for its key
→ HandlerNotRegistered (its deliveries stay Pending for hosts that have one); else Running.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.db import (
    DatabaseError,
    close_old_connections,
    connections,
    router,
)
from django.db.models.functions import Now
from django.utils import timezone

from workqueue import signals
from workqueue.conf import MAX_CLAIM_ROWS, MAX_CONCURRENCY, WorkQueueSettings, get_settings
from workqueue.driver import close_all_thread_connections, database_away, get_driver
from workqueue.exceptions import WorkQueueConfigurationError, one_line
from workqueue.models.hosts import START_FAILED, SUGGESTION_PREFIX
from workqueue.operators.topology import topology_drift_warning
from workqueue.runtime.activity import LOOK_EVERY_SECONDS, ActivitySummary
from workqueue.runtime.consumer import (
    FAILURES_THAT_PERSIST,
    RESTART_MAX_SECONDS,
    Consumer,
    ConsumerConfig,
    RunBudget,
    default_prefetch,
    restart_delay_seconds,
)
from workqueue.runtime.handler_runs import HandlerRun, StuckRunLog, runs_report
from workqueue.runtime.handlers import HandlerRegistry, autodiscover, handler_registry
from workqueue.runtime.plan import SubscriptionPlan
from workqueue.runtime.process import (
    StopSignal,
    describe_drain,
    describe_left_behind,
    unmigrated_problem,
)
from workqueue.runtime.scheduler import Scheduler
from workqueue.runtime.service import PeriodicService
from workqueue.runtime.sweeper import Sweeper, pause_after
from workqueue.runtime.timers import TimerQueue
from workqueue.runtime.wakeup import Wakeup
from workqueue.scheduling import load_schedules
from workqueue.system_user import resolve_system_user
from workqueue.transport import new_instance_id, procedures_problem
from workqueue.transports import TransportReceiver

logger = logging.getLogger(__name__)

#: How long the re-plan service of a host with re-planning off (RECONCILE_INTERVAL_MS = 0),
#: which runs only to try a first plan that failed again, sleeps once one went through: a stop
#: wakes it, and nothing else will.
PLANNED_WITH_RE_PLANNING_OFF_SECONDS = 24 * 3600.0

HEALTH_INTERVAL_SECONDS = 10.0
SUPERVISE_INTERVAL_SECONDS = 0.5
WILDCARD = "*"


class PlanState:
    RUNNING = "Running"
    PAUSED = "Paused"
    HANDLER_NOT_REGISTERED = "HandlerNotRegistered"
    UNSUPPORTED = "Unsupported"
    ERROR = "Error"


#: The states in which a subscription a host was asked to run does not run.
CANNOT_RUN = frozenset({PlanState.ERROR, PlanState.HANDLER_NOT_REGISTERED, PlanState.UNSUPPORTED})


@dataclass(frozen=True, slots=True)
class PlanEntry:
    name: str
    state: str
    reason: str = ""
    concurrency: int = 1
    plan: SubscriptionPlan | None = None
    #: The subscription's id, when it exists: handlers of its earlier consumers are matched by
    #: it, not by its name, which an operator may change (audit helper-134).
    subscription_id: str | None = None

    def runs(self, consumer: Consumer) -> bool:
        """Whether ``consumer`` (perhaps one a re-plan stopped) ran this subscription."""
        if self.subscription_id is not None:
            return consumer.plan.subscription_id == self.subscription_id
        return consumer.plan.name == self.name

    def counts(self, consumer: Consumer, planned_ids: Collection[str]) -> bool:
        """Whether health counts ``consumer``'s handlers under this entry, ``planned_ids``
        being the ids of every entry's subscription: each consumer under one entry only. One
        whose subscription an entry has by id is that entry's: a renamed subscription listed
        under its old name too (not found, so no id) was counted under both names."""
        if self.subscription_id is None and consumer.plan.subscription_id in planned_ids:
            return False
        return self.runs(consumer)


_NOT_PLANNED = PlanEntry("", PlanState.ERROR)


@dataclass(frozen=True, slots=True)
class StartFailure:
    reason: str
    attempts: int
    retry_at: float  # time.monotonic()


@dataclass(frozen=True, slots=True)
class RunOnceResult:
    processed: int
    reason: str  # MaxDeliveries | Idle | MaxDuration | Shutdown
    #: The subscriptions that could not run, with their health as the run ended (before the
    #: drain, which reports every subscription as shut down): unknown, HandlerNotRegistered,
    #: Unsupported, a consumer that could not start, claims that kept failing. A claim that
    #: failed once and not again is no reason.
    could_not_run: list[dict[str, Any]]
    #: Why the subscriptions could not be planned at all (a settings mistake), if so.
    planning_failure: str | None = None


@dataclass(slots=True)
class HostConfig:
    """What a host runs and how.

    ``subscriptions`` has the settings' shape (``WORKQUEUE['SUBSCRIPTIONS']``): which
    subscriptions to run (``*``: every Worker subscription) and each one's concurrency.
    ``only`` (the commands' ``-s``) narrows the set to those names and still takes each one's
    concurrency from ``subscriptions`` (its own entry, else the ``*`` entry, else 1);
    ``concurrency`` (``--concurrency``) overrides it for every subscription the host runs.
    """

    subscriptions: list[dict[str, Any]]
    only: list[str] | None = None
    concurrency: int | None = None
    idle_poll_min_ms: int = 250
    idle_poll_max_ms: int = 5000
    shutdown_drain_ms: int = 8000
    sweeper_interval_ms: int = 60000
    reconcile_interval_ms: int = 30000
    #: ``WORKQUEUE["SCHEDULES"]``, published by this host's scheduler every
    #: ``scheduler_interval_ms`` (0: no scheduler).
    schedules: list[dict[str, Any]] = field(default_factory=list)
    scheduler_interval_ms: int = 10000
    #: How long a handler of a subscription without ``max_processing_seconds`` runs before
    #: health names it as stuck (``WORKQUEUE["HANDLER_RUN_WARNING_SECONDS"]``).
    handler_run_warning_seconds: int = 1800
    instance_id: str = field(default_factory=new_instance_id)

    @classmethod
    def from_settings(
        cls, conf: WorkQueueSettings, names: list[str] | None = None, **overrides: Any
    ) -> HostConfig:
        config = cls(
            subscriptions=[dict(entry) for entry in conf.SUBSCRIPTIONS],
            only=list(names) if names else None,
            idle_poll_min_ms=conf.IDLE_POLL_MIN_MS,
            idle_poll_max_ms=conf.IDLE_POLL_MAX_MS,
            shutdown_drain_ms=conf.SHUTDOWN_DRAIN_MS,
            sweeper_interval_ms=conf.SWEEPER_INTERVAL_MS if conf.SWEEPER_ENABLED else 0,
            reconcile_interval_ms=conf.RECONCILE_INTERVAL_MS,
            schedules=[dict(entry) for entry in conf.SCHEDULES],
            scheduler_interval_ms=conf.SCHEDULER_INTERVAL_MS,
            handler_run_warning_seconds=conf.HANDLER_RUN_WARNING_SECONDS,
        )
        for key, value in overrides.items():
            setattr(config, key, value)  # slots: an unknown name raises AttributeError
        return config

    def selection(self) -> tuple[set[str], bool]:
        """The names this host runs, and whether it also runs every other Worker
        subscription (``*``)."""
        if self.only is None:
            names = {_normalise(entry.get("name", "")) for entry in self.subscriptions}
        else:
            names = {_normalise(name) for name in self.only}
        run_all = WILDCARD in names
        return names - {WILDCARD, ""}, run_all

    def concurrency_for(self, name: str) -> int:
        """``--concurrency``, else the subscription's own settings entry, else the ``*`` entry,
        else 1; at most MAX_CONCURRENCY (more is a configuration mistake, said so)."""
        if self.concurrency is not None:
            value, source = self.concurrency, "--concurrency"
        else:
            value = max(int(self._entry_for(name).get("concurrency", 1)), 1)
            source = "WORKQUEUE['SUBSCRIPTIONS']"
        if value > MAX_CONCURRENCY:
            # Each handler slot is two threads: far more starts no host, it exhausts the
            # machine's threads half way through starting them.
            raise WorkQueueConfigurationError(
                f"{source} gives subscription {name!r} a concurrency of {value:,}; a host runs "
                f"at most {MAX_CONCURRENCY:,} handlers of one subscription at once. Lower it, "
                "and run more hosts for more."
            )
        return value

    def prefetch_for(self, name: str, max_payload_bytes: int) -> int:
        """How many deliveries past its concurrency the subscription may claim ahead while its
        handlers are quick: its settings entry's (else the ``*`` entry's) ``prefetch``, else as
        many as its topic's largest messages (``max_payload_bytes``) allow by default (see
        ``consumer.default_prefetch``; the claim loop also holds it to what the handlers get
        through in a few milliseconds, ``consumer.PREFETCH_WINDOW_SECONDS``)."""
        value = self._entry_for(name).get("prefetch")
        if value is None:
            return default_prefetch(max_payload_bytes)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise WorkQueueConfigurationError(
                f"WORKQUEUE['SUBSCRIPTIONS'] gives {name!r} prefetch {value!r}: it must be a "
                "whole number, 0 or more (0 claims only for free slots)."
            )
        if value > MAX_CLAIM_ROWS:
            # More than one claim takes (`check` says so too: conf.subscription_entry_problems).
            raise WorkQueueConfigurationError(
                f"WORKQUEUE['SUBSCRIPTIONS'] gives {name!r} prefetch {value:,}: a host claims "
                f"at most {MAX_CLAIM_ROWS:,} deliveries at once; lower it (the default is at "
                "most 256)."
            )
        return value

    def _entry_for(self, name: str) -> dict[str, Any]:
        configured = {_normalise(e.get("name", "")): e for e in self.subscriptions}
        return configured.get(_normalise(name)) or configured.get(WILDCARD) or {}


def _normalise(name: Any) -> str:
    return str(name).strip().lower()


def start_and_stop_logged() -> bool:
    """Whether the project's logging shows the host's start and stop lines (INFO), which the
    host command otherwise prints on its console."""
    return logger.isEnabledFor(logging.INFO)


def describe_subscription(entry: dict[str, Any]) -> str:
    """One start-up line: ``name: State, concurrency N`` and the reason, if any."""
    reason = f" ({entry['reason']})" if entry["reason"] else ""
    return f"{entry['name']}: {entry['state']}, concurrency {entry['concurrency']}{reason}"


class Host:
    def __init__(
        self,
        config: HostConfig,
        registry: HandlerRegistry = handler_registry,
        *,
        console: Callable[[str], None] | None = None,
    ) -> None:
        """``console`` hears the periodic summary of what the deliveries came to while the
        project's logging would not show it (see runtime.activity): the command's stdout."""
        self.config = config
        self.instance_id = config.instance_id
        self.registry = registry
        self.started_at = timezone.now()
        self._lock = threading.RLock()
        self._consumers: dict[str, Consumer] = {}
        # Consumers a re-plan is stopping (their settings changed, or they are no longer
        # wanted): a shutdown meanwhile waits for their drain too, and counts what it left.
        self._retiring: list[Consumer] = []
        self._retired = threading.Condition(self._lock)
        # Stopped by a re-plan while handlers they gave up on still run (Consumer.lingering):
        # counted in health and at shutdown until those return.
        self._lingering: list[Consumer] = []
        # The receivers of consumers a re-plan stopped, by subscription id, for the consumer
        # that next runs the subscription to carry on from (a claim whose answer was lost).
        self._retired_receivers: dict[str, TransportReceiver] = {}
        # The consumers a shutdown is draining: their handlers still run, and hear cancels.
        self._draining: list[Consumer] = []
        self._plans: dict[str, PlanEntry] = {}
        self._start_failures: dict[str, StartFailure] = {}
        self._recorded_states: list[tuple[Any, ...]] = []
        self._stuck_log = StuckRunLog()
        self._health_failing = False  # whether this outage's failed report was logged
        self._planning_outage_reported = False  # likewise for planning
        # Plans in a row that failed with the database away (a failover, a session cut): the
        # next is tried on a backoff, not a whole re-plan interval later (_next_plan_in).
        self._plans_failed_away = 0
        self._started = False
        self._shut_down = threading.Event()
        self._shutting_down = False
        self._services: list[PeriodicService] = []
        self._health_service: PeriodicService | None = None
        self._console = console
        self._activity: ActivitySummary | None = None
        self._timers: TimerQueue | None = None
        self._wakeup: Wakeup | None = None
        self._budget: RunBudget | None = None
        self.user: Any = None
        #: Handlers still running when shutdown gave up waiting (left to lease expiry).
        self.abandoned_handlers = 0
        #: Handlers that had returned by then, their outcome not yet recorded (the database did
        #: not answer): recorded if it answers while the lease lasts and the process lives.
        self.unsettled_outcomes = 0
        #: Deliveries claimed ahead, never started, that could not be handed back (the
        #: database did not answer within the drain): left to lease expiry.
        self.not_handed_back = 0
        self.claims_left_out = 0
        #: Why the last planning raised (None once one succeeds): nothing was started then.
        self.planning_failure: str | None = None
        #: Set once a plan has gone through and its consumers were started (never cleared).
        self.planned = threading.Event()
        # Whether the start's line was logged: a first plan that goes through later is said.
        self._start_said = False

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
            if connections[conf.DATABASE_ALIAS].in_atomic_block:
                # A host claims on its own threads and connections, which cannot see rows this
                # transaction has not committed, and it closes this thread's connection when
                # it stops, ending the transaction: in a TestCase both break the test.
                raise WorkQueueConfigurationError(
                    "A host cannot run inside a transaction (such as a TestCase's): its "
                    "threads would not see the transaction's rows. In tests, run deliveries "
                    "with workqueue.testing.run_until_idle() instead."
                )
            autodiscover(conf.HANDLER_MODULES)
            self.user = _read_at_start(lambda: resolve_system_user(conf))
            if not _read_at_start(lambda: _has_the_queue_tables(conf.DATABASE_ALIAS)):
                # Started, it would run nothing and log a failed planning every re-plan.
                raise WorkQueueConfigurationError(
                    f"The work queue's tables are not in database {conf.DATABASE_ALIAS!r}: its "
                    "migrations are not applied there. Run `manage.py migrate`, then start the "
                    "host again."
                )
            # Checked before anything starts: a bad schedule stops the host with its name.
            scheduler = Scheduler(load_schedules(self.config.schedules))
            self._timers = TimerQueue()
            self._wakeup = Wakeup(get_driver(conf.DATABASE_ALIAS))
            self._wakeup.on_cancel(self._on_cancel)
            self._wakeup.start()
            signals.published.connect(self._on_published, dispatch_uid=self.instance_id)
            self.reconcile()
            self._health_service = PeriodicService(
                "wq-health", HEALTH_INTERVAL_SECONDS, self.record_health
            )
            self._services.append(self._health_service)
            self._services.append(
                PeriodicService("wq-supervisor", SUPERVISE_INTERVAL_SECONDS, self.supervise)
            )
            if not once:
                # With re-planning off (0), a first plan that failed is still tried again,
                # on the backoff, until one goes through (and then nothing more is planned).
                replan_every = self.config.reconcile_interval_ms / 1000 or (
                    RESTART_MAX_SECONDS if self.planning_failure is not None else 0
                )
                self._services.append(
                    PeriodicService(
                        "wq-reconcile",
                        replan_every,
                        self._replan,
                        pause=lambda _result, _took, interval: self._next_plan_in(interval),
                        first_wait_seconds=self._next_plan_in(replan_every),
                    )
                )
                self._activity = ActivitySummary(echo=self._console)
                self._services.append(
                    PeriodicService("wq-activity", LOOK_EVERY_SECONDS, self._activity.run_once)
                )
                self._services.append(
                    PeriodicService(
                        "wq-sweeper",
                        self.config.sweeper_interval_ms / 1000,
                        Sweeper().run_once,
                        pause=pause_after,
                    )
                )
                if scheduler.schedules:
                    # Every host runs it; the slots' deduplication keys make one publish win.
                    self._services.append(
                        PeriodicService(
                            "wq-scheduler",
                            self.config.scheduler_interval_ms / 1000,
                            scheduler.run_once,
                        )
                    )
            for service in self._services:
                service.start()
        self.record_health()
        entries = self.health()["subscriptions"]
        logger.info(
            "Host %s started: %s",
            self.instance_id,
            "; ".join(describe_subscription(e) for e in entries) or "no subscriptions",
            extra={"action": "host_started"},
        )
        self._start_said = True
        if not entries and self.planning_failure is None:
            if not self.config.selection()[1]:
                # Nothing asked for: told as such, not as a database without subscriptions
                # (audit helper-136, a database with three).
                logger.warning(
                    "Host %s runs no subscription: WORKQUEUE['SUBSCRIPTIONS'] names none (it "
                    "is empty), so it runs only its sweeper and scheduler. Name them there, "
                    "or '*' for every one, or pass -s to the command.",
                    self.instance_id,
                    extra={"action": "host_runs_nothing"},
                )
            else:
                # Said at the default level: a project whose topology is declared in settings
                # but never synced starts a host that runs nothing, and said so only at INFO.
                # (A plan that failed is logged as such, and made again.)
                logger.warning(
                    "Host %s runs no subscription: none exists in the database yet. Create "
                    "them (`manage.py workqueue sync-topology` for those declared in "
                    "WORKQUEUE['TOPOLOGY'], or the admin); the host takes them up within "
                    "RECONCILE_INTERVAL_MS once they exist.",
                    self.instance_id,
                    extra={"action": "host_runs_nothing"},
                )
        self._warn_of_other_procedures()
        drift = topology_drift_warning()
        if drift is not None:
            # A deploy that skipped sync-topology runs the topology it had before, silently.
            logger.warning(drift, extra={"action": "host_topology_drift"})
        closing = aliases_closing_after_each_use(connections.settings)
        if closing:
            logger.warning(
                "Database %s closes its connections after every use (CONN_MAX_AGE = 0), so "
                "each delivery whose handler uses the ORM opens a new connection (several ms "
                "each). For host processes set CONN_MAX_AGE (e.g. 60) and CONN_HEALTH_CHECKS = "
                "True in DATABASES.",
                ", ".join(closing),
                extra={"action": "host_connection_per_delivery"},
            )

    def _warn_of_other_procedures(self) -> None:
        """Say at WARNING when the database holds another release's procedures (this process
        started before `migrate`, or a failed migrate and a roll-back left them): its calls
        may fail one by one, or act as that release's, with nothing else saying why."""
        try:
            problem = procedures_problem()
        except Exception:
            # A warning must never stop a host: a database that is away, the consumers report.
            return
        if problem is not None:
            logger.warning(problem, extra={"action": "host_other_procedures"})

    @property
    def left_work_behind(self) -> bool:
        """Whether the last stop left deliveries to lease expiry (``describe_left_behind``)."""
        return bool(
            self.abandoned_handlers
            or self.unsettled_outcomes
            or self.not_handed_back
            or self.claims_left_out
        )

    def shutdown(self, *, cause: str | None = None) -> None:
        """Stop claiming, drain running handlers, abort the rest, drain again. Idempotent:
        every caller returns once the drain is over. ``cause`` (the signal a command received)
        is named in the stopping and stopped log lines."""
        with self._lock:
            first = not self._shutting_down
            self._shutting_down = True
            # Taken now: a re-plan that is stopping consumers may finish while the services
            # stop below (the re-plan runs on one of them), and what it left must be counted.
            # No consumer starts retiring from here on (reconcile sees the shutdown).
            retired = list(self._retiring)
        if not first:
            self._shut_down.wait()
            return
        named = f" ({cause})" if cause else ""
        logger.info(
            "Host %s stopping%s: no new claims; %s",
            self.instance_id,
            named,
            describe_drain(self.config.shutdown_drain_ms),
            extra={"action": "host_draining"},
        )
        try:
            # Every service is told first and joined only once the consumers are stopping: a
            # pass in progress (a sweep, a re-plan draining a consumer) must not hold back
            # "stop claiming, tell the handlers" by up to its own stop timeout. Health goes on
            # reporting until the drain is over: the host still holds leases meanwhile.
            for service in self._services:
                if service is not self._health_service:
                    service.request_stop()
            signals.published.disconnect(dispatch_uid=self.instance_id)
            with self._lock:
                consumers = list(self._consumers.values())
                self._draining = consumers
                self._consumers.clear()
                self._start_failures.clear()
                self._plans = {
                    name: PlanEntry(
                        name,
                        PlanState.PAUSED,
                        "Host is shut down",
                        entry.concurrency,
                        subscription_id=entry.subscription_id,
                    )
                    if entry.state == PlanState.RUNNING
                    else entry
                    for name, entry in self._plans.items()
                }
            # Both of a drain's phases, counted from now: what every handler has to return.
            drain_ends = time.monotonic() + 2 * self.config.shutdown_drain_ms / 1000
            stoppers = _stop_at_once(consumers, process_lives_on=False)
            for service in self._services:
                if service is not self._health_service:
                    service.stop()
            for thread in stoppers:
                thread.join()
            if self._activity is not None:
                # What the drain finished, and what the last interval held back.
                self._activity.run_once(final=True)
            with self._lock:
                # The process may end once this returns: a re-plan's drain must be over too.
                self._retired.wait_for(lambda: not self._retiring)
                # Stopped by a re-plan, before or during this shutdown: what they gave up on
                # and is still running now (the others have returned since).
                lingering = {*self._lingering, *retired}
            for consumer in lingering:
                # Handlers a re-plan gave up on (told to stop, then aborted) still settle what
                # they return: they get the drain every running handler gets (review helper-171).
                consumer.wait_idle(drain_ends - time.monotonic())
            if self._health_service is not None:
                self._health_service.stop()
            left = [c.left_running() for c in lingering]
            self.abandoned_handlers = sum(c.abandoned for c in consumers) + sum(
                running for running, _returned in left
            )
            self.unsettled_outcomes = sum(c.unsettled for c in consumers) + sum(
                returned for _running, returned in left
            )
            self.not_handed_back = sum(c.not_handed_back for c in consumers)
            self.claims_left_out = sum(c.claims_left_out for c in consumers)
            if self._wakeup is not None:
                self._wakeup.stop()
            if self._timers is not None:
                self._timers.stop()
            self.record_health(stopped=True)
        finally:
            self._shut_down.set()
            close_old_connections()
        logger.log(
            # Work left to lease expiry is worth a WARNING where INFO is not shown (review
            # helper-169): the command no longer prints this line where the log shows it.
            logging.WARNING if self.left_work_behind else logging.INFO,
            "Host %s stopped%s: %s",
            self.instance_id,
            named,
            describe_left_behind(self),
            extra={"action": "host_stopped"},
        )

    # -- planning --------------------------------------------------------------------------

    def plan(self) -> dict[str, PlanEntry]:
        """Decide what each requested subscription should do now (reads topology)."""
        from workqueue.models import Subscription

        names, run_all = self.config.selection()
        subscriptions = Subscription.objects.select_related("topic__transport")
        found = {s.name: s for s in subscriptions.filter(name__in=list(names))}
        if run_all:
            for subscription in subscriptions.filter(host_type="Worker"):
                found.setdefault(subscription.name, subscription)
                names.add(subscription.name)
        # Names asked for that no subscription has: a typo, or one still to be created. All
        # the names are read only then, to say which existing one was likely meant.
        existing = (
            list(Subscription.objects.values_list("name", flat=True))
            if names - found.keys()
            else []
        )
        return {name: self._plan_one(name, found.get(name), existing) for name in sorted(names)}

    def _plan_one(self, name: str, subscription: Any, existing: list[str]) -> PlanEntry:
        """``name``'s plan; ``existing``: every subscription's name when one asked for is
        missing (to say which was likely meant)."""
        try:
            concurrency = self.config.concurrency_for(name)
        except WorkQueueConfigurationError as exc:
            # This subscription's mistake: reported as its Error (a one-shot run exits 2 for
            # it), while the host runs the others.
            return PlanEntry(name, PlanState.ERROR, str(exc), MAX_CONCURRENCY)

        def entry(state: str, reason: str = "") -> PlanEntry:
            known = None if subscription is None else str(subscription.id)
            return PlanEntry(name, state, reason, concurrency, subscription_id=known)

        if subscription is None:
            near = difflib.get_close_matches(name, existing, n=3, cutoff=0.8)
            return entry(
                PlanState.ERROR,
                "Subscription not found"
                + (f"{SUGGESTION_PREFIX}{' or '.join(map(repr, near))}?" if near else ""),
            )
        if subscription.host_type != "Worker":
            return entry(PlanState.UNSUPPORTED, "Consumed by an external host, not this one")
        topic, transport = subscription.topic, subscription.topic.transport
        if subscription.status != "Active":
            return entry(PlanState.PAUSED, f"Subscription is {subscription.status}")
        if topic.status != "Active":
            return entry(PlanState.PAUSED, f"Topic {topic.name} is {topic.status}")
        if transport.status != "Active":
            return entry(PlanState.PAUSED, f"Transport {transport.name} is {transport.status}")
        try:
            transport_class = transport.transport_class
        except WorkQueueConfigurationError as exc:
            return entry(PlanState.UNSUPPORTED, str(exc))
        problem = transport_class.subscription_problem(subscription, transport.name)
        if problem is not None:
            return entry(PlanState.UNSUPPORTED, problem)
        if not subscription.handler_key.strip():
            return entry(PlanState.HANDLER_NOT_REGISTERED, "The subscription has no handler key")
        if self.registry.get(subscription.handler_key) is None:
            near = self.registry.near(subscription.handler_key)
            return entry(
                PlanState.HANDLER_NOT_REGISTERED,
                f"No handler registered for key {subscription.handler_key!r}"
                + (
                    f"{SUGGESTION_PREFIX}{' or '.join(map(repr, near))}?"
                    if near
                    else "; handlers are loaded from each installed app's work_handlers.py "
                    "and the modules named in WORKQUEUE['HANDLER_MODULES']: is the one that "
                    "registers it among them?"
                ),
            )
        return PlanEntry(
            name,
            PlanState.RUNNING,
            "",
            concurrency,
            SubscriptionPlan.from_subscription(subscription),
            str(subscription.id),
        )

    def _replan(self) -> None:
        """The re-plan service's pass: a re-plan, or, with re-planning off, a first plan that
        has not gone through yet."""
        if self.config.reconcile_interval_ms > 0 or self.planning_failure is not None:
            self.reconcile()

    def _next_plan_in(self, interval: float) -> float:
        """Seconds to the next re-plan: the interval, or, while plans fail with the database
        away, the consumers' backoff after a failed claim (1 s, 2 s, 4 s ... at most 30 s) if
        sooner. A host started during a failover otherwise ran nothing for a whole interval (30 s
        by default) after the database was back."""
        if self._plans_failed_away > 0:
            return min(restart_delay_seconds(self._plans_failed_away), interval)
        if self.config.reconcile_interval_ms == 0 and self.planning_failure is None:
            return PLANNED_WITH_RE_PLANNING_OFF_SECONDS  # nothing more to plan
        return interval

    def reconcile(self) -> None:
        """Re-plan and make the consumers match: start new ones, stop paused ones, restart the
        ones whose settings changed (lease, handler key, concurrency, ...)."""
        try:
            plans = self.plan()
        except Exception as exc:
            # A database that is not migrated (new code, a column it reads not there yet) is
            # told as that, naming `migrate`.
            unmigrated = unmigrated_problem(exc) if isinstance(exc, DatabaseError) else None
            away = unmigrated is None and database_away(exc)
            self._plans_failed_away = self._plans_failed_away + 1 if away else 0
            if unmigrated is not None or away:
                # The database away (the consumers say so too) or behind: one line, once;
                # anything else is a fault worth its traceback every time.
                if not self._planning_outage_reported:
                    self._planning_outage_reported = True
                    logger.warning(
                        "Planning failed; keeping the current consumers: %s",
                        unmigrated or one_line(exc),
                    )
            else:
                logger.exception("Planning failed; keeping the current consumers")
            self.planning_failure = unmigrated or f"{type(exc).__name__}: {one_line(exc)}"
            return
        finally:
            close_old_connections()
        if self._planning_outage_reported:
            self._planning_outage_reported = False
            logger.info("Planning again: the subscriptions are read as usual")
        self.planning_failure = None
        self._plans_failed_away = 0
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
            self._retiring.extend(to_stop)
            previous, self._plans = self._plans, plans
        for name, entry in plans.items():
            before = previous.get(name)
            if entry.state in CANNOT_RUN and (before is None or before.reason != entry.reason):
                # Once, at the default level: said at INFO only (the host's start line), a
                # subscription whose handler was never loaded piled up unseen where the app's
                # loggers are at WARNING (audit helper-136).
                logger.warning(
                    "%s: %s, not run (%s)",
                    name,
                    entry.state,
                    entry.reason,
                    extra={"action": "subscription_not_run"},
                )
        try:
            for consumer in to_stop:
                self._detach(consumer)
            # All at once: one after the other, a topic paused with ten subscriptions drained
            # for ten times the drain time, and held a shutdown back as long.
            for thread in _stop_at_once(to_stop, process_lives_on=True):
                thread.join()
        finally:
            # Once all are stopped, or one failed to: a shutdown must not wait for ever.
            with self._lock:
                for consumer in to_stop:
                    self._retiring.remove(consumer)
                    self._retired_receivers[consumer.plan.subscription_id] = consumer.receiver
                planned = {entry.subscription_id for entry in plans.values()}
                for gone in set(self._retired_receivers) - planned:  # deleted, or not ours now
                    del self._retired_receivers[gone]
                self._lingering = [c for c in [*self._lingering, *to_stop] if c.lingering]
                self._retired.notify_all()
        with self._lock:
            if self._shutting_down:
                return
            for name in list(self._start_failures):
                if plans.get(name, _NOT_PLANNED).state != PlanState.RUNNING:
                    del self._start_failures[name]  # no longer wanted: stop retrying
            self._try_start(
                [
                    entry
                    for name, entry in plans.items()
                    if entry.state == PlanState.RUNNING and name not in self._consumers
                ]
            )
            first_plan = not self.planned.is_set()
            self.planned.set()
        if first_plan and self._start_said:
            # The start said what it ran before its plan failed (nothing): what the first
            # plan that went through runs is said once too (review helper-169).
            logger.info(
                "Host %s planned: %s",
                self.instance_id,
                "; ".join(describe_subscription(e) for e in self.health()["subscriptions"])
                or "no subscriptions",
                extra={"action": "host_planned"},
            )

    def _try_start(self, entries: list[PlanEntry]) -> None:
        """Start the entries' consumers; for each that fails, log why, report Error in health
        and let the supervisor try again after a capped backoff. Called with the lock held.

        Every consumer is built (its worker threads started) before any claim loop runs: a
        thread starts in a hand-over of the GIL both ways, and once the first consumers drain,
        each hand-over waits its turn among their threads. Built as they started, the last of
        ten busy subscriptions began claiming 0.19-1.8 s after the host started (median 0.39 s,
        eight starts); built first, 0.17-0.50 s (median 0.25 s)."""
        built = []
        for entry in entries:
            try:
                built.append((entry, self._build_consumer(entry)))
            except Exception as exc:
                self._start_failed(entry, exc)
        for entry, consumer in built:
            try:
                self._run_consumer(entry, consumer)
            except Exception as exc:
                self._start_failed(entry, exc)
            else:
                self._consumers[entry.name] = consumer
                self._retired_receivers.pop(consumer.plan.subscription_id, None)
                if self._start_failures.pop(entry.name, None) is not None:
                    logger.info("%s: the consumer started after earlier failures", entry.name)

    def _start_failed(self, entry: PlanEntry, exc: Exception) -> None:
        previous = self._start_failures.get(entry.name)
        attempts = previous.attempts + 1 if previous else 1
        delay = restart_delay_seconds(attempts)
        self._start_failures[entry.name] = StartFailure(
            f"{START_FAILED}: {exc!r}", attempts, time.monotonic() + delay
        )
        # Called from the except block that caught ``exc``: the log carries its traceback.
        logger.exception(
            "%s: the consumer could not start; trying again in %.1f s", entry.name, delay
        )

    def supervise(self) -> None:
        """Retry consumers that could not start once their backoff is over, and record health
        at once when a subscription's state changed (Error or back to Running)."""
        with self._lock:
            if self._shutting_down:
                return
            now = time.monotonic()
            due = [
                entry
                for name, failure in self._start_failures.items()
                if (entry := self._plans.get(name)) is not None
                and failure.retry_at <= now
                and name not in self._consumers
            ]
            self._try_start(due)
        now = time.monotonic()
        subscriptions, runs = self._health(now)
        self._stuck_log.report([run for run in runs if run.stuck(now)], now)
        if [_recorded_state(s) for s in subscriptions] != self._recorded_states:
            self.record_health()

    def _build_consumer(self, entry: PlanEntry) -> Consumer:
        assert entry.plan is not None and self._timers is not None
        consumer = Consumer(
            entry.plan,
            ConsumerConfig(
                concurrency=entry.concurrency,
                prefetch=self.config.prefetch_for(entry.name, entry.plan.max_payload_bytes),
                idle_poll_min_ms=self.config.idle_poll_min_ms,
                idle_poll_max_ms=self.config.idle_poll_max_ms,
                shutdown_drain_ms=self.config.shutdown_drain_ms,
                publishes_wake=self._wakeup is not None and self._wakeup.supported,
            ),
            lease_owner=self.instance_id,
            handlers=self.registry,
            user=self.user,
            timers=self._timers,
            budget=self._budget,
            # Handlers a re-plan gave up on run on; they count against the concurrency. By id:
            # a renamed subscription is the same one (by name, its new consumer counted none
            # of them, audit helper-134).
            predecessors=[c for c in self._lingering if entry.runs(c)],
        )
        # Kept until a consumer started with it: one whose start fails is built again.
        retired = self._retired_receivers.get(entry.plan.subscription_id)
        carry_over_from = getattr(consumer.receiver, "carry_over_from", None)
        if retired is not None and carry_over_from is not None:  # a third party's may lack it
            try:
                carry_over_from(retired)
            except BaseException:
                # Built, so its threads run: stopped, not left to wait forever. The host lives
                # on and builds it again, carrying over from the same receiver.
                consumer.stop(process_lives_on=True)
                raise
        return consumer

    def _run_consumer(self, entry: PlanEntry, consumer: Consumer) -> None:
        assert entry.plan is not None
        try:
            consumer.start()
        except BaseException:
            consumer.stop()  # its completion thread and pools are already running
            raise
        if self._wakeup is not None:
            self._wakeup.subscribe(entry.plan.topic_id, consumer.kick, entry.plan.subscription_id)

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

    def _on_cancel(self, delivery_id: str | None) -> None:
        # Handlers a shutdown or a re-plan is draining run on too (told the host is stopping,
        # a request they may take their time over): a cancel reaches them at once as well,
        # not at their next heartbeat (audit helper-128).
        with self._lock:
            holders = [
                *self._consumers.values(),
                *self._draining,
                *self._retiring,
                *self._lingering,
            ]
            consumers = [c for c in dict.fromkeys(holders) if c.hears_cancels]
        for consumer in consumers:
            consumer.check_lease(delivery_id)

    # -- health ----------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "started_at": self.started_at,
            "subscriptions": self._health(time.monotonic())[0],
        }

    def _health(self, now: float) -> tuple[list[dict[str, Any]], list[HandlerRun]]:
        """Each subscription's health entry, and every handler running here (``now``:
        ``time.monotonic()``, which their ages are counted to)."""
        with self._lock:
            consumers = dict(self._consumers)
            plans = dict(self._plans)
            start_failures = dict(self._start_failures)
            # Handlers of consumers a re-plan is stopping, or gave up on, still run here.
            stopped = [*self._retiring, *self._lingering]
        subscriptions = []
        runs: list[HandlerRun] = []
        planned_ids = {e.subscription_id for e in plans.values() if e.subscription_id is not None}
        for name, entry in plans.items():
            state, reason = entry.state, entry.reason
            consumer = consumers.get(name)
            failure = start_failures[name].reason if name in start_failures else None
            failure = failure or (consumer.failure if consumer is not None else None)
            if state == PlanState.RUNNING and failure:
                state, reason = PlanState.ERROR, failure
            holders = [c for c in stopped if entry.counts(c, planned_ids)]
            if consumer is not None:
                holders.append(consumer)
            own = [
                run
                for holder in holders
                for run in holder.handler_runs(self.config.handler_run_warning_seconds)
            ]
            runs.extend(own)
            subscriptions.append(
                {
                    "name": entry.name,
                    "state": state,
                    "reason": reason,
                    "in_flight": sum(holder.in_flight for holder in holders),
                    "concurrency": entry.concurrency,
                    **runs_report(own, now),
                }
            )
        return subscriptions, runs

    def record_health(self, stopped: bool = False) -> None:
        from workqueue.models import HostRecord

        # The database's clock, which readers judge liveness by: a host whose clock is behind
        # looked gone at once, one ahead stayed live long after it died.
        now = Now()
        subscriptions = self.health()["subscriptions"]
        self._recorded_states = [_recorded_state(s) for s in subscriptions]
        alias = router.db_for_write(HostRecord)
        try:
            # Twice at most: a database restarted since this thread's last report left its
            # connection dead, and the first use is what finds that out. Without the second
            # try on a fresh connection the report was lost, the final one of a shutdown too
            # (the host then read as running, with work in flight, until it went stale).
            for last_try in (False, True):
                try:
                    HostRecord.objects.using(alias).update_or_create(
                        instance_id=self.instance_id,
                        defaults={
                            "hostname": socket.gethostname(),
                            "pid": os.getpid(),
                            "started_at": self.started_at,
                            "last_seen_at": now,
                            "stopped_at": now if stopped else None,
                            "subscriptions": subscriptions,
                            "handler_keys": self.registry.keys(),
                        },
                    )
                    break
                except DatabaseError as exc:
                    if not database_away(exc):
                        raise
                    # A session refused as read-only stays so: the next try opens another.
                    connections[alias].close()
                    if last_try:
                        self._health_not_recorded(exc)
                        return
        except Exception:
            logger.exception("Recording host health failed")
            return
        finally:
            close_old_connections()
        if self._health_failing:
            self._health_failing = False
            logger.info("Host health recorded again")

    def _health_not_recorded(self, exc: Exception) -> None:
        """Say once per outage that health is not being recorded: the consumers already report
        the database away, and a traceback every 10 s of it paged people for one cause."""
        if self._health_failing:
            logger.debug("Host health still not recorded: %s", exc)
            return
        self._health_failing = True
        logger.warning(
            "Recording host health failed (%s); trying again every %d s",
            one_line(exc),
            HEALTH_INTERVAL_SECONDS,
        )

    # -- one-shot mode ---------------------------------------------------------------------

    def run_once(
        self,
        *,
        max_deliveries: int | None = None,
        idle_exit_ms: int = 5000,
        max_duration_ms: int | None = None,
        stop_requested: threading.Event | StopSignal | None = None,
        on_started: Callable[[Host], None] | None = None,
        on_stopping: Callable[[str], None] | None = None,
    ) -> RunOnceResult:
        """Run until the budget is received and done, the queue stays empty for
        ``idle_exit_ms``, ``max_duration_ms`` passes, or ``stop_requested`` is set; then drain
        (``on_stopping`` is told the reason first). A stop request outranks every other reason.

        The budget counts deliveries received (each claim is capped to what remains); the run
        never ends while a claim is pending or a handler is running, except by drain.

        Set from a signal handler, ``stop_requested`` must be a ``StopSignal``: a
        ``threading.Event``'s ``set()`` there can deadlock with this loop's wait on it.
        """
        if self._started:
            raise RuntimeError("run_once needs a host that has not been started")
        if max_deliveries is not None and max_deliveries < 1:
            raise ValueError("max_deliveries must be at least 1")
        self._budget = RunBudget(max_deliveries)
        stop_requested = stop_requested or threading.Event()
        began = time.monotonic()
        ends_at = math.inf if max_duration_ms is None else began + max_duration_ms / 1000
        self.start(once=True)
        # A plan that failed with the database away is tried again as a claim is (a blip, as a
        # session cut, is no reason to end the job), until it fails FAILURES_THAT_PERSIST
        # times in a row, or the run's time is up; then the run ends naming why.
        while 0 < self._plans_failed_away < FAILURES_THAT_PERSIST:
            wait = min(restart_delay_seconds(self._plans_failed_away), ends_at - time.monotonic())
            if stop_requested.wait(max(wait, 0)) or time.monotonic() >= ends_at:
                break
            self.reconcile()
        if on_started is not None:
            on_started(self)
        reason = "Idle"
        consumers: list[Consumer] = []
        try:
            while True:
                with self._lock:
                    consumers = list(self._consumers.values())
                # Checked first: a signal must be reported as the reason even when there was
                # nothing to run at that moment.
                if stop_requested.is_set():
                    reason = "Shutdown"
                    break
                if time.monotonic() >= ends_at:
                    reason = "MaxDuration"
                    break
                if not consumers:
                    reason = "Idle"  # nothing could run; health says why
                    break
                # Read before "busy": a consumer marks a claim pending before it takes from the
                # budget, and records whether a claim came back empty before it clears the
                # mark, so a claim that spends the budget, or ends with work, after one of
                # these reads is seen as busy below. Read after it, a claim starting between
                # the two reads was seen by neither, and the run ended with the claim that
                # spent its budget still out, its delivery handed back (audit helper-134).
                spent, takes = self._budget.read()
                all_empty = all(c.last_receive_empty or c.failing for c in consumers)
                # "Pending" first: a consumer counts a claim's deliveries in flight before it
                # clears it, so a claim ending between the two reads is seen by the second.
                busy = any(c.receive_pending or c.in_flight for c in consumers)
                # And again after, with no take since: a claim can give back what it took (no
                # rate token was due, or it came back short) between the first read and "busy"
                # (helper-135), and another consumer's claim take it again before the second
                # (helper-140): spent at both reads, yet a claim is out that "busy" missed.
                if spent and not busy and self._budget.read() == (True, takes):
                    reason = "MaxDeliveries"
                    break
                quiet = min(time.monotonic() - c.last_activity for c in consumers)
                # A consumer whose claim just failed claims again before the run calls the
                # queue idle: once more is a blip, a few times in a row a failure.
                retrying = any(c.retrying for c in consumers)
                # One whose claims keep failing (a database error, or an exception that
                # restarts its loop) has nothing more to give this run: could_not_run says why.
                if not busy and not retrying and all_empty and quiet >= idle_exit_ms / 1000:
                    reason = "Idle"
                    break
                stop_requested.wait(0.02)
        finally:
            processed = sum(c.processed for c in consumers)
            could_not_run = self._could_not_run(consumers)
            if on_stopping is not None:
                on_stopping(reason)
            self.shutdown()
            processed = max(processed, sum(c.processed for c in consumers))
        return RunOnceResult(processed, reason, could_not_run, self.planning_failure)

    def _could_not_run(self, consumers: list[Consumer]) -> list[dict[str, Any]]:
        transient = {c.plan.name for c in consumers if c.retrying}
        return [
            entry
            for entry in self.health()["subscriptions"]
            if entry["state"] in CANNOT_RUN and entry["name"] not in transient
        ]


def _recorded_state(entry: dict[str, Any]) -> tuple[Any, ...]:
    """What of a subscription's health entry is recorded at once when it changes, not at the
    next periodic report: its state, and which of its runs are stuck (so that other processes
    read a run as stuck within a second of it turning so, and as gone once it returns)."""
    stuck = tuple(run["delivery_id"] for run in entry["stuck_runs"])
    return (entry["name"], entry["state"], entry["reason"], entry["stuck_count"], stuck)


def _read_at_start(read: Callable[[], Any]) -> Any:
    """What ``read`` (one of a host's reads before it plans) returns, tried again while the
    database is away (a failover as the host starts, a session cut: a raise here ended the
    start), its broken connection closed first, up to FAILURES_THAT_PERSIST tries in all; then
    its error is raised, as a database that stays away ends the start naming the fix (a
    wrong password or database name also reads as away, and must not keep a host up)."""
    for failures in range(1, FAILURES_THAT_PERSIST + 1):
        try:
            return read()
        except DatabaseError as exc:
            if failures == FAILURES_THAT_PERSIST or not database_away(exc):
                raise
            delay = restart_delay_seconds(failures)
            logger.warning("Starting: %s; reading again in %.0f s", one_line(exc), delay)
        close_old_connections()
        time.sleep(delay)
    raise AssertionError("unreachable")


def _has_the_queue_tables(alias: str) -> bool:
    """Whether ``alias``'s database holds the work queue's tables: asked as planning will ask,
    with its grants and name resolution (a runtime role may not read ``django_migrations``,
    and a catalog listing misses tables reached through a default schema on SQL Server)."""
    from workqueue.models import Subscription

    try:
        Subscription.objects.using(alias).exists()
    except DatabaseError as exc:
        if get_driver(alias).names_a_missing_object(exc):
            return False
        raise
    return True


def _stop_at_once(consumers: list[Consumer], *, process_lives_on: bool) -> list[threading.Thread]:
    """Start stopping every consumer, each on a thread of its own (each drain waits on its own
    handlers); the threads, for the caller to join."""
    threads = [
        threading.Thread(
            target=_stop,
            args=(consumer, process_lives_on),
            name=f"wq-stop-{consumer.plan.name}",
        )
        for consumer in consumers
    ]
    for thread in threads:
        thread.start()
    return threads


def _stop(consumer: Consumer, process_lives_on: bool) -> None:
    """Stop one consumer; a failure is logged, and the thread's connections close with it."""
    try:
        consumer.stop(process_lives_on=process_lives_on)
    except Exception:
        logger.exception("%s: stopping the consumer failed", consumer.plan.name)
    finally:
        close_all_thread_connections()


def aliases_closing_after_each_use(databases: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The database aliases whose connections Django closes after every use (``CONN_MAX_AGE``
    0, its default): a host's worker threads reopen them for each delivery (the executor gives
    each handler fresh connections the way a request gets them)."""
    return [alias for alias, config in databases.items() if config.get("CONN_MAX_AGE", 0) == 0]
