"""The guestbook the ``samples.guestbook`` handler signs: its database work, written in the same
transaction that completes the handler's delivery."""

from __future__ import annotations

from django.db import models


class GuestbookEntry(models.Model):
    name = models.CharField(max_length=200)
    #: The message that asked for the entry, and the attempt that wrote it.
    message_id = models.UUIDField()
    attempt = models.PositiveIntegerField()
    signed_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name_plural = "guestbook entries"

    def __str__(self) -> str:
        return self.name
