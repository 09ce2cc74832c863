"""Reinstalls both vendors' procedures from the current files.

Both: ``wq_list_dead_letters`` takes ``with_payload`` (default true, so the previous release's
calls read on): false leaves each row's payload and payload reference NULL, so a caller who may
not see payloads (no ``workqueue.view_payload``) no longer has a page of up to a thousand of them
read from the table and sent to the web process, only to be blanked there. On PostgreSQL the
four-parameter function replaces the three-parameter one, whose grants move to it.

PostgreSQL: ``wq_try_sweep_lock`` switches ``idle_in_transaction_session_timeout`` off for the
transaction that holds the sweep lock, which sits idle while a pass runs on another connection:
a server timeout shorter than a pass ended that session, let a second sweeper start beside the
first, and failed the first pass once all its steps were done.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0039_claims_read_on_through_installs_and_expiry"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0040_dead_letter_pages_without_payloads"),
            migrations.RunPython.noop,
        ),
    ]
