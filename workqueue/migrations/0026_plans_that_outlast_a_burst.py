"""Statement plans that stay cheap after a burst fills the queue tables.

PL/pgSQL keeps each statement's plan for the session. A plan made while a table was nearly
empty (a host or a publisher that started on a quiet queue) could read that table from end to
end, and went on doing so on every call after a burst had filled it, until autovacuum analyzed
the table: ``wq_publish_many`` hashed the whole message table to give each item its result (a
60,000-message run fell from about 14,000 to 6,000 messages per second), ``wq_complete_many``
hashed the whole delivery table, and the single-row settles, heartbeats and deduplication
statements, the sweeper's lease expiry, an operator's cancel, partition listing, backlog and
bulk recovery scanned their tables (and the orphan purge read every message on each pass). Now
the batch publish reads a stored message only for an item whose id was taken, once, by primary
key; the batch completion looks its ids up in the primary key before joining them to their
tokens; the functions that find rows by key leave sequential scans aside; and the orphan purge
walks its index topic by topic. A batch publish also tells which of its items went in by one
hashed lookup of the inserted rows, where it searched them once per item (a batch of 5,000
spent most of its database time there). Same parameters and results.

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
            install_procedures_step("0026_plans_that_outlast_a_burst"),
            migrations.RunPython.noop,
        ),
    ]
