"""Every procedure that turns sequential scans off turns JIT off too.

With ``enable_seqscan = off`` a sequential scan the planner cannot avoid (a small topology table
read end to end, a statement added later without an index to match) is costed at 10^10, which
passes every JIT threshold, and PostgreSQL then compiles the statement at each call: 0035 found
the sweeper's purges paying 110-165 ms a call for it. The claim and the sweeper already ran
without JIT; now so do the others that leave sequential scans aside (publishing, settling,
renewals, the operators' walks). None of them gains from JIT: each statement reads a few rows.

PostgreSQL only; SQL Server has no JIT. Reinstalls the procedures from the current files.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0036_task_results_walked_by_start_time"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0037_no_procedure_plan_jit_compiled"),
            migrations.RunPython.noop,
        ),
    ]
