"""A publish skips the filter matcher for subscriptions that have no filter.

The fan-out called ``wq_filter_matches`` for every subscription of the topic, filtered or not:
one PL/pgSQL call (on SQL Server a scalar function call) per delivery row, a good part of what
each row of a fan-out costs. A subscription without a filter receives every message, which
the matcher answers without reading anything, so the publish procedures now test
``filter IS NULL`` first and call the matcher only for filtered subscriptions. Which
subscriptions get a delivery does not change.

Reinstalls the procedures from the current files.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0028_announcements_name_their_subscriptions"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0029_unfiltered_fan_out_skips_the_matcher"),
            migrations.RunPython.noop,
        ),
    ]
