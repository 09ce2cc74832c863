from __future__ import annotations

from django.db import models


class ScheduleRecord(models.Model):
    """The latest slot published of each recurring schedule (``WORKQUEUE["SCHEDULES"]``), by
    the schedule's name, whatever its definition was then: a slot at or before it is not
    published again (``workqueue.runtime.scheduler``). The slot's deduplication key alone could
    not tell: it is kept per topic (a schedule moved to another topic found none once the slot's
    message was purged), and an edited zone or cron names the day's slot at another time (the
    nightly job ran twice the day its zone was fixed: review helper-188). Written by every host's
    scheduler (not a queue table: nothing of a delivery's fencing rests on it)."""

    name = models.CharField(max_length=100, primary_key=True)
    #: The slot's time in UTC, ISO 8601 (``2026-07-01T03:00:00+00:00``): text, which sorts as
    #: the times do and reads back the same whatever ``USE_TZ`` (a datetime column read back
    #: naive with ``USE_TZ = False`` could not be compared with a slot's: review helper-189).
    last_slot = models.CharField(max_length=32)
    #: A digest of the definition the slot was published under (Schedule.digest): a host whose
    #: definition differs says once that the slot is not published again as now defined.
    definition = models.CharField(max_length=64)

    def __str__(self) -> str:
        return f"{self.name}: {self.last_slot}"
