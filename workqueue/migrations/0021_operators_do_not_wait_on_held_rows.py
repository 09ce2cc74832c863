"""Operators do not wait on a row a handler's transaction holds.

``wq_cancel`` and ``wq_discard`` wait at most 2 s for a delivery's row, then fail with a lock
timeout (PostgreSQL SQLSTATE 55P03, SQL Server error 1222) that the operator layer reports as
"held by an open transaction, try again": before, an admin action, REST call or CLI verb asking
to cancel a delivery whose handler was completing it inside ``transaction.atomic()`` hung for
as long as the handler kept that transaction open. Same parameters and results.

Reinstalls the procedures from the current files.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0020_cheaper_claims_and_completions"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0021_operators_do_not_wait_on_held_rows"),
            migrations.RunPython.noop,
        ),
    ]
