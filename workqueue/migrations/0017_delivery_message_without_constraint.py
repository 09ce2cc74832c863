"""Deliveries keep their message id without a foreign-key constraint.

Only ``wq_publish`` and ``wq_publish_many`` insert deliveries, in the same transaction as their
message, and retention purges a message only when no delivery refers to it
(``wq_purge_orphan_messages``), so the constraint guarded nothing the procedures do not. Its
check cost a row lock on the message (and a WAL record) per delivery: about a sixth of a
publish's database time, and more for each extra subscription of a fan-out. The ORM relation
stays as it was.

The constraint is dropped by the name Django gave it in 0001 (the same on both vendors: it fits
their identifier limits), in SQL both accept, so the SQL Server DDL can still be generated
without a server; going back re-creates it through the schema editor.
"""

import copy

import django.db.models.deletion
from django.db import migrations, models

CONSTRAINT = "workqueue_delivery_message_id_9e733dd7_fk_workqueue_message_id"


def recreate_constraint(apps, schema_editor):
    delivery = apps.get_model("workqueue", "Delivery")
    constrained = delivery._meta.get_field("message")
    unconstrained = copy.copy(constrained)
    unconstrained.db_constraint = False
    schema_editor.alter_field(delivery, unconstrained, constrained)


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0016_set_based_publish_many"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    f"ALTER TABLE workqueue_delivery DROP CONSTRAINT {CONSTRAINT}",
                    reverse_sql=migrations.RunSQL.noop,
                ),
                migrations.RunPython(migrations.RunPython.noop, recreate_constraint),
            ],
            state_operations=[
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
            ],
        ),
    ]
