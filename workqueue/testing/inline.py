"""Testing code that publishes and handles work, with Django's TestCase, TransactionTestCase or
pytest-django.

The queue normally runs every call on a private connection of its own, outside the caller's
transaction. A ``TestCase`` (or pytest-django's ``db``) wraps each test in a transaction that is
rolled back, so the queue could not see the topology or rows the test created. In test mode
(``use_test_connection``) the thread's queue calls run on the test's own connection instead,
each in a savepoint: the stored procedures still do the work, and the test's rollback removes
what they wrote. ``run_until_idle`` runs due deliveries on the calling thread, with the real
executor (handler call, outcome, retry and dead-letter rules, logging), until none is left.
"""

from __future__ import annotations

import dataclasses
import unittest
import warnings
from dataclasses import dataclass
from typing import Any

from django.db import DatabaseError, connections, transaction
from django.test.utils import TestContextDecorator

from workqueue.conf import get_settings
from workqueue.driver.base import on_django_connection
from workqueue.exceptions import DeliveriesNotRunWarning, WorkQueueConfigurationError
from workqueue.runtime.executor import DeliveryExecution, ExecutionResult, ExecutionServices
from workqueue.runtime.handlers import autodiscover, handler_registry
from workqueue.runtime.host import CANNOT_RUN, Host, HostConfig, PlanEntry, PlanState
from workqueue.runtime.plan import SubscriptionPlan
from workqueue.runtime.timers import TimerQueue
from workqueue.runtime.workers import WorkerPool
from workqueue.system_user import configured_name, find_system_user, unknown_user_problem
from workqueue.transports import transport_for
from workqueue.types import DeliveryStatus


# Lower-case, like django.test.override_settings, which it is used like.
class use_test_connection(TestContextDecorator):
    """Run this thread's work-queue calls on the test's database connection (test mode).

    Use it as a decorator on a test function, a pytest test class (each of its ``test*``
    methods) or a ``TestCase`` class (active in ``setUpTestData``, and from ``setUp`` to the
    test's cleanup), with or without parentheses, or as a context manager (in a pytest
    fixture, say). While it is active, ``publish()``,
    ``publish_many()``, the operator functions and ``run_until_idle()`` called on this thread
    see what the test's transaction holds and write into it, each call in a savepoint so a
    failing call undoes only itself. Calls from other threads keep their private connections.
    """

    def __new__(cls, decorated: Any = None) -> Any:
        if decorated is not None:
            # @use_test_connection without parentheses, as @pytest.mark.django_db is written:
            # it failed with "__init__() takes 1 positional argument" (review helper-175).
            return cls()(decorated)
        return super().__new__(cls)

    def __init__(self, decorated: Any = None) -> None:
        super().__init__()
        self._contexts: list[Any] = []

    def enable(self) -> None:
        context = on_django_connection(get_settings().DATABASE_ALIAS)
        context.__enter__()
        self._contexts.append(context)

    def disable(self) -> None:
        self._contexts.pop().__exit__(None, None, None)

    def decorate_class(self, cls: type) -> type:
        if not issubclass(cls, unittest.TestCase):
            # A pytest test class: Django's decorator takes TestCase classes only, and its
            # TypeError named neither this nor the fixture form (review helper-175).
            for name, attribute in list(vars(cls).items()):
                if name.startswith("test") and callable(attribute):
                    setattr(cls, name, self.decorate_callable(attribute))
            return cls
        decorated = super().decorate_class(cls)
        set_up_test_data = getattr(cls, "setUpTestData", None)
        if set_up_test_data is not None:
            # Django's decorator starts at setUp: a publish in setUpTestData went to the
            # queue's own connection, which cannot see the class's rows (TopicNotFound).
            class_data = set_up_test_data.__func__

            def setUpTestData(klass: type) -> None:
                with self:
                    class_data(klass)

            cls.setUpTestData = classmethod(setUpTestData)  # type: ignore[attr-defined]
        return decorated


@dataclass(frozen=True, slots=True)
class DeliveryRun:
    """One handler run by ``run_until_idle``."""

    subscription: str
    delivery_id: str
    message_id: str
    attempt: int
    #: The delivery's status once this run was settled: ``Completed``, ``Pending`` (it will be
    #: retried), ``DeadLettered`` or ``Discarded``; None when nothing was recorded (lease lost,
    #: settle failed).
    status: str | None
    #: What was recorded with a retry or dead letter: the handler's traceback or reason.
    error: str | None = None


