"""Publishers that share the WAL flush: a publish on the publisher's own connection no longer
sends its NOTIFY inside its own transaction.

A transaction that notifies holds a cluster-wide lock from just before its commit until its
commit record is on disk, so every notifying transaction waited for the previous one's flush:
concurrent publishers committed one at a time instead of sharing a flush (measured with pgbench
on the 2-core build machine: 8 clients inserting a row and notifying committed ~3,400 times a
second, ~7,600 without the NOTIFY). ``wq_publish`` and ``wq_publish_many`` gain
``p_caller_announces`` (default NULL: notify at commit, as before); the driver passes true for a
publish on its own connection and, once the publish has committed, announces it with the new
``wq_announce`` (sent on the same connection without waiting for the answer), whose
transaction writes nothing else and so commits without waiting for a flush. An enlisted publish
still notifies when the caller's transaction commits. SQL Server accepts the parameter and has
``wq_announce`` for parity; it has no notifications.

The two publish functions are created with the new parameter and the old ones dropped; the roles
that could execute the old ones are granted the new ones. Processes still running the previous
release keep publishing during the upgrade (the new parameter has a default).

Reinstalls the procedures from the current files.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0026_plans_that_outlast_a_burst"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0027_publishes_announced_after_commit"),
            migrations.RunPython.noop,
        ),
    ]
