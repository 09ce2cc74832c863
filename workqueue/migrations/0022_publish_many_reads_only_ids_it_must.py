"""``wq_publish_many`` looks a message id up only for an item that was neither rejected nor
accepted (to tell a duplicate from a conflicting id): it probed the message table's primary key
for every item of every batch and threw the rows away, about a tenth of the batch's database
time. PostgreSQL only; same parameters and results.

Reinstalls the procedures from the current files.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0021_operators_do_not_wait_on_held_rows"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0022_publish_many_reads_only_ids_it_must"),
            migrations.RunPython.noop,
        ),
    ]
