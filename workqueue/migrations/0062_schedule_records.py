"""The latest slot each recurring schedule published, by name (``ScheduleRecord``): a slot at
or before it is not published again, whatever the schedule's topic, zone or cron became since
(review helper-188). An ordinary table, written by the hosts' schedulers."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0061_gauge_reads_wait_for_locks_two_seconds_at_most"),
    ]

    operations = [
        migrations.CreateModel(
            name="ScheduleRecord",
            fields=[
                ("name", models.CharField(max_length=100, primary_key=True, serialize=False)),
                ("last_slot", models.CharField(max_length=32)),
                ("definition", models.CharField(max_length=64)),
            ],
        ),
    ]
