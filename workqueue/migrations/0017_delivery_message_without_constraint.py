"""Deliveries keep their message id without a foreign-key constraint.

Only ``wq_publish`` and ``wq_publish_many`` insert deliveries, in the same transaction as their
message, and retention purges a message only when no delivery refers to it
(``wq_purge_messages``), so the constraint guarded nothing the procedures do not. Its check cost
a row lock on the message (and a WAL record) per delivery: about a sixth of a publish's database
time, and more for each extra subscription of a fan-out. The ORM relation stays as it was.
"""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0016_set_based_publish_many"),
    ]

    operations = [
        migrations.AlterField(
            model_name="delivery",
            name="message",
            field=models.ForeignKey(
                db_constraint=False,
                db_index=False,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="deliveries",
                to="workqueue.message",
            ),
        ),
    ]
