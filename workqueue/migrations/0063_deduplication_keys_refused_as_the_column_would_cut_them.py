"""Reinstalls both vendors' procedures so that a deduplication key the tables would store as
another (empty, ending in a space, or over 200 characters: PostgreSQL cut 200 characters and a
trailing space to 200 without an error) is refused, as 0057 refuses such a partition key: the
publish's later statements compared the key as given, so its reservation was never confirmed,
a publish of the key as stored was refused for two minutes, and then a duplicate was accepted
inside the window (review helper-193). ``wq_publish`` (and so ``wq_publish_many``) answers
``InvalidDeduplication``; ``wq_reserve_deduplication`` raises. The application never sends
such a key (it strips keys and refuses longer ones), so only callers of the procedures
themselves see a change. Signatures are unchanged: processes of the previous release call on.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0062_schedule_records"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0063_deduplication_keys_refused_as_the_column_would_cut_them"),
            migrations.RunPython.noop,
        ),
    ]
