"""The sample handlers: hello-world (``samples.hello``) and the guestbook (``samples.guestbook``).

Its payload switches exercise every path through the runtime (all optional; unknown or
ill-typed fields are ignored):

* ``name``: who to greet (default "World");
* ``sleepMs``: stay in flight this long, stopping early when the abort signal fires;
* ``fail``: ``"fatal"`` dead-letters at once, ``"transient"`` asks for a retry (backoff);
* ``failUntilAttempt``: fail transiently while the attempt is below N, then succeed.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction

from workqueue import BaseWorkHandler, FatalWorkError, Outcome, TransientWorkError, register_handler
from workqueue.conf import get_settings
from workqueue.runtime.context import WorkContext, WorkMessage
from workqueue_samples.models import GuestbookEntry


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@register_handler("samples.hello")
class HelloWorldHandler(BaseWorkHandler):
    def handle(self, message: WorkMessage, context: WorkContext) -> Outcome:
        payload = message.payload if isinstance(message.payload, dict) else {}
        name = payload.get("name") if isinstance(payload.get("name"), str) else "World"
        context.logger.info(
            "Hello, %s! subscription=%s message=%s delivery=%s attempt=%s/%s key=%s replay=%s",
            name,
            context.subscription_name,
            message.message_id,
            context.delivery_id,
            context.attempt,
            context.max_attempts,
            message.partition_key,
            context.is_replay,
        )
        sleep_ms = _int(payload.get("sleepMs"))
        if sleep_ms and sleep_ms > 0 and context.signal.wait(sleep_ms / 1000):
            # Stopped early. The runtime ignores this outcome when the delivery was cancelled
            # or its lease lost, and releases it (no attempt used) on shutdown.
            return Outcome.retry(f"stopped while sleeping: {context.signal.reason}")
        if payload.get("fail") == "fatal":
            raise FatalWorkError("The payload asked for a fatal failure")
        if payload.get("fail") == "transient":
            raise TransientWorkError("The payload asked for a transient failure")
        fail_until = _int(payload.get("failUntilAttempt"))
        if fail_until is not None and context.attempt < fail_until:
            raise TransientWorkError(
                f"Failing until attempt {fail_until} (this is attempt {context.attempt})"
            )
        return Outcome.complete()


@register_handler("samples.guestbook")
class GuestbookHandler(BaseWorkHandler):
    """Signs the guestbook once per message, whatever happens to the process: the entry and the
    delivery's completion commit in one transaction (``context.complete(enlist=True)``).
    ``failAfterWriting`` fails the first attempt after both were written, so both roll back and
    the retry writes the only entry."""

    def handle(self, message: WorkMessage, context: WorkContext) -> Outcome:
        payload = message.payload if isinstance(message.payload, dict) else {}
        name = payload.get("name") if isinstance(payload.get("name"), str) else "World"
        with transaction.atomic(using=get_settings().DATABASE_ALIAS):
            GuestbookEntry.objects.create(
                name=name, message_id=message.message_id, attempt=context.attempt
            )
            context.complete(enlist=True)
            if payload.get("failAfterWriting") and context.attempt == 1:
                raise TransientWorkError(
                    "Failing after writing the entry: the entry and the completion roll back",
                    retry_after_seconds=1,
                )
        return Outcome.complete()
