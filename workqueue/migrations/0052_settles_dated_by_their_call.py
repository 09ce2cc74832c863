"""Reinstalls both vendors' procedures: PostgreSQL's settles date what they record happening
(a completion, a dead letter) by their call, not by the start of the transaction they run in
(due times stay on the claims' clock). A completion enlisted in a handler's transaction
(``context.complete(enlist=True)``, every Tasks API task) recorded the time of the
transaction's first query, so a task's ``finished_at`` read as its start. SQL Server's already
took the call's time (``SYSDATETIMEOFFSET()``). Rows settled before keep their times.

On SQL Server a publish locks its message id and its deduplication key by application locks
only: the range locks (HOLDLOCK) it also took made every publish wait for any transaction that
had published, enlisted, to commit, and could deadlock two batches whose keys fell into the same
index ranges in opposite orders. ``wq_reserve_deduplication`` (the AWS transport's) takes the
key's lock as a publish does.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0051_claims_taken_back_after_a_lost_answer"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0052_settles_dated_by_their_call"),
            migrations.RunPython.noop,
        ),
    ]
