"""Retiring a subscription through procedures: ``wq_retire_discard`` (its Pending and dead
letters → Discarded) and ``wq_retire_purge`` (its settled deliveries deleted, whatever their
age), both only for a Disabled subscription and granted to the operator role. Used by
``manage.py workqueue retire-subscription``.

Reinstalls the procedures from the current files; roles granted ``grant-operator`` before need
it run again to be granted the two new procedures.
"""

from __future__ import annotations

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [("workqueue", "0011_task_results")]

    operations = [
        migrations.RunPython(
            install_procedures_step("0012_retire_subscription"), migrations.RunPython.noop
        ),
    ]
