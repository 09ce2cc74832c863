"""Dead letters can be replayed or discarded in bulk, selected by filter, in bounded batches.

Adds ``wq_dlv_dead_letter_ix`` (a subscription's dead letters in delivery id order, the keyset
that ``wq_list_dead_letters`` and the new ``wq_resolve_dead_letters`` walk) and reinstalls the
procedures with ``wq_resolve_dead_letters``. Operator roles need ``grant-operator`` again to be
granted the new procedure (see the README's upgrade note under Database roles).
"""

from __future__ import annotations

from django.db import migrations, models

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [("workqueue", "0012_retire_subscription")]

    operations = [
        migrations.AddIndex(
            model_name="delivery",
            index=models.Index(
                condition=models.Q(("status", "DeadLettered")),
                fields=["subscription", "id"],
                name="wq_dlv_dead_letter_ix",
            ),
        ),
        migrations.RunPython(
            install_procedures_step("0013_bulk_recovery"), migrations.RunPython.noop
        ),
    ]
