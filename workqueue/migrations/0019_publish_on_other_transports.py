"""Publishing to a topic on another transport.

``wq_publish`` and ``wq_publish_many`` (both vendors; on SQL Server through ``wq_publish_one``)
reject a topic bound to a transport other than Database (or a ``Database.<variant>``) with
``TopicOnOtherTransport`` instead
of writing its messages into the queue tables: ``workqueue.publishing`` then hands them to the
topic's own transport (the AWS transport publishes to SNS). Same parameters and result shape.

New: ``wq_reserve_deduplication``, ``wq_confirm_deduplication`` and
``wq_release_deduplication`` (runtime grant: ``migrate`` renews it for every role that
holds it), the ledger steps of a publish on a transport outside these tables: reserve
the key, send, then confirm it or, when sending failed, release it.

Reinstalls the procedures from the current files.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0018_task_result_times_from_the_database"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0019_publish_on_other_transports"), migrations.RunPython.noop
        ),
    ]
