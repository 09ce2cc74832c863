"""A publish is announced with a bare notification: the publish tells the driver where and what.

After a publish on its own connection has committed, the driver woke the topic's hosts by
calling ``wq_announce`` (migration 0027), which looked the topic up by name, checked its
subscriptions for filters and, on a filtered topic, looked the published messages' deliveries
up to name the subscriptions that got one. That call was a fifth of what a single publish cost
the database: 183,000 instructions of 976,000 (``bench/instructions.py``), against 56,000 for
a bare ``pg_notify`` in a transaction of its own.

``wq_publish`` and ``wq_publish_many`` now return two more columns, ``announce_topic_id`` and
``announce_payload``, set when the caller announces itself (``p_caller_announces``) and the
publish made deliveries: the topic, and the subscriptions that got one (comma-separated),
collected by the fan-out as it inserts them. The driver sends ``SELECT pg_notify(channel,
payload)`` on the topic's channel; names that would not fit a notification (over 7,000 bytes)
become an empty payload. The payload now names the subscriptions on every topic, not only on
a filtered one; an empty payload still wakes every consumer of the topic, and hosts read both
as before. The columns are PostgreSQL's own, after the ones both vendors return: SQL Server's
procedures are unchanged (no notifications; hosts poll), as a wider result set would break the
previous release's processes there, which read result rows by position. Counted the same way,
a single publish costs the database 910,000 instructions instead of 976,000.

The two functions are dropped and created in their new shape (a result shape cannot be
replaced in place); their grants are renewed by the migrate that applies this migration.
``wq_announce`` stays, for processes of the previous release during an upgrade: they select
the columns they know and announce as before.

Reinstalls the procedures from the current files.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0031_envelope_size_counted_from_its_parts"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0032_publishes_announced_without_a_lookup"),
            migrations.RunPython.noop,
        ),
    ]
