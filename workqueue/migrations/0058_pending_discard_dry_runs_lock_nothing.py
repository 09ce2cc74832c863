"""Reinstalls both vendors' procedures so that a dry run of a bulk discard of waiting work
(``wq_discard_pending`` with its dry-run flag) locks nothing: it locked every row it walked,
and a real discard made beside it skipped those rows as being claimed, reported them examined
but not matched, and left them Pending to run (review helper-183). Signatures are unchanged:
processes of the previous release call on.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0057_publishes_lock_the_keys_they_store"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0058_pending_discard_dry_runs_lock_nothing"),
            migrations.RunPython.noop,
        ),
    ]
