"""Settled deliveries are indexed by subscription, then age; reinstalls both vendors' procedures.

The retention purge ordered every subscription's settled deliveries by age and kept those past
their own topic's retention: with topics of different retentions (seven days beside fourteen),
each batch read every settled delivery the longer ones still keep, to find the few the shorter
ones may lose (20,010 index entries for 10 deletions in audit helper-130's test), and fell
behind as that history grew. It now walks each subscription up to its topic's cutoff
(``wq_purge_terminal_deliveries``). ``wq_subscription_stats`` counts a subscription's own
completions of the last hour along the same index, among its settled rows of the hour up to its
cap, instead of counting them among the newest completions of every subscription.

The reinstalled procedures also: read a topic's transport again in ``wq_publish`` and
``wq_publish_many`` after waiting for its topology lock (a move to another transport may have
committed meanwhile); and, on PostgreSQL, give the sweep lock's idle session ten minutes
(``wq_try_sweep_lock``; it had no limit, so a frozen sweeper held the lock for ever).

The index is built while ``migrate`` holds the delivery table's lock: on a large table, run it
when a pause in publishing and settling is acceptable (README, Upgrading).
"""

from django.db import migrations, models
from django.db.models import Q

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0047_delivery_rules_kept_by_their_types"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="delivery",
            index=models.Index(
                fields=["subscription", "completed_at"],
                include=["status"],
                condition=Q(status__in=["Completed", "Discarded"]),
                name="wq_dlv_settled_ix",
            ),
        ),
        migrations.RemoveIndex(model_name="delivery", name="wq_dlv_purge_ix"),
        migrations.RunPython(
            install_procedures_step("0048_settled_deliveries_walked_by_subscription"),
            migrations.RunPython.noop,
        ),
    ]
