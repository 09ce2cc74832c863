"""What the host records about each run of a Django Tasks API task (``workqueue.tasks``).

The task's message and delivery already say most of it: the message holds the task path and its
arguments (and ``published_at`` is when it was enqueued); the delivery's status says whether it
is waiting, running, done or failed, and when it finished. This row holds only what neither
knows: when it started, each run's worker, each failure's exception and traceback, and the
return value. An ordinary model, written by the host with the ORM; the sweeper deletes it once
retention has purged its message.
"""

from __future__ import annotations

import datetime

from django.db import models
from django.db.models import Exists, Min, OuterRef
from django.db.models.functions import Now
from django.utils import timezone

from workqueue.models.queue import Message
from workqueue.models.topology import Topic


class TaskResultQuerySet(models.QuerySet):
    def purge_orphans(self, limit: int) -> int:
        """Delete up to ``limit`` rows whose message is gone; return how many.

        Retention purges a task's message once its delivery settled longer ago than its topic's
        retention, and a delivery settles after its run started, so that is how results lose
        their messages: long after their start. The walk therefore reads only results that
        started longer ago than the shortest retention of the Tasks API's topics, oldest first
        along their index, instead of testing every result against the messages at every
        sweeper pass (with a million live results, a second of database time a pass). A
        message that goes sooner (an operator's purge, a removed topic, a run that started late
        in its retention) leaves its result to be reaped once it passes that cutoff. The
        cutoff is read on this process's clock: one behind the database's only delays a purge.
        """
        # Imported here: the tasks package imports the models.
        from workqueue.tasks.messages import HANDLER_KEY

        task_topics = Topic.objects.filter(subscriptions__handler_key=HANDLER_KEY)
        shortest = task_topics.aggregate(days=Min("retention_days"))["days"]
        if shortest is None:  # no Tasks API topic left: any topic's
            shortest = Topic.objects.aggregate(days=Min("retention_days"))["days"]
        candidates = self
        if shortest is not None:  # no topic: no message either, every result is an orphan
            cutoff = timezone.now() - datetime.timedelta(days=shortest)
            candidates = self.filter(started_at__lt=cutoff).order_by("started_at")
        orphans = candidates.filter(~Exists(Message.objects.filter(pk=OuterRef("pk"))))
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
        # The sweeper's walk for results whose message retention purged (purge_orphans).
        indexes = [models.Index(fields=["started_at"], name="wq_taskresult_started_ix")]

    def __str__(self) -> str:
        return str(self.id)
