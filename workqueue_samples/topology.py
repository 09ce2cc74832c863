"""The sample topology: topic ``samples.hello`` fanning out to one subscription per partition
mode, and topic ``samples.guestbook`` with its one subscription. ``seed()`` is idempotent: it
creates what is missing and leaves the rest alone."""

from __future__ import annotations

from django.db import transaction

from workqueue.conf import get_settings
from workqueue.models import Subscription, Topic, Transport
from workqueue.system_user import create_system_user

TOPIC = "samples.hello"
SUBSCRIPTIONS = {
    "samples.hello-log": "None",
    "samples.hello-exclusive": "Exclusive",
    "samples.hello-ordered": "Ordered",
}
GUESTBOOK = "samples.guestbook"


@transaction.atomic
def seed() -> list[str]:
    """Create the sample topic and subscriptions, and the system user handlers run as, if
    missing; return what was created."""
    created = []
    if get_settings().SYSTEM_USER:
        user, new = create_system_user()
        if new:
            created.append(f"system user {user.get_username()}")
    # Seeded by the workqueue migrations; recreated here only if someone deleted it.
    transport, _ = Transport.objects.get_or_create(
        name="Database", defaults={"driver_class": "Database"}
    )
    topic, new = Topic.objects.get_or_create(
        name=TOPIC,
        defaults={
            "transport": transport,
            "description": "Greetings for the hello-world sample handler.",
            "allow_external_publish": True,
            "default_deduplication_ttl_seconds": 3600,
            "retention_days": 7,
        },
    )
    if new:
        created.append(f"topic {TOPIC}")
    for name, mode in SUBSCRIPTIONS.items():
        subscription = Subscription(
            topic=topic,
            name=name,
            partition_mode=mode,
            max_attempts=3,
            backoff_base_seconds=2,
            backoff_max_seconds=30,
            lease_seconds=60,
            handler_key="samples.hello",
            description=f"Hello-world sample, partition mode {mode}.",
        )
        if not Subscription.objects.filter(name=name).exists():
            subscription.full_clean()
            subscription.save()
            created.append(f"subscription {name}")
    guestbook, new = Topic.objects.get_or_create(
        name=GUESTBOOK,
        defaults={"transport": transport, "description": "Guestbook entries, written once each."},
    )
    if new:
        created.append(f"topic {GUESTBOOK}")
    if not Subscription.objects.filter(name=GUESTBOOK).exists():
        subscription = Subscription(
            topic=guestbook,
            name=GUESTBOOK,
            max_attempts=3,
            backoff_base_seconds=1,
            backoff_max_seconds=30,
            handler_key="samples.guestbook",
            description="Exactly-once effects: the entry and the completion commit together.",
        )
        subscription.full_clean()
        subscription.save()
        created.append(f"subscription {GUESTBOOK}")
    return created
