"""Running single deliveries through ``DeliveryExecution`` without a host: the executor and
transactional-completion tests claim a delivery themselves and pick the plan's timings."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from django.db import connection

from workqueue import publish
from workqueue.driver import get_driver
from workqueue.models import Subscription
from workqueue.runtime.executor import DeliveryExecution, ExecutionResult, ExecutionServices
from workqueue.runtime.handlers import HandlerRegistry
from workqueue.runtime.plan import SubscriptionPlan
from workqueue.runtime.timers import TimerQueue
from workqueue.transport import Receiver
from workqueue.transports import transport_for
from workqueue.types import ClaimedDelivery


class ExecutionRig:
    """Claims deliveries and runs them with handlers from ``registry`` as ``user``; ``close()``
    when done."""

    def __init__(self, registry: HandlerRegistry, user: Any) -> None:
        self.registry = registry
        self.user = user
        self.timers = TimerQueue("test-timers")
        self.background = ThreadPoolExecutor(1, thread_name_prefix="test-heartbeats")
        self.threads: list[threading.Thread] = []

    def claim(
        self, sub: Subscription, payload: dict[str, Any] | None = None, *, key: str | None = None
    ) -> tuple[Receiver, ClaimedDelivery]:
        """Publish ``payload`` (unless None: something already waits) and claim one delivery."""
        if payload is not None:
            publish(sub.topic.name, payload, partition_key=key)
        receiver = Receiver(sub.id, "test-holder")
        (delivery,) = receiver.receive(1).deliveries
        return receiver, delivery

    def execution(
        self,
        sub: Subscription,
        receiver: Receiver,
        delivery: ClaimedDelivery,
        *,
        grace: float = 5.0,
        leased_at: float | None = None,
        **plan_changes: Any,
    ) -> DeliveryExecution:
        plan = dataclasses.replace(SubscriptionPlan.from_subscription(sub), **plan_changes)
        if "lease_seconds" in plan_changes:
            # The executor times the lease by what the claim said: a test's shorter lease (a
            # quick local horizon over the database's longer one) is the claim's too.
            delivery = dataclasses.replace(delivery, lease_seconds=plan_changes["lease_seconds"])
        services = ExecutionServices(
            receiver=receiver,
            complete=receiver.complete,
            timers=self.timers,
            background=self.background,
            handlers=self.registry,
            user=self.user,
            lease_grace_seconds=grace,
            cancels=transport_for(plan.driver_class).supports_cancel,
        )
        return DeliveryExecution(delivery, plan, services, leased_at=leased_at)

    def start(self, execution: DeliveryExecution) -> Future[ExecutionResult]:
        """Run ``execution`` on a thread of its own, as a host runs handlers (closing that
        thread's connections after)."""
        future: Future[ExecutionResult] = Future()

        def target() -> None:
            try:
                future.set_result(execution.run())
            except BaseException as exc:  # surfaced by future.result()
                future.set_exception(exc)
            finally:
                get_driver().close()
                connection.close()

        thread = threading.Thread(target=target, name="test-execution", daemon=True)
        self.threads.append(thread)
        thread.start()
        return future

    def close(self) -> None:
        for thread in self.threads:
            thread.join(timeout=30)
        self.timers.stop()
        self.background.submit(get_driver().close).result()
        self.background.shutdown(wait=True)
