"""Reinstalls both vendors' procedures, bounding what 0055 left to the caller (review
helper-176): ``wq_claim`` clamps its row count to 0..5000 (NULL: 0; ``conf.MAX_CLAIM_ROWS``,
far above a host's MAX_CONCURRENCY free slots and default prefetch, and the most a host asks
for), ``wq_retire_discard`` and ``wq_retire_purge`` clamp their batch to 1..5000 (NULL: 1000)
as every other batch does, and ``wq_discard_pending`` counts the rows other sessions hold
locked as examined (skipped, never changed) instead of walking past them uncounted. Any role
granted the claim leased 100,000 deliveries in one transaction, and on PostgreSQL a NULL count
spun for ever; a retirement call discarded or deleted every row at once; a bulk discard batch
walked through as many locked rows as there were. Signatures are unchanged: processes of the
previous release call on.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0055_procedures_bound_what_callers_pass"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0056_claims_and_bulk_batches_capped"),
            migrations.RunPython.noop,
        ),
    ]
