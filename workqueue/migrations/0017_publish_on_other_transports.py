"""Publishing to a topic on another transport.

``wq_publish`` and ``wq_publish_many`` (both vendors; on SQL Server through ``wq_publish_one``)
reject a topic bound to a transport other than Database (or a ``Database.<variant>``) with
``TopicOnOtherTransport`` instead
of writing its messages into the queue tables: ``workqueue.publishing`` then hands them to the
topic's own transport (the AWS transport publishes to SNS). Same parameters and result shape.

New: ``wq_reserve_deduplication``, ``wq_confirm_deduplication`` and
``wq_release_deduplication`` (runtime grant: run ``grant-runtime`` again for the hosts' and
publishers' role), the ledger steps of a publish on a transport outside these tables: reserve
the key, send, then confirm it or, when sending failed, release it.

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
            install_procedures_step("0017_publish_on_other_transports"), migrations.RunPython.noop
        ),
    ]
