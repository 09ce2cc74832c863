"""Reinstalls both vendors' procedures from the current files.

PostgreSQL: the status, priority and attempt count of a delivery are kept in range by their
columns' types, domains (``wq_delivery_status``, ``wq_priority``, ``wq_attempt_count``), instead
of by three CHECK constraints, which PostgreSQL read from their stored text and planned again at
every statement writing deliveries: a ninth of a publish's database instructions, a seventh of
a claim's and its completion's. The domains are over the columns' own types, so no row is
rewritten; the indexes that name the status in their WHERE are rebuilt (each reads the table)
while ``migrate`` holds the table's lock (README, Upgrading). ``wq_claim`` casts the attempt
count back to its base type where it returns it.

SQL Server keeps the three CHECK constraints, which it compiles into its plans once: Django's
model no longer declares them, and this migration removes them from Django's state only.
Migrating back below it puts PostgreSQL's CHECK constraints back (the earlier migrations that
made them expect them) and the columns' base types.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step, revert_delivery_rules_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0046_backlog_counts_what_claims_may_take"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveConstraint(model_name="delivery", name=name)
                for name in (
                    "wq_delivery_status_valid",
                    "wq_delivery_attempts_nonneg",
                    "wq_delivery_priority_range",
                )
            ],
        ),
        migrations.RunPython(
            install_procedures_step("0047_delivery_rules_kept_by_their_types"),
            revert_delivery_rules_step,
        ),
    ]
