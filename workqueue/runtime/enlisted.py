"""Transactional completion: a handler settles its delivery inside its own transaction.

``context.complete(enlist=True)`` runs ``wq_complete_holding_key`` (``wq_complete``, the one
fenced completion every settle path uses, keeping a keyed delivery's lease so that its partition
key stays held while the handler runs on after the commit; the executor renews that lease and
lets go with ``wq_release_key`` when the handler returns) on the handler's own connection inside
its open ``transaction.atomic()`` on the work queue's database alias. The procedure's UPDATE
locks the delivery's row until that transaction ends, and that lock carries the fence from the
call to the commit: claims and lease expiry skip locked rows, so nobody can take the delivery
over in between, even past its lease.

* Commit: the handler's writes and the completion become visible together.
* Rollback (of the block, or of a savepoint around the call): both are undone; the row is
  InFlight under the same lease again and the handler's outcome is settled as usual.
* Until then the runtime's own connection must not touch the row: an UPDATE there would wait
  for the handler's transaction, for ever if the handler waited for it (a heartbeat from inside
  the block). So renewals are skipped, and the local lease horizon waits, while the completion
  is pending.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from django.db import transaction

from workqueue.exceptions import EnlistError
from workqueue.transport import refuse_a_transaction_on_another_alias
from workqueue.types import DeliveryStatus

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper


#: How long commit hooks may be seen running before this completion's own (always the first of
#: its commit's) has run, if that commit is this completion's: a thread switch or two.
OWN_HOOK_START_SECONDS = 1.0


class EnlistedCompletion:
    """A ``wq_complete`` that took effect in the transaction open on ``connection``; tells
    whether that transaction has committed, rolled back, or is still open."""

    PENDING = "Pending"
    COMMITTED = "Committed"
    ROLLED_BACK = "RolledBack"

    def __init__(
        self,
        connection: BaseDatabaseWrapper,
        *,
        on_commit: Callable[[], None] | None = None,
        on_committed: Callable[[], None] | None = None,
    ) -> None:
        self.connection = connection
        #: Called on the committing thread once the transaction has committed: ``on_commit``
        #: while ``state()`` still reads pending, ``on_committed`` once it reads committed.
        self._on_commit = on_commit
        self._on_committed = on_committed
        self._committed = False
        self._undone = False
        self._hooks_seen_running_at: float | None = None
        # One bound method, kept, so that it can be found again by identity in the hook list.
        self._hook = self._mark_committed
        transaction.on_commit(self._hook, using=connection.alias)
        # Moved before the hooks the handler registered earlier: one of those that raises
        # (after the commit) stops the hooks behind it, and the committed completion would
        # read as rolled back.
        hooks = connection.run_on_commit
        hooks.insert(0, hooks.pop())

    def _mark_committed(self) -> None:
        if self._on_commit is not None:
            self._on_commit()
        self._committed = True
        if self._on_committed is not None:
            self._on_committed()

    def state(self, *, handler_returned: bool = False) -> str:
        """The transaction's fate so far. Timer threads ask too. Django keeps a transaction's
        commit hooks in ``run_on_commit`` until it commits (then runs them) or rolls back (then
        drops them, also when a savepoint around the call rolls back). While a commit's hooks
        run, the list is already empty and ``run_commit_hooks_on_set_autocommit_on`` is set,
        for this transaction's commit or for a later one after this completion was undone:
        ours runs first of its commit's hooks, so a moment of that reads as still pending (the
        row may already be committed Completed), and longer means another commit's hooks.
        Once the handler has returned (``handler_returned``) its hooks have run, and the flag
        may stay set after one of them raised: not marked committed is rolled back then."""
        if self._committed:
            return self.COMMITTED
        if any(entry[1] is self._hook for entry in list(self.connection.run_on_commit)):
            return self.PENDING
        if handler_returned:
            return self.ROLLED_BACK
        if self.connection.run_commit_hooks_on_set_autocommit_on and not self._undone:
            now = time.monotonic()
            if self._hooks_seen_running_at is None:
                self._hooks_seen_running_at = now
            if now - self._hooks_seen_running_at < OWN_HOOK_START_SECONDS:
                return self.PENDING
            # Not ours (ours would have run by now): once undone, never ours again.
            self._undone = True
        # Read again: the commit and its hooks may have run since the first test above.
        return self.COMMITTED if self._committed else self.ROLLED_BACK


def open_transaction(alias: str) -> BaseDatabaseWrapper:
    """This thread's connection to ``alias`` when a ``transaction.atomic()`` is open on it;
    otherwise ``EnlistError`` saying which block to open."""
    connection = transaction.get_connection(alias)
    if connection.in_atomic_block:
        return connection
    refuse_a_transaction_on_another_alias(alias, "context.complete(enlist=True)")
    raise EnlistError(
        f"context.complete(enlist=True) needs an open transaction on database {alias!r}: "
        f"call it inside the `with transaction.atomic(using={alias!r}):` block that makes "
        "your changes, so they and the completion commit or roll back together. To complete "
        "when the handler returns instead, return Outcome.complete()."
    )


def cancel_requested(alias: str, delivery_id: str) -> bool:
    """Whether the running delivery carries an operator's cancel request (read on the caller's
    connection: the lease token itself is readable by no role but the owner)."""
    # Imported here: the runtime reads models only where it must (importing workqueue.runtime
    # must not load models before apps are ready).
    from workqueue.models import Delivery

    return (
        Delivery.objects.using(alias)
        .filter(pk=delivery_id, status=DeliveryStatus.IN_FLIGHT, cancel_requested_at__isnull=False)
        .exists()
    )