def run_until_idle(
    subscription: str | None = None, *, max_deliveries: int = 100, user: Any = None
) -> list[DeliveryRun]:
    """Run due deliveries on this thread until none is left; return the runs in order.

    ``subscription`` limits the run to one subscription (it must be able to run: an unknown,
    paused or handler-less subscription raises ``WorkQueueConfigurationError`` saying why);
    by default every Worker subscription with a registered handler runs, as a host would run
    them. Deliveries published by handlers run too. A retried delivery runs again only once its
    backoff has passed: inside a ``TestCase`` the database clock stands still for the whole
    test, so a retry with a delay waits for good and the run ends. ``max_deliveries`` bounds the
    run (handlers that keep publishing); the run stops there, leaving the rest, and warns
    (``DeliveriesNotRunWarning``) when some of them were due.

    Handlers run as ``user`` (default: ``WORKQUEUE['SYSTEM_USER']``, which must exist in the
    test database). The run uses test mode (``use_test_connection``) throughout, so it sees and
    writes the test's transaction; lease renewals happen only when a handler calls
    ``context.heartbeat()``, since automatic ones would come from another thread.
    """
    if max_deliveries < 1:
        raise ValueError("max_deliveries must be at least 1")
    conf = get_settings()
    with on_django_connection(conf.DATABASE_ALIAS):
        autodiscover(conf.HANDLER_MODULES)
        entries = _planned(subscription)
        plans = [entry.plan for entry in entries if entry.plan is not None]
        if user is None:
            user = _system_user_of_the_test(conf)
        timers = TimerQueue("wq-test-timers")
        background = WorkerPool(1, "wq-test-background")
        try:
            runs: list[DeliveryRun] = []
            savepoint = _HandlerSavepoint(conf.DATABASE_ALIAS)
            executors = [_Executor(plan, user, timers, background, savepoint) for plan in plans]
            progressed = True
            while progressed and len(runs) < max_deliveries:
                progressed = False
                # One delivery per subscription per round, so one busy subscription cannot
                # starve the others of the budget.
                for executor in executors:
                    if len(runs) >= max_deliveries:
                        break
                    run = executor.run_one()
                    if run is not None:
                        runs.append(run)
                        progressed = True
            _warn_of_deliveries_not_run(entries, conf.DATABASE_ALIAS)
            if len(runs) >= max_deliveries:
                _warn_if_the_budget_left_work(plans, max_deliveries, conf.DATABASE_ALIAS)
            return runs
        finally:
            background.shutdown()
            timers.stop()


def _system_user_of_the_test(conf: Any) -> Any:
    """The system user, which must exist in the test database: the production advice
    (``manage.py workqueue create-system-user``) would make it in the development one."""
    user = find_system_user(conf)
    if user is None:
        raise WorkQueueConfigurationError(
            f"{unknown_user_problem(configured_name(conf))} Handlers run as it, so the test "
            "database needs it: create it in the test (workqueue.system_user."
            "create_system_user(), in setUpTestData or a fixture), or pass "
            "run_until_idle(user=...)."
        )
    return user


def _planned(subscription: str | None) -> list[PlanEntry]:
    """Plan like a host: the named subscription (which must be Running), or every Worker
    subscription, each with what would run of it."""
    # Only the host's planning is used; the host is never started.
    name = (subscription or "*").strip().lower()
    entries = Host(HostConfig(subscriptions=[{"name": name}])).plan()
    if name != "*":
        entry = entries[name]
        if entry.state != PlanState.RUNNING:
            raise WorkQueueConfigurationError(
                f"Subscription {entry.name!r} cannot run: {entry.state} ({entry.reason})."
            )
    return list(entries.values())


def _warn_of_deliveries_not_run(entries: list[PlanEntry], alias: str) -> None:
    """Warn of each subscription that could not run and has Pending deliveries: a handler key
    mistyped in a test's topology left its deliveries unrun without a word, and the test's
    assertion failed far from the cause."""
    from workqueue.models import Delivery

    for entry in entries:
        if entry.state not in CANNOT_RUN:
            continue
        pending = Delivery.objects.using(alias).filter(
            subscription__name=entry.name, status=DeliveryStatus.PENDING
        )
        if pending.exists():
            warnings.warn(
                f"run_until_idle() left the Pending deliveries of subscription {entry.name!r}: "
                f"it cannot run here, {entry.state} ({entry.reason}).",
                DeliveriesNotRunWarning,
                stacklevel=3,
            )


