"""A handler that completed its delivery in its own transaction holds the delivery's partition
key while it runs on (0064). Nothing reached such a handler, and two deletes took its row from
under it (review helper-199): ``wq_cancel`` now also asks it to stop (the delivery stays
Completed; the key is free when the handler returns), and ``wq_retire_purge`` and
``wq_purge_terminal_deliveries`` leave a live hold alone. Both vendors' procedures are
reinstalled; signatures are unchanged, so processes of the previous release call on.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0064_enlisted_completions_hold_their_key"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0065_held_keys_reached_by_operators_and_kept_by_purges"),
            migrations.RunPython.noop,
        ),
    ]
