"""What the host records about each run of a Django Tasks API task (``workqueue.tasks``).

The task's message and delivery already say most of it: the message holds the task path and its
arguments (and ``published_at`` is when it was enqueued); the delivery's status says whether it
is waiting, running, done or failed, and when it finished. This row holds only what neither
knows: when it started, each run's worker, each failure's exception and traceback, and the
return value. An ordinary model, written by the host with the ORM; the sweeper deletes it once
retention has purged its message.
"""

from __future__ import annotations

from django.db import models
from django.db.models import Exists, OuterRef
from django.db.models.functions import Now

from workqueue.models.queue import Message


class TaskResultQuerySet(models.QuerySet):
    def purge_orphans(self, limit: int) -> int:
        """Delete up to ``limit`` rows whose message retention has purged; return how many."""
        orphans = self.filter(~Exists(Message.objects.filter(pk=OuterRef("pk"))))
        return self.filter(pk__in=list(orphans.values_list("pk", flat=True)[:limit])).delete()[0]


class TaskResult(models.Model):
    """The runs of one enqueued task; its id is the task's message id (the result id)."""

    # No foreign key to the message: messages are deleted by the purge procedure, which must
    # not be held up (or cascaded into) by this table.
    id = models.UUIDField(primary_key=True, editable=False)
    # Database clock, like the message's published_at; returned by the insert.
    started_at = models.DateTimeField(db_default=Now(), help_text="When the first run started.")
    last_attempted_at = models.DateTimeField(
        db_default=Now(), help_text="When the latest run started."
    )
    #: One entry per run: the lease owner (host instance id) that ran it.
    worker_ids = models.JSONField(default=list)
    #: One entry per failed run: {"exception_class_path": ..., "traceback": ...}.
    errors = models.JSONField(default=list)
    return_value = models.JSONField(null=True, blank=True)

    objects = TaskResultQuerySet.as_manager()

    class Meta:
        verbose_name = "task result"

    def __str__(self) -> str:
        return str(self.id)
