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

A rate-limit burst stored without a rate is cleared: it limited nothing, and is now refused.
"""

from typing import Any

from django.db import migrations

from workqueue.driver.install import install_procedures_step


def clear_bursts_without_a_rate(apps: Any, schema_editor: Any) -> None:
    """A rate-limit burst without a rate limited nothing; such a subscription is now refused
    when saved (by retire-subscription, the admin, a topology sync), so the meaningless burst
    is cleared."""
    quote = schema_editor.quote_name
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {quote('workqueue_subscription')} SET {quote('rate_limit_burst')} = NULL "
            f"WHERE {quote('rate_limit_per_second')} IS NULL "
            f"AND {quote('rate_limit_burst')} IS NOT NULL"
        )


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0042_cancelled_leases_renewed_and_ledger_fenced"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0043_keyless_work_takes_its_turn_among_keys"),
            migrations.RunPython.noop,
        ),
        migrations.RunPython(clear_bursts_without_a_rate, migrations.RunPython.noop),
    ]
