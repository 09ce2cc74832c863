"""Django signals sent by the work queue.

``dead_lettered`` fires in the process that dead-lettered a delivery (a handler's outcome, or an
expired last attempt found by this process's claims or sweeper). It is not durable: alert on
``DeadLettered > 0`` in the stats for that. ``published`` fires after an accepted publish so
in-process consumers of the topic can wake at once.
"""

from __future__ import annotations

import logging
from typing import Any

from django.dispatch import Signal

logger = logging.getLogger(__name__)

#: kwargs: subscription_id, delivery_id, partition_key, reason
dead_lettered = Signal()

#: kwargs: topic (the name as published), message_ids
published = Signal()


def send(signal: Signal, sender: Any, **kwargs: Any) -> None:
    """Send ``signal`` to every receiver whatever the others do, logging (with its traceback)
    each receiver that raises. The work queue sends its signals after the fact (the delivery is
    dead-lettered, the message committed): a receiver's failure (a pager that is down) must not
    fail the claim, pass or publish that sent it, nor keep the signal from the next one."""
    for receiver, outcome in signal.send_robust(sender=sender, **kwargs):
        if isinstance(outcome, Exception):
            logger.error(
                "A receiver of a work-queue signal raised: %s",
                getattr(receiver, "__qualname__", repr(receiver)),
                exc_info=outcome,
            )
