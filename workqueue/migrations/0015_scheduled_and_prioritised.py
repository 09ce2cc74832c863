"""Scheduled and prioritised deliveries.

- ``Delivery.priority`` (-100..100, default 0) and claim indexes led by (subscription, priority,
  visible_at), so a claim takes higher priorities first and reads only rows already due.
- ``wq_publish`` gains ``not_before``, ``delay_seconds`` and ``priority`` (``wq_publish_many``
  reads the same fields from each item); ``wq_claim`` visits priorities highest first.

Reinstalls the procedures from the current files. On PostgreSQL the old ``wq_publish`` (fewer
parameters) is dropped by the install, which grants the new one to the roles that held the old.
"""

import django.db.models.functions.datetime
from django.db import migrations, models

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0014_rate_limits"),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name="delivery",
            name="wq_dlv_claim_keyed_ix",
        ),
        migrations.RemoveIndex(
            model_name="delivery",
            name="wq_dlv_claim_keyless_ix",
        ),
        migrations.AddField(
            model_name="delivery",
            name="priority",
            field=models.SmallIntegerField(db_default=0),
        ),
        migrations.AlterField(
            model_name="delivery",
            name="visible_at",
            field=models.DateTimeField(
                db_default=django.db.models.functions.datetime.Now(), verbose_name="due at"
            ),
        ),
        migrations.AddIndex(
            model_name="delivery",
            index=models.Index(
                condition=models.Q(("partition_key__isnull", False), ("status", "Pending")),
                fields=["subscription", "priority", "visible_at"],
                include=("partition_key", "order_key"),
                name="wq_dlv_claim_keyed_pri_ix",
            ),
        ),
        migrations.AddIndex(
            model_name="delivery",
            index=models.Index(
                condition=models.Q(("partition_key__isnull", True), ("status", "Pending")),
                fields=["subscription", "priority", "visible_at"],
                name="wq_dlv_claim_keyless_pri_ix",
            ),
        ),
        migrations.AddConstraint(
            model_name="delivery",
            constraint=models.CheckConstraint(
                condition=models.Q(("priority__gte", -100), ("priority__lte", 100)),
                name="wq_delivery_priority_range",
            ),
        ),
        migrations.RunPython(
            install_procedures_step("0015_scheduled_and_prioritised"), migrations.RunPython.noop
        ),
    ]
