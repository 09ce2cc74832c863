"""Reinstalls both vendors' procedures from the current files.

``wq_claim`` on an Exclusive or Ordered subscription took every claimable key before any
keyless delivery, whatever their priorities: keyless work of the highest priority waited while
a keyed backlog of the lowest filled the claims, and keyless work published first waited behind
keys published after it. A claim now takes keys and keyless deliveries in one order: higher
priority first and, within one priority, oldest due first. Hosts of the previous release read
the result as before (the same rows and kinds, in claim order).

``wq_take_rate_tokens`` records its refill at the clock's time even when the clock has stepped
back past the previous refill: kept at the later time, the bucket refilled nothing until the
clock caught up, and a rate-limited subscription started nothing meanwhile.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0042_cancelled_leases_renewed_and_ledger_fenced"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0043_keyless_work_takes_its_turn_among_keys"),
            migrations.RunPython.noop,
        ),
    ]
