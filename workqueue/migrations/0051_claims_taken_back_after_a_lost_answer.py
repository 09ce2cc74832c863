"""Reinstalls both vendors' procedures: ``wq_claim`` takes an id for each claim from the
caller (``claim_id``), makes the claimed rows' lease tokens from it, and hands back first what
an earlier claim named in ``retake_claim_id`` took when that claim's answer was lost with its
connection (it had committed: its deliveries stayed hidden for a lease, then ran as a further
attempt). Both parameters have defaults, so the previous release's calls bind unchanged during
a rolling deploy.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0050_task_results_name_their_topic"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0051_claims_taken_back_after_a_lost_answer"),
            migrations.RunPython.noop,
        ),
    ]
