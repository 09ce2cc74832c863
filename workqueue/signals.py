"""Django signals sent by the work queue.

``dead_lettered`` fires in the process that dead-lettered a delivery (a handler's outcome, or an
expired last attempt found by this process's claims or sweeper). It is not durable: alert on
``DeadLettered > 0`` in the stats for that. ``published`` fires after an accepted publish so
in-process consumers of the topic can wake at once.
"""

from __future__ import annotations

from django.dispatch import Signal

#: kwargs: subscription_id, delivery_id, partition_key, reason
dead_lettered = Signal()

#: kwargs: topic (the name as published), message_ids
published = Signal()
