"""Reinstalls both vendors' procedures so that a bulk replay or discard of dead letters
(``wq_resolve_dead_letters``) reads its batch without locking it: a dry run locked every dead
letter of its batch while it ran, so a colleague's count held up a real run and made a discard
of one of those dead letters time out (review helper-183). A real run now changes a row only
while it is still the dead letter its batch examined. Signatures are unchanged: processes of
the previous release call on.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0059_slow_buckets_keep_unused_tokens"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0060_dead_letter_dry_runs_lock_nothing"),
            migrations.RunPython.noop,
        ),
    ]
