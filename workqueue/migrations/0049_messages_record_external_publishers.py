"""Each message records whether an API key published it over the REST API; reinstalls both
vendors' procedures, which store it (``p_external``, already their parameter).

A message names what runs it only through its subscription's handler: work published for one
handler, by whoever could publish to the topic, became Tasks API tasks once the subscription
was given the Tasks API's handler (audit helper-137: a key's task-shaped payload ran as any
task). The switch is refused only while the subscription holds such work, which needs to know
who published it. Nothing records who published the messages already stored, so they read
as a key's (the safe side: a subscription holding such work keeps its handler until it drains);
the column is added with that default, then given the application's (``False``), so only rows
stored before this migration read True. Each procedure writes the column explicitly anyway.

Adding a column with a constant default rewrites no table on PostgreSQL 11 and later (the
existing rows read the default given when it was added) or on SQL Server (a metadata-only
change since 2012 Enterprise; other editions fill the column once).
"""

from django.db import migrations, models

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0048_settled_deliveries_walked_by_subscription"),
    ]

    operations = [
        migrations.AddField(
            model_name="message",
            name="published_externally",
            field=models.BooleanField(
                db_default=True, help_text="Published over the REST API with an API key."
            ),
        ),
        # Dropped, then set: SQL Server's schema editor changes a default only by adding one,
        # which a column holding one refuses.
        migrations.AlterField(
            model_name="message",
            name="published_externally",
            field=models.BooleanField(help_text="Published over the REST API with an API key."),
        ),
        migrations.AlterField(
            model_name="message",
            name="published_externally",
            field=models.BooleanField(
                db_default=False, help_text="Published over the REST API with an API key."
            ),
        ),
        migrations.RunPython(
            install_procedures_step("0049_messages_record_external_publishers"),
            migrations.RunPython.noop,
        ),
    ]
