"""API keys for the REST API: stored as a SHA-256 hash with a display prefix, shown once.

A key acts as its owner: a request needs the key's scope AND the owner's Django permission.
Keys may be limited to named topics (publish) and subscriptions (read/operate), expire, and be
revoked. SHA-256 (not a password hash) because the key is 32 random bytes: it cannot be guessed,
and a slow hash would cost every request.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
import secrets
from typing import Any

from django.conf import settings
from django.db import models
from django.utils import timezone

KEY_PREFIX = "wq"
#: The furthest expiry a key may be issued with (ten years; further is "never").
MAX_EXPIRES_DAYS = 3_650
# last_used_at is written at most this often per key, so busy keys do not write every request.
LAST_USED_RESOLUTION = dt.timedelta(seconds=60)


#: A key's prefix (``secrets.token_hex(4)``); the key as the audit trail and the admin show it
#: (``wq_<prefix>``, perhaps with ``_…``); a whole key (``token_urlsafe``'s alphabet after it).
_PREFIX = re.compile(r"[0-9a-f]{8}")
_SHOWN_KEY = re.compile(rf"\b{KEY_PREFIX}_([0-9a-f]{{8}})(?![0-9a-zA-Z])")
_WHOLE_KEY = re.compile(rf"\b{KEY_PREFIX}_[0-9a-f]{{8}}_[A-Za-z0-9_-]+")


def shown_prefix(text: str) -> str | None:
    """The prefix of the key ``text`` names as the audit trail and the admin show a key
    (``wq_<prefix>``, ``wq_<prefix>_…``, or a whole key), or None."""
    shown = _SHOWN_KEY.search(text)
    return None if shown is None else shown[1]


def hash_key(raw_key: str) -> str:
    return hashlib.sha256(raw_key.encode()).hexdigest()


class ApiKeyQuerySet(models.QuerySet):
    def issue(
        self,
        owner: Any,
        scopes: list[str],
        *,
        name: str = "",
        topics: list[str] | None = None,
        subscriptions: list[str] | None = None,
        expires_days: int | None = None,
    ) -> tuple[ApiKey, str]:
        """Create a key; returns it and the raw key, which is never stored or shown again."""
        from workqueue.operators.permissions import SCOPES, uncovered_scope_problem

        unknown = sorted(set(scopes) - set(SCOPES))
        if not scopes or unknown:
            raise ValueError(
                f"Scopes must be some of {', '.join(SCOPES)}"
                + (f"; unknown: {', '.join(unknown)}" if unknown else "")
            )
        if problem := uncovered_scope_problem(scopes, topics or [], subscriptions or []):
            raise ValueError(problem)
        limit = self.model._meta.get_field("name").max_length
        if len(name) > limit:
            raise ValueError(f"The name is {len(name)} characters long; at most {limit}.")
        if expires_days is not None and not 1 <= expires_days <= MAX_EXPIRES_DAYS:
            raise ValueError(
                f"Expiry must be 1 to {MAX_EXPIRES_DAYS:,} days away; for a key that never "
                "expires, give none."
            )
        prefix = secrets.token_hex(4)
        raw_key = f"{KEY_PREFIX}_{prefix}_{secrets.token_urlsafe(32)}"
        key = self.create(
            owner=owner,
            name=name,
            prefix=prefix,
            key_hash=hash_key(raw_key),
            scopes=sorted(set(scopes)),
            topics=sorted({t.strip().lower() for t in topics or []}),
            subscriptions=sorted({s.strip().lower() for s in subscriptions or []}),
            expires_at=timezone.now() + dt.timedelta(days=expires_days) if expires_days else None,
        )
        return key, raw_key

    def named(self, given: str) -> tuple[ApiKey | None, str | None]:
        """The key ``given`` names, and the prefix it was read as, the only part of it safe to
        print (None when it names none): its prefix, the form the audit trail and the admin
        show (``wq_<prefix>``, ``wq_<prefix>_…``), or the whole key, as found leaked in a log
        line (``Authorization: Bearer wq_…``)."""
        given = given.strip()
        if _PREFIX.fullmatch(given):
            return self.filter(prefix=given).first(), given
        whole = _WHOLE_KEY.search(given)
        if whole is not None and (key := self.filter(key_hash=hash_key(whole[0])).first()):
            return key, key.prefix
        prefix = shown_prefix(given)
        return (None if prefix is None else self.filter(prefix=prefix).first()), prefix

    def authenticate(self, raw_key: str) -> ApiKey | None:
        """The active key matching ``raw_key`` (not revoked, not expired, owner active)."""
        if not raw_key or not raw_key.startswith(f"{KEY_PREFIX}_"):
            return None
        key = self.select_related("owner").filter(key_hash=hash_key(raw_key)).first()
        if key is None or not key.is_active:
            return None
        now = timezone.now()
        if key.last_used_at is None or now - key.last_used_at > LAST_USED_RESOLUTION:
            type(key).objects.filter(pk=key.pk).update(last_used_at=now)
            key.last_used_at = now
        return key


class ApiKey(models.Model):
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="workqueue_api_keys"
    )
    name = models.CharField(max_length=100, blank=True, default="")
    prefix = models.CharField(max_length=16, unique=True, editable=False)
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    scopes = models.JSONField(default=list)
    topics = models.JSONField(default=list, blank=True, help_text="Empty: any topic.")
    subscriptions = models.JSONField(default=list, blank=True, help_text="Empty: any subscription.")
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    objects = ApiKeyQuerySet.as_manager()

    class Meta:
        verbose_name = "API key"
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{KEY_PREFIX}_{self.prefix}_… ({self.owner})"

    @property
    def is_active(self) -> bool:
        return (
            self.revoked_at is None
            and (self.expires_at is None or self.expires_at > timezone.now())
            and self.owner.is_active
        )

    @property
    def state(self) -> str:
        """Why the key is refused, or "active": "revoked", "expired" or "owner inactive"."""
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= timezone.now():
            return "expired"
        return "active" if self.owner.is_active else "owner inactive"

    def revoke(self) -> None:
        if self.revoked_at is None:
            self.revoked_at = timezone.now()
            self.save(update_fields=["revoked_at"])
