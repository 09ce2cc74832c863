"""Task results get an index on their start time.

The sweeper deletes a Tasks API result once retention has purged its message. It looked for
them by testing every result against the messages table at every pass, so its cost grew with
the number of live results (100,000 of them: 80 ms a pass). Only a result that started longer
ago than the shortest retention can have lost its message, and the sweeper now walks those
along this index.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0035_sweeper_plans_not_jit_compiled"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="taskresult",
            index=models.Index(fields=["started_at"], name="wq_taskresult_started_ix"),
        ),
    ]
