"""Reinstalls both vendors' procedures so that a publish always locks an Ordered key as it is
stored (review helper-179). The publish procedures refuse a partition key the tables would
store as another (empty, ending in a space, or over 200 characters: PostgreSQL cut a key of
200 characters and trailing spaces to 200 without an error, and SQL Server compares keys
ignoring trailing spaces), with ``InvalidPartitionKey`` as the application already did; and
triggers take a topic's topology lock whenever a subscription becomes one whose keys publishes
must lock (an Ordered one inserted, enabled, refiltered or moved), whatever writes the row, as
the model's saves did. A runtime role calling the procedures itself, or a role writing the
topology with SQL, ran an Ordered key's later delivery before its earlier one. Signatures are
unchanged: processes of the previous release call on.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0056_claims_and_bulk_batches_capped"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0057_publishes_lock_the_keys_they_store"),
            migrations.RunPython.noop,
        ),
    ]
