from __future__ import annotations

import uuid

from django.db import migrations

# The seeded Database transport has a fixed id so topology exported from one environment
# (dumpdata) loads into another (loaddata) pointing at the same transport.
DATABASE_TRANSPORT_ID = uuid.UUID("e39b2117-80ac-49fd-9883-79105f406947")


def seed(apps, schema_editor):
    Transport = apps.get_model("workqueue", "Transport")
    Transport.objects.using(schema_editor.connection.alias).get_or_create(
        id=DATABASE_TRANSPORT_ID,
        defaults={
            "name": "Database",
            "driver_class": "Database",
            "description": "Messages and deliveries live in this database's queue tables.",
        },
    )


def unseed(apps, schema_editor):
    Transport = apps.get_model("workqueue", "Transport")
    Transport.objects.using(schema_editor.connection.alias).filter(
        id=DATABASE_TRANSPORT_ID, topics__isnull=True
    ).delete()


class Migration(migrations.Migration):
    dependencies = [("workqueue", "0002_procedures")]

    operations = [migrations.RunPython(seed, unseed)]
