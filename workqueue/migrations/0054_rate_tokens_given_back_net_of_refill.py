"""Reinstalls both vendors' procedures: ``wq_take_rate_tokens`` also answers how long the bucket
it leaves takes to refill (``full_in_ms``), and ``wq_return_rate_tokens`` takes how long ago the
tokens it gives back were asked for and that answer (``held_ms``, ``full_in_ms``, with
defaults), and gives back only what the bucket would still hold had they never been taken. A
host whose claim took a while and found nothing gave its tokens back on top of a bucket that
had refilled to its burst meanwhile (and that another host had taken): two bursts started at
once (review helper-166). Hosts of the previous release, which do not say, give back all their
unused tokens, as before.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0053_topic_retention_capped"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0054_rate_tokens_given_back_net_of_refill"),
            migrations.RunPython.noop,
        ),
    ]
