"""The sweep lock becomes a row lock, and both vendors' procedures are reinstalled.

``wq_try_sweep_lock`` took an advisory lock (PostgreSQL) or an application lock (SQL Server),
which any role that may connect can take too: a session that was no sweeper (a reporting login,
an operator's console) holding it stopped every sweeper's passes, so no lease expired and nothing
was purged, for as long as the session lasted. The lock is now the one row of
``workqueue_sweep_lock``, locked for the sweeper's transaction; the grants give no role anything
on that table, so only the procedures can take it.

``wq_claim`` reads the subscription's topic and transport too: a Disabled topic or transport
stops its subscriptions' claims at once, as a Paused subscription does, instead of at each
host's next re-plan. A publish locks its deduplication key before it reserves it
(``wq_lock_deduplication_key``), and ``wq_publish_many`` all of a batch's keys in sorted order
first: batches sharing keys in other orders deadlocked.

Reversing this migration drops the table while the installed ``wq_try_sweep_lock`` still locks
it (reversing a procedure migration never reinstalls older procedures): every sweep fails until
the database is migrated forward again. The previous release runs on this schema, so a
rollback keeps it.
"""

from typing import Any

from django.db import migrations, models

from workqueue.driver.install import install_procedures_step


def add_the_lock_row(apps: Any, schema_editor: Any) -> None:
    """The row sweepers lock (``wq_try_sweep_lock`` puts it back if a ``flush`` removed it)."""
    quote = schema_editor.quote_name
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {quote('workqueue_sweep_lock')} ({quote('id')}) VALUES (1)")


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0043_keyless_work_takes_its_turn_among_keys"),
    ]

    operations = [
        migrations.CreateModel(
            name="SweepLock",
            fields=[
                (
                    "id",
                    models.SmallIntegerField(editable=False, primary_key=True, serialize=False),
                ),
            ],
            options={
                "db_table": "workqueue_sweep_lock",
            },
        ),
        migrations.RunPython(add_the_lock_row, migrations.RunPython.noop),
        migrations.RunPython(
            install_procedures_step("0044_one_sweep_at_a_time_by_a_row_lock"),
            migrations.RunPython.noop,
        ),
    ]
