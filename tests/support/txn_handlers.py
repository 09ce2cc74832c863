"""Handlers that complete their delivery inside their own transaction, for the tests of
``context.complete(enlist=True)`` (in-process and in subprocess hosts, through
``WORKQUEUE_HANDLER_MODULES=tests.support.txn_handlers``).

``tests.txn.effect`` writes one row to ``wq_test_effect`` (the handler's "database work") and
completes transactionally in the same ``transaction.atomic()``. Its payload says where to pause
or fail; an ``int`` applies to every attempt, an object ``{"<attempt>": value}`` to the attempts
it names:

* ``chainTopic``: publish the next step there, enlisted, after writing the row;
* ``holdInsideMs``: sleep after that, before completing (a kill lands in the block);
* ``sleepMs``: the same, but stopping early on the abort signal (then raising, to roll back);
* ``holdAfterCompleteMs``: sleep after completing, still in the block (the row lock is held);
* ``heartbeatAfterComplete``: call ``context.heartbeat()`` there (it must not wait for the lock);
* ``raiseAfterComplete`` (or ``failPercent``, chosen per message and attempt): raise in the block
  after completing, so both roll back;
* ``holdAfterCommitMs``: sleep after the block committed, before returning;
* ``thenReturn``: ``retry`` returns ``Outcome.retry`` after the committed completion.

Each phase is appended as one JSON line to the file named by ``WQ_TEST_TXN_EVENT_LOG`` (if
set) and to ``events`` in this process: ``inside``, ``completed``, ``committed``, ``refused``
(with the exception's class), ``rolled_back``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from django.db import connection, transaction

from tests.support.handlers import fails_transiently
from workqueue import publish
from workqueue.exceptions import LeaseLost
from workqueue.runtime.context import WorkContext, WorkMessage
from workqueue.runtime.handlers import BaseWorkHandler, register_handler
from workqueue.runtime.outcome import Outcome, TransientWorkError

EFFECT_TABLE = "wq_test_effect"
EVENT_LOG_ENV = "WQ_TEST_TXN_EVENT_LOG"

events: list[dict[str, Any]] = []


def create_effect_table() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {EFFECT_TABLE} (id bigserial PRIMARY KEY, "
            "message_id uuid NOT NULL, delivery_id uuid NOT NULL, attempt integer NOT NULL, "
            "pid integer NOT NULL)"
        )


def drop_effect_table() -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE IF EXISTS {EFFECT_TABLE}")


def effects(message_id: str | None = None) -> list[tuple[str, int]]:
    """The committed effect rows as (message id, attempt), oldest first."""
    sql = f"SELECT message_id::text, attempt FROM {EFFECT_TABLE}"
    params: list[Any] = []
    if message_id is not None:
        sql += " WHERE message_id = %s"
        params.append(message_id)
    with connection.cursor() as cursor:
        cursor.execute(sql + " ORDER BY id", params)
        return [(row[0], row[1]) for row in cursor.fetchall()]


def _for_attempt(value: Any, attempt: int) -> Any:
    return value.get(str(attempt)) if isinstance(value, dict) else value


def _record(phase: str, message: WorkMessage, context: WorkContext, **extra: Any) -> None:
    event = {
        "event": phase,
        "pid": os.getpid(),
        "message": message.message_id,
        "delivery": context.delivery_id,
        "attempt": context.attempt,
        "signal": context.signal.reason,
        **extra,
    }
    events.append(event)
    path = os.environ.get(EVENT_LOG_ENV)
    if path:
        # One O_APPEND write per line: lines from concurrent processes never interleave.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(event) + "\n").encode())
        finally:
            os.close(fd)


@register_handler("tests.txn.effect")
class EffectHandler(BaseWorkHandler):
    def handle(self, message: WorkMessage, context: WorkContext) -> Outcome:
        payload = message.payload if isinstance(message.payload, dict) else {}

        def option(name: str) -> Any:
            return _for_attempt(payload.get(name), context.attempt)

        try:
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute(
                        f"INSERT INTO {EFFECT_TABLE} (message_id, delivery_id, attempt, pid) "
                        "VALUES (%s, %s, %s, %s)",
                        [message.message_id, context.delivery_id, context.attempt, os.getpid()],
                    )
                if payload.get("chainTopic"):
                    publish(payload["chainTopic"], {"after": message.message_id}, enlist=True)
                _record("inside", message, context)
                if option("holdInsideMs"):
                    time.sleep(option("holdInsideMs") / 1000)
                if option("sleepMs") and context.signal.wait(option("sleepMs") / 1000):
                    raise TransientWorkError(f"stopped: {context.signal.reason}")
                context.complete(enlist=True)
                _record("completed", message, context)
                if option("heartbeatAfterComplete"):
                    _record("heartbeat", message, context, held=context.heartbeat())
                if option("holdAfterCompleteMs"):
                    time.sleep(option("holdAfterCompleteMs") / 1000)
                if option("raiseAfterComplete") or fails_transiently(
                    message.message_id, context.attempt, payload.get("failPercent", 0)
                ):
                    raise TransientWorkError("failed after completing, inside the block")
        except LeaseLost as exc:
            _record("refused", message, context, error=type(exc).__name__)
            raise
        except Exception:
            _record("rolled_back", message, context)
            raise
        _record("committed", message, context)
        if option("holdAfterCommitMs"):
            time.sleep(option("holdAfterCommitMs") / 1000)
        if payload.get("thenReturn") == "retry":
            return Outcome.retry("returned after a committed completion")
        return Outcome.complete()