def _warn_if_the_budget_left_work(
    plans: list[SubscriptionPlan], max_deliveries: int, alias: str
) -> None:
    """Warn when the run stopped at ``max_deliveries`` with due deliveries left: handlers that
    keep publishing looked like a run that had finished."""
    from django.db.models.functions import Now

    from workqueue.models import Delivery

    due = Delivery.objects.using(alias).filter(
        subscription_id__in=[plan.subscription_id for plan in plans],
        status=DeliveryStatus.PENDING,
        visible_at__lte=Now(),
    )
    if due.exists():
        warnings.warn(
            f"run_until_idle() stopped at max_deliveries={max_deliveries} with due deliveries "
            "left unrun (handlers that keep publishing?); pass a larger max_deliveries to run "
            "them.",
            DeliveriesNotRunWarning,
            stacklevel=3,
        )


class _Executor:
    """Claims and runs one subscription's deliveries, one at a time, on the calling thread."""

    def __init__(
        self,
        plan: SubscriptionPlan,
        user: Any,
        timers: TimerQueue,
        background: WorkerPool,
        savepoint: _HandlerSavepoint,
    ) -> None:
        # Automatic heartbeats are sent from a timer thread, which has neither the test's
        # connection nor, in a TestCase, sight of its uncommitted rows: the lease would look
        # lost. Handlers that renew it themselves (context.heartbeat()) do so on this thread.
        self.plan = dataclasses.replace(plan, heartbeat_mode="Manual")
        transport = transport_for(plan.driver_class)
        self.receiver = transport.receiver(plan.subscription_id)
        self.services = ExecutionServices(
            receiver=self.receiver,
            cancels=transport.supports_cancel,
            complete=self.receiver.complete,
            timers=timers,
            background=background,
            handlers=handler_registry,
            user=user,
            # The test's connection is left open between handlers (closing it would end the
            # test's transaction); each handler runs in a savepoint on it instead.
            ready_connections=savepoint.begin,
            refresh_connections=savepoint.end,
        )

    def run_one(self) -> DeliveryRun | None:
        claimed = self.receiver.receive(1).deliveries
        if not claimed:
            return None
        delivery = claimed[0]
        result = DeliveryExecution(delivery, self.plan, self.services).run()
        # Plain text: a choices member reprs as DeliveryStatus.PENDING in a failed assertion's
        # diff, where the test compared it with "Completed".
        status = str(result.status) if result.kind == ExecutionResult.SETTLED else None
        error = result.error
        if status in {DeliveryStatus.PENDING, DeliveryStatus.DEAD_LETTERED}:
            error = _last_error(delivery.delivery_id)
        return DeliveryRun(
            subscription=self.plan.name,
            delivery_id=delivery.delivery_id,
            message_id=delivery.message_id,
            attempt=delivery.attempt,
            status=status,
            error=error,
        )


class _HandlerSavepoint:
    """A savepoint around each handler on the test's connection, begun before it and ended
    after it (``ExecutionServices.ready_connections`` / ``refresh_connections``).

    In a ``TestCase`` the handler runs inside the test's transaction, where one failed
    statement (an ``IntegrityError`` the handler let out) aborts the whole transaction: the
    retry could not be recorded, and every later query of the test failed. The savepoint is
    released after the handler, or rolled back to when the handler left the transaction
    aborted (what it wrote before the failed statement goes with it; in a host, each of its
    statements would have committed on its own)."""

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self._savepoint: str | None = None
        self._hooks_before = 0

    def begin(self) -> None:
        # None in autocommit (a TransactionTestCase): every statement then stands alone. The
        # connection's own method: transaction.savepoint() warns from Django 6.1 on, and its
        # successor (savepoint_create) is missing before it.
        self._savepoint = connections[self.alias].savepoint()
        self._hooks_before = len(connections[self.alias].run_on_commit)

    def end(self) -> None:
        savepoint, self._savepoint = self._savepoint, None
        if savepoint is None:
            return
        # Django marks the transaction for rollback when a save fails inside it; a failed raw
        # statement leaves it unmarked but aborted, and its release then fails.
        if not transaction.get_rollback(using=self.alias):
            try:
                transaction.savepoint_commit(savepoint, using=self.alias)
                return
            except DatabaseError:
                pass
        transaction.set_rollback(False, using=self.alias)  # what rolling back to it undoes
        transaction.savepoint_rollback(savepoint, using=self.alias)
        # Django forgets the commit hooks of the atomic blocks it rolls back, not those of a
        # bare savepoint's: an enlisted completion's would still read as pending, and its
        # rolled-back completion as done.
        del connections[self.alias].run_on_commit[self._hooks_before :]


def _last_error(delivery_id: str) -> str | None:
    # Imported here: importing workqueue.testing must not load models before apps are ready.
    from workqueue.models import Delivery

    # A dead letter of Outcome.dead_letter(reason) records only its reason.
    recorded = Delivery.objects.filter(pk=delivery_id).values_list(
        "last_error", "dead_letter_reason"
    )
    return next((error or reason for error, reason in recorded), None)
