"""Announcements that name their subscriptions: a publish to a topic whose subscriptions filter
what they receive wakes only the consumers of the subscriptions that got deliveries.

Every publish woke every consumer of its topic, and each claimed: on a topic with filtered
subscriptions most of those claims found nothing (a round trip each, per publish, per host).
``wq_announce`` gains ``p_message_ids`` (default NULL: wake every consumer, as before); given
the published ids on such a topic, its notification's payload lists the ids of the
subscriptions that got deliveries, and the hosts kick only those consumers (an empty payload
still wakes them all, so hosts and publishers of either release work together during the
upgrade). SQL Server accepts the parameter; it has no notifications.

The function is created with the new parameter and the old one dropped; the roles that could
execute the old one are granted the new one.

Reinstalls the procedures from the current files.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0027_publishes_announced_after_commit"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0028_announcements_name_their_subscriptions"),
            migrations.RunPython.noop,
        ),
    ]
