"""``workqueue.operate_subscription``: replay, discard and cancel get a permission of their own.

They needed ``change_subscription``, which also edits a subscription's topic and filter, i.e.
where messages go. Nobody holds the new permission after this migration: grant it to the users
or groups who operate the queue (see the README's upgrade note).
"""

from __future__ import annotations

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0007_filter_guards"),
    ]

    operations = [
        migrations.AlterModelOptions(
            name="subscription",
            options={
                "ordering": ["name"],
                "permissions": [
                    ("operate_subscription", "Can replay, discard and cancel deliveries")
                ],
            },
        ),
    ]
