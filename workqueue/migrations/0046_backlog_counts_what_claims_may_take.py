"""Reinstalls both vendors' procedures from the current files.

Both: ``wq_backlog`` counts nothing claimable for a subscription whose topic or transport is
Disabled. Since 0044 ``wq_claim`` treats such a subscription as Paused, but the backlog still
counted its Pending rows, so an autoscaler (``manage.py workqueue grant-scaler``'s query) started
hosts for work none of them could claim.

SQL Server: a keyed claim skips a candidate row another session holds locked (``READPAST``), as
the keyless claim and PostgreSQL's ``SKIP LOCKED`` do, instead of waiting on it; a rate-limit
bucket never hands out more than its burst when the clock has stepped back after the burst was
lowered.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0045_stats_counted_along_their_own_indexes"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0046_backlog_counts_what_claims_may_take"),
            migrations.RunPython.noop,
        ),
    ]
