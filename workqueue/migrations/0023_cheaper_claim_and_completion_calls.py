"""Fewer statements and no re-planning in the two calls every consumer makes every cycle.

``wq_complete_many`` keeps one plan per session, which finds each item's row by primary key:
depending on a session's first batches and the statistics, PostgreSQL either planned its
statement afresh for every batch (more than completing a batch of eight costs) or kept a plan
that reads every InFlight entry of ``wq_dlv_open_ix``. ``wq_claim`` reads the subscription and probes for passed leases
in one statement, and probes priority levels in its own body instead of calling
``wq_next_priority`` for each. PostgreSQL only; same parameters and results.

Reinstalls the procedures from the current files.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0022_publish_many_reads_only_ids_it_must"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0023_cheaper_claim_and_completion_calls"),
            migrations.RunPython.noop,
        ),
    ]
