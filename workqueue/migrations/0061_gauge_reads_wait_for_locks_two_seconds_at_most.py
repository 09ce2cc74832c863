"""Reinstalls both vendors' procedures so that the gauge reads (``wq_queue_gauges``,
``wq_backlog``) wait at most 2 s for a lock on a queue table (VACUUM FULL, a migrate's ALTER
TABLE), then fail: a metrics scrape held a web worker and a database session for as long as
such a lock was held (reviews helper-185 and helper-186). Signatures are unchanged: processes
of the previous release call on.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0060_dead_letter_dry_runs_lock_nothing"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0061_gauge_reads_wait_for_locks_two_seconds_at_most"),
            migrations.RunPython.noop,
        ),
    ]
