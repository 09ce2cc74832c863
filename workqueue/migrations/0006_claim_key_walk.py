"""Claims whose cost never follows a blocked backlog.

- wq_claim gains ``after_key``: when a hot key's blocked backlog fills the oldest rows, a bounded
  walk over partition keys goes on from where the caller's last walk stopped (see
  ``workqueue/sql/*/claim.sql``). Procedures are reinstalled from the current files; the
  three-argument wq_claim is dropped as no longer declared.
- The claim index is split into keyed and keyless halves, so that neither claim path walks
  the other's rows (a partitioned subscription's keyless batch used to read its whole keyed
  backlog to find none).
- The delivery uniqueness constraint now leads with the message, so no full index leads with
  the subscription: with lagging statistics the planner preferred it to the partial claim
  indexes and sorted a whole backlog on every claim. The message's own index is dropped, as
  the constraint covers it.
"""

from __future__ import annotations

from typing import Any

import django.db.models.deletion
from django.db import migrations, models

from workqueue.driver.install import install_procedures_step


# The name Django gave the foreign key's index in 0001 (the same on every backend).
MESSAGE_INDEX = models.Index(fields=["message"], name="workqueue_delivery_message_id_9e733dd7")


def drop_message_index(apps: Any, schema_editor: Any) -> None:
    schema_editor.remove_index(apps.get_model("workqueue", "Delivery"), MESSAGE_INDEX)


def create_message_index(apps: Any, schema_editor: Any) -> None:
    schema_editor.add_index(apps.get_model("workqueue", "Delivery"), MESSAGE_INDEX)


class Migration(migrations.Migration):
    dependencies = [("workqueue", "0005_api_keys")]

    operations = [
        migrations.AddIndex(
            model_name="delivery",
            index=models.Index(
                condition=models.Q(("partition_key__isnull", False), ("status", "Pending")),
                fields=["subscription", "visible_at"],
                include=["partition_key", "order_key"],
                name="wq_dlv_claim_keyed_ix",
            ),
        ),
        migrations.AddIndex(
            model_name="delivery",
            index=models.Index(
                condition=models.Q(("partition_key__isnull", True), ("status", "Pending")),
                fields=["subscription", "visible_at"],
                name="wq_dlv_claim_keyless_ix",
            ),
        ),
        migrations.RemoveIndex(model_name="delivery", name="wq_dlv_claim_ix"),
        migrations.AddConstraint(
            model_name="delivery",
            constraint=models.UniqueConstraint(
                fields=("message", "subscription"), name="wq_delivery_message_sub_uq"
            ),
        ),
        migrations.RemoveConstraint(model_name="delivery", name="wq_delivery_sub_message_uq"),
        # The message's own index, now covered by the constraint, is dropped by name: an
        # AlterField would make SQL Server's schema editor introspect the live database, which
        # the offline DDL check (tests/driver/test_sqlserver_ddl.py) cannot offer.
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="delivery",
                    name="message",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="deliveries",
                        to="workqueue.message",
                    ),
                )
            ],
            database_operations=[
                migrations.RunPython(drop_message_index, create_message_index),
            ],
        ),
        migrations.RunPython(
            install_procedures_step("0006_claim_key_walk"), migrations.RunPython.noop
        ),
    ]
