"""Per-subscription rate limits shared by every host.

Adds ``rate_limit_per_second`` and ``rate_limit_burst`` to subscriptions, the driver-owned token
buckets (``workqueue_rate_limit_bucket``) and the runtime procedures that take and return tokens
(``wq_take_rate_tokens``, ``wq_return_rate_tokens``): run ``grant-runtime`` again for the hosts'
roles.
"""

from __future__ import annotations

import django.core.validators
from django.db import migrations, models

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0013_bulk_recovery"),
    ]

    operations = [
        migrations.CreateModel(
            name="RateLimitBucket",
            fields=[
                (
                    "subscription_id",
                    models.UUIDField(editable=False, primary_key=True, serialize=False),
                ),
                ("tokens", models.FloatField()),
                ("refilled_at", models.DateTimeField()),
            ],
            options={
                "db_table": "workqueue_rate_limit_bucket",
            },
        ),
        migrations.AddField(
            model_name="subscription",
            name="rate_limit_burst",
            field=models.PositiveIntegerField(
                blank=True,
                help_text="How many may start at once after a quiet spell. Empty: the rate rounded up (at least 1).",
                null=True,
                validators=[django.core.validators.MinValueValidator(1)],
            ),
        ),
        migrations.AddField(
            model_name="subscription",
            name="rate_limit_per_second",
            field=models.FloatField(
                blank=True,
                help_text="Most deliveries started per second across every host together (e.g. 0.5 for 30 a minute). Empty: no limit. Deliveries over the limit wait Pending; they never fail.",
                null=True,
                validators=[
                    django.core.validators.MinValueValidator(0.001),
                    django.core.validators.MaxValueValidator(1000000),
                ],
            ),
        ),
        migrations.AddConstraint(
            model_name="subscription",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("rate_limit_per_second__isnull", True),
                    models.Q(
                        ("rate_limit_per_second__gte", 0.001),
                        ("rate_limit_per_second__lte", 1000000),
                    ),
                    _connector="OR",
                ),
                name="wq_sub_rate_limit_range",
            ),
        ),
        migrations.AddConstraint(
            model_name="subscription",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("rate_limit_burst__isnull", True),
                    ("rate_limit_burst__gte", 1),
                    _connector="OR",
                ),
                name="wq_sub_rate_burst_min",
            ),
        ),
        migrations.RunPython(
            install_procedures_step("0014_rate_limits"), migrations.RunPython.noop
        ),
    ]
