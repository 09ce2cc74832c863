"""Set-based ``publish_many``.

On PostgreSQL ``wq_publish_many`` reads the topic once per batch and writes a batch without
deduplication keys with one INSERT of its messages and one of their deliveries (the new helper
``wq_publish_items`` applies ``wq_publish``'s per-message checks to every item). Same parameters
and results; SQL Server's procedures are unchanged.

Reinstalls the procedures from the current files.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0015_scheduled_and_prioritised"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0016_set_based_publish_many"), migrations.RunPython.noop
        ),
    ]
