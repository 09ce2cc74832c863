"""Rows the procedures create get time-ordered ids (UUID version 7, ``wq_new_id``).

Deliveries and deduplication entries were keyed by random UUIDs, and message ids were random
too: every publish inserted three index entries at random pages of indexes that grow without
bound (two primary keys and the deliveries' (message, subscription) key), a random page read
and, after each checkpoint, a full-page image in the WAL per entry. Version 7 ids start with the
time, so rows created together sit together at the right-hand edge of each index. Message ids
come from the publisher (``workqueue.ids.new_message_id``), on every transport. The T-SQL
procedures keep NEWID() for the rows they create: a version 7 id built in T-SQL is left until a
SQL Server can test it. Same parameters and results.

Reinstalls the procedures from the current files.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0023_cheaper_claim_and_completion_calls"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0024_time_ordered_ids"),
            migrations.RunPython.noop,
        ),
    ]
