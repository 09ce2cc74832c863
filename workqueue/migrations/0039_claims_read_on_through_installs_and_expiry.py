"""Reinstalls both vendors' procedures from the current files.

Both: a claim says how long its leases are (in a last row of kind 'Lease'), and a renewal
keeps the length the delivery was claimed with when the subscription's lease was shortened since:
a host whose copy of the setting is behind, or a delivery held across the edit, renews in time.

PostgreSQL: installing no longer drops and creates the topology delete guards, nor the filter
guard, which locked ``workqueue_subscription`` and ``workqueue_topic`` against every reader
until the migrate committed: claims and publishes read on through this and later upgrades.

SQL Server: ``wq_claim`` reads the clock again after it hands expired leases back, so that the
same claim can take those deliveries (they are visible from the moment the expiry ran), as on
PostgreSQL; it left them to a later claim, up to an idle poll later.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0038_publish_many_locks_topology_before_its_ordered_check"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0039_claims_read_on_through_installs_and_expiry"),
            migrations.RunPython.noop,
        ),
    ]
