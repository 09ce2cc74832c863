"""The sweeper's procedures run without JIT.

With sequential scans turned off in their ``SET`` clauses, the purge steps' plans (which read
the topics table end to end for each topic's retention) were estimated above every JIT
threshold, and PostgreSQL compiled them with inlining and optimisation at each call: 150-300 ms
of CPU for a batch of deletes that takes a few milliseconds. The test suite under
``pg_stat_statements`` shows no other statement of the procedures compiled; the claim has run
with ``jit = off`` since 0020.

PostgreSQL only; SQL Server has no JIT. Reinstalls the procedures from the current files.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0034_batches_answered_without_per_item_checks"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0035_sweeper_plans_not_jit_compiled"),
            migrations.RunPython.noop,
        ),
    ]
