"""Reinstalls both vendors' procedures: the sweeper's steps (``wq_expire_leases_all``, the three
purges) and ``wq_expire_leases`` clamp their batch to 1..5000 (NULL: their usual size), as the
operator procedures do, and ``wq_extend_lease`` stores progress of more than 16,000 characters
of JSON as a note saying so. Any role granted these procedures passes its own batch size and
progress: one call deleted every due row in one transaction (``LIMIT NULL`` is no limit), and a
holder stored megabytes of progress that every read of the delivery then carried (review
helper-173). On both vendors a trigger (``wq_subscription_mode_guard``) refuses to change a
subscription's partition mode once it has deliveries, as the model does: an UPDATE outside the
ORM turned an Ordered subscription whose key a dead letter blocked into Exclusive, and the
key's next delivery ran. Signatures are unchanged: processes of the previous release call on.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0054_rate_tokens_given_back_net_of_refill"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0055_procedures_bound_what_callers_pass"),
            migrations.RunPython.noop,
        ),
    ]
