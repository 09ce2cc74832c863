"""Each Tasks API result names the topic its task was enqueued on, and is walked from that
topic's retention.

The sweeper deletes a result once retention has purged its message. It walked every result
that started longer ago than the shortest retention of any topic, so beside a task queue of a
longer retention each pass read all the results that queue still keeps (20,000 read to delete
10 in the test), more as its history grew. Results recorded before this migration name no
topic and are walked from the longest retention instead (reaped later, never sooner).

Not a procedure migration: results are an ordinary model the host writes with the ORM. The
index is built while ``migrate`` holds the table's lock, which holds up every task's start
(its result's INSERT) until it is built: with millions of results, run it in a quiet minute,
as 0047's and 0048's.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0049_messages_record_external_publishers"),
    ]

    operations = [
        migrations.AddField(
            model_name="taskresult",
            name="topic",
            field=models.CharField(blank=True, max_length=200, null=True),
        ),
        migrations.AddIndex(
            model_name="taskresult",
            index=models.Index(
                fields=["topic", "started_at"], name="wq_taskresult_topic_started_ix"
            ),
        ),
    ]
