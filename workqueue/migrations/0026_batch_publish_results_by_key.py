"""A batch publish looks up a stored message only for an item whose id was already taken.

``wq_publish_many`` gave each item its result through a join on the message table. PL/pgSQL
keeps a statement's plan for the session, and a plan made while the table was small hashed the
whole table for that join on every later batch, however large the table had grown meanwhile (a
60,000-message run fell from about 14,000 to 6,000 messages per second). The stored message is
now read by primary key, and only for the items that need it. Same parameters and results.

Reinstalls the procedures from the current files.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0025_queue_rows_without_topology_constraints"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0026_batch_publish_results_by_key"),
            migrations.RunPython.noop,
        ),
    ]
