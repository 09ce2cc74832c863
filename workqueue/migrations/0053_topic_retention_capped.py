"""A topic keeps its settled work at most 36,500 days (100 years).

The purges count each topic's cutoff back from now in one statement over every topic, so one
topic whose retention_days an operator set to "for ever" (a few million days passed every
check) took that cutoff out of the database's range: the statement failed, and no topic's
settled work was purged any more, each sweeper pass logging an error that named neither the
topic nor the setting (review helper-164). A topic set longer than the cap is set to the cap
here, which keeps its work for a hundred years.

Not a procedure migration: the range is a CHECK on the topic table and a validator on the
field (every ORM write path applies it).
"""

import django.core.validators
from django.db import migrations, models

MAX_RETENTION_DAYS = 36_500


def cap_longer_retentions(apps, schema_editor):
    Topic = apps.get_model("workqueue", "Topic")
    Topic.objects.using(schema_editor.connection.alias).filter(
        retention_days__gt=MAX_RETENTION_DAYS
    ).update(retention_days=MAX_RETENTION_DAYS)


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0052_settles_dated_by_their_call"),
    ]

    operations = [
        migrations.RemoveConstraint(model_name="topic", name="wq_topic_retention"),
        migrations.AlterField(
            model_name="topic",
            name="retention_days",
            field=models.PositiveIntegerField(
                default=7,
                validators=[
                    django.core.validators.MinValueValidator(1),
                    django.core.validators.MaxValueValidator(
                        MAX_RETENTION_DAYS,
                        "Keep settled work at most 36500 days (100 years): the longest "
                        "retention the purges can count back.",
                    ),
                ],
            ),
        ),
        migrations.RunPython(cap_longer_retentions, migrations.RunPython.noop),
        migrations.AddConstraint(
            model_name="topic",
            constraint=models.CheckConstraint(
                condition=models.Q(retention_days__gte=1, retention_days__lte=MAX_RETENTION_DAYS),
                name="wq_topic_retention_range",
            ),
        ),
    ]
