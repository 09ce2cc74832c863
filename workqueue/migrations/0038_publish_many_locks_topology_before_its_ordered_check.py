"""``wq_publish_many`` takes the topic's topology lock before it looks for Ordered
subscriptions, as ``wq_publish`` always did.

It looked first and locked after. A subscription made Ordered (its partition mode changed under
the exclusive topology lock) could commit between the two: the batch then fanned out to it
without having locked its messages' keys, and a later publish of one of those keys, locking it
freely, could commit its ordinal first, so that key ran out of publish order.

PostgreSQL's deduplication windows also run from the publish call (``statement_timestamp()``),
as SQL Server's do, not from the transaction's start (``now()``): a publish enlisted late in a
long transaction had its window cut short by how long the transaction had run. Reinstalls both
vendors' procedures from the current files.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0037_no_procedure_plan_jit_compiled"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0038_publish_many_locks_topology_before_its_ordered_check"),
            migrations.RunPython.noop,
        ),
    ]
