"""Each message records whether an API key published it over the REST API; reinstalls both
vendors' procedures, which store it (``p_external``, already their parameter).

A message names what runs it only through its subscription's handler: work published for one
handler, by whoever could publish to the topic, became Tasks API tasks once the subscription
was given the Tasks API's handler (audit helper-137: a key's task-shaped payload ran as any
task). The switch is refused only while the subscription holds such work, which needs to know
who published it; messages from before this migration read as not published by a key.

The column has a default, so adding it rewrites no table on PostgreSQL 11 and later or on SQL
Server.
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
                db_default=False, help_text="Published over the REST API with an API key."
            ),
        ),
        migrations.RunPython(
            install_procedures_step("0049_messages_record_external_publishers"),
            migrations.RunPython.noop,
        ),
    ]
