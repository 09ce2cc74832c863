"""Claims keep their plans, batched completions probe by primary key.

On PostgreSQL ``wq_claim`` keeps one plan per session for each of its statements
(``plan_cache_mode = force_generic_plan``, with sequential scans and JIT left aside, since every
statement is written for an index): its batch claim, whose LIMIT comes from a variable, was
re-planned on every call, about a third of a claim's cost. Its keyless batch is picked, then
updated by ctid. ``wq_complete_many`` finds its rows by primary key instead of letting the
planner read every InFlight row. Same parameters and results; SQL Server's procedures are
unchanged.

Reinstalls the procedures from the current files.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0019_publish_on_other_transports"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0020_cheaper_claims_and_completions"),
            migrations.RunPython.noop,
        ),
    ]
