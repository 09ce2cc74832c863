"""Reinstalls both vendors' procedures so that a rate limit's unused tokens come back (less what
the bucket may have refilled while they were out) when it is a day or more from full:
``wq_take_rate_tokens`` answers a day at most, and ``wq_return_rate_tokens`` bounded what it
gave back by that day's refill, so a slow bucket with a large burst lost tokens it never used
(at 0.001 per second, 13 of 99: review helper-185).
Signatures are unchanged: processes of the previous release call on.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0058_pending_discard_dry_runs_lock_nothing"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0059_slow_buckets_keep_unused_tokens"),
            migrations.RunPython.noop,
        ),
    ]
