"""Reinstalls both vendors' procedures from the current files.

``wq_extend_lease`` renews a cancelled delivery's lease too (and still answers Cancelled, now
with the new expiry): a handler that has not stopped yet is still running, and its Exclusive or
Ordered key must not be freed for the key's next delivery beside it. Only a host that stops
renewing (killed, or cut off from the database) lets such a lease run out. Hosts of the
previous release stop renewing at the cancel, as before.

``wq_publish`` refuses a deduplication window outside 60 s to 30 days (InvalidDeduplication),
as the application does; ``wq_confirm_deduplication`` confirms only a reservation, for a window
of at least a minute: a caller that knew a confirmed key's message id could shorten its window
and publish the message again. ``wq_retry`` and ``wq_dead_letter`` keep at most 16,000
characters of error text.

PostgreSQL: the publish procedures wait at most 5 s for their topic's topology lock (through
the new ``wq_wait_for_topology``), then fail with SQLSTATE 55P03, which publishers retry: the
lock is an advisory lock any connected role can hold, and publishes waited for it with no
limit. A ``delay_seconds`` runs from the publish call (``statement_timestamp()``), not from its
transaction's start.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0041_hosts_gone_are_forgotten"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0042_cancelled_leases_renewed_and_ledger_fenced"),
            migrations.RunPython.noop,
        ),
    ]
