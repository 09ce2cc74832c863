"""A handler that completes its delivery inside its own transaction (``context.complete(
enlist=True)``) goes on running after the commit; its partition key was free from the commit
on, so the key's next delivery started beside the rest of the handler, on this host or another
(review helper-193). Such a completion now goes through ``wq_complete_holding_key``, which
keeps a keyed delivery's lease on its Completed row; ``wq_claim`` starts none of the key's
deliveries while one holds an unexpired lease, and the host lets go with ``wq_release_key``
when the handler returns (a host that died lets go when the lease ends). The index finds those
rows for a claim. Both vendors' procedures are reinstalled; signatures are unchanged, so
processes of the previous release call on (their enlisted completions free the key at once,
as before). ``wq_extend_lease`` renews such a hold, ``wq_backlog`` and ``wq_list_partitions``
count a held key as in flight, and the sweeper clears a passed hold nobody let go of (review
helper-194).

The index is built while ``migrate`` holds the delivery table's lock (it covers no row yet,
but the build reads the table): on a large table, run it when a pause in publishing and
settling is acceptable (README, Upgrading).
"""

from django.db import migrations, models

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0063_deduplication_keys_refused_as_the_column_would_cut_them"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="delivery",
            index=models.Index(
                condition=models.Q(("lease_expires_at__isnull", False), ("status", "Completed")),
                fields=["subscription", "partition_key"],
                name="wq_dlv_key_held_ix",
            ),
        ),
        migrations.RunPython(
            install_procedures_step("0064_enlisted_completions_hold_their_key"),
            migrations.RunPython.noop,
        ),
    ]
