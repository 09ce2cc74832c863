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
from django.db.models import Exists, OuterRef
from django.db.models.functions import Now
from django.utils import timezone

from workqueue.models.queue import Message
from workqueue.models.topology import Topic


class TaskResultQuerySet(models.QuerySet):
    def purge_orphans(self, limit: int) -> int:
        """Delete up to ``limit`` rows whose message is gone; return how many.

        Retention purges a task's message once its delivery settled longer ago than its topic's
        retention, and a delivery settles after its run started, so that is how results lose
        their messages: long after their start. Each result names its topic, so the walk reads,
        topic by topic along their index, only results that started longer ago than their own
        topic's retention, instead of every result past the shortest retention of any topic
        (beside a topic of a longer retention, all that topic keeps, at every sweeper pass).
        A result of no known topic (recorded before results named theirs, or its topic renamed
        or deleted) is walked from the longest retention's cutoff. A message that goes sooner
        (an operator's purge, a run that started late in its retention) leaves its result to
        be reaped once it passes that cutoff. Cutoffs are read on this process's clock: one
        behind the database's only delays a purge.
        """
        retentions: dict[int, list[str]] = {}
        for name, days in Topic.objects.values_list("name", "retention_days"):
            retentions.setdefault(days, []).append(name)
        if not retentions:  # no topic: no message either, every result is an orphan
            return self._delete_orphans(self, limit)
        now = timezone.now()
        walks = [
            self.filter(topic__in=names, started_at__lt=now - datetime.timedelta(days=days))
            for days, names in sorted(retentions.items())
        ]
        longest = now - datetime.timedelta(days=max(retentions))
        walks.append(self.filter(started_at__lt=longest))
        removed = 0
        for walk in walks:
            removed += self._delete_orphans(walk, limit - removed)
            if removed >= limit:
                break
        return removed

    def _delete_orphans(self, candidates: models.QuerySet, limit: int) -> int:
        """Delete up to ``limit`` of ``candidates`` whose message is gone, in no set order:
        ordered, a walk of a topic list would read all its candidates to sort them."""
        orphans = candidates.filter(~Exists(Message.objects.filter(pk=OuterRef("pk"))))
        return self.filter(pk__in=list(orphans.values_list("pk", flat=True)[:limit])).delete()[0]


class TaskResult(models.Model):
    """The runs of one enqueued task; its id is the task's message id (the result id)."""

    # No foreign key to the message: messages are deleted by the purge procedure, which must
    # not be held up (or cascaded into) by this table.
    id = models.UUIDField(primary_key=True, editable=False)
    #: The name of the topic the task was enqueued on: its retention decides when the message,
    #: then this row, goes (purge_orphans). A name, as the handler receives it: none for rows
    #: recorded before it was kept.
    topic = models.CharField(max_length=200, null=True, blank=True)
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
        # The sweeper's walks for results whose message retention purged (purge_orphans):
        # each topic's from its own cutoff, and those of no known topic from the longest.
        indexes = [
            models.Index(fields=["topic", "started_at"], name="wq_taskresult_topic_started_ix"),
            models.Index(fields=["started_at"], name="wq_taskresult_started_ix"),
        ]

    def __str__(self) -> str:
        return str(self.id)
