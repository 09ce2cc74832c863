"""Reinstalls both vendors' procedures from the current files.

Both: ``wq_subscription_stats`` takes ``cap`` (default NULL, so the previous release's calls
read on) and returns ``capped``. Its counts were exact, and the Pending count, the oldest Pending
age and the completions of the last hour each read far more than the subscription's own rows
(a sequential scan of the whole delivery table, or every subscription's completions): a reader
allowed to see one small subscription had the database read all of them, about half a second a
call at a few million rows. Each count now walks the subscription's own index entries, up to the
cap, as the metrics gauges do, and the completions are counted among the newest ``cap`` of the
last hour. On PostgreSQL the two-parameter function replaces the one-parameter one, whose grants
move to it.

PostgreSQL: ``wq_discard_pending`` reads, for a batch, the range of due times its rows fill. It
ordered by (priority, visible_at, id), which the claim index cannot give, so every batch past the
first read and sorted all of the subscription's rows after its cursor: a bulk discard (or its
dry run) of a backlog of a million ran a thousand such batches, for minutes.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0044_one_sweep_at_a_time_by_a_row_lock"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0045_stats_counted_along_their_own_indexes"),
            migrations.RunPython.noop,
        ),
    ]
