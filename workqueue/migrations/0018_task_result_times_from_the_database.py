"""A task result's times default to the database clock, so the first run's row is one INSERT
that returns them (it was a locked read, an insert and an update in a transaction of their own,
then a read back)."""

import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0017_delivery_message_without_constraint"),
    ]

    operations = [
        migrations.AlterField(
            model_name="taskresult",
            name="last_attempted_at",
            field=models.DateTimeField(
                db_default=django.db.models.functions.datetime.Now(),
                help_text="When the latest run started.",
            ),
        ),
        migrations.AlterField(
            model_name="taskresult",
            name="started_at",
            field=models.DateTimeField(
                db_default=django.db.models.functions.datetime.Now(),
                help_text="When the first run started.",
            ),
        ),
    ]
