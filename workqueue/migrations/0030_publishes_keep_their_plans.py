"""A publish runs its statements on plans kept for the session.

``wq_publish`` and ``wq_publish_many`` left PostgreSQL to choose, for each statement, between
a plan kept for the session and one made for the call's values. For some statements it chose
a new plan at every call: the Ordered check, which for a call without a partition key plans to
a constant, and the fan-out whenever the subscription table's statistics showed a topic with
many subscriptions. That planning was up to a third of a single publish's PostgreSQL CPU. Both
procedures now set ``plan_cache_mode = force_generic_plan``, as ``wq_claim`` and
``wq_complete_many`` do; every statement in them reads by key, so the kept plan is the plan.

Reinstalls the procedures from the current files.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0029_unfiltered_fan_out_skips_the_matcher"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0030_publishes_keep_their_plans"),
            migrations.RunPython.noop,
        ),
    ]
