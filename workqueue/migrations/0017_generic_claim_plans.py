"""Claims on generic plans, batched completions by primary key.

On PostgreSQL ``wq_claim`` runs with ``plan_cache_mode = force_generic_plan`` (its batch claim,
a LIMIT taken from a variable, was re-planned on every call, which cost about as much as the
claim itself) and updates the rows it picked by ctid; ``wq_complete_many`` finds its rows by
primary key instead of letting the planner read every InFlight row. Same parameters and results;
SQL Server's procedures are unchanged.

Reinstalls the procedures from the current files.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0016_set_based_publish_many"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0017_generic_claim_plans"), migrations.RunPython.noop
        ),
    ]
