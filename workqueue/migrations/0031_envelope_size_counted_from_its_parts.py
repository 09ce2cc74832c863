"""A publish counts its envelope's size from the parts, without building the envelope.

The size guard of ``wq_publish`` and ``wq_publish_many`` (the count the procedure trusts when
a caller understates it) measured each message by building its envelope as a jsonb object and
writing it out: a copy of the payload and a sort of its keys, about 2 us a message and the
largest single cost of a batch's item checks. ``wq_envelope_text_bytes`` gives the same count
from the parts' own text (tests/driver/test_envelope_size.py compares the two), so no message
is accepted or refused differently.

``wq_new_id`` reads the clock with ``date_part`` instead of ``extract``'s numeric, at half the
cost (the same milliseconds, but for a tie at exactly half of one, which now rounds to the even
one).

``wq_publish_many`` copies each payload fewer times: ``wq_publish_items`` no longer sorts its
rows (every reader orders them by position itself), the rows the fan-out reads leave the
payloads out, and the results are made from the ids the batch statement collected instead of
taking the batch apart again.

``wq_publish`` runs two statements fewer when it can: a publish without a partition key no
longer starts the executor for the Ordered check (a condition holding a subquery is a statement
even when its first part is false), and its result row is returned from the output columns
rather than by a query. Counted with callgrind on a single-user backend, 200 publishes: 766,000
instructions a publish before, 736,000 after.

Reinstalls the procedures from the current files.
"""

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0030_publishes_keep_their_plans"),
    ]

    operations = [
        migrations.RunPython(
            install_procedures_step("0031_envelope_size_counted_from_its_parts"),
            migrations.RunPython.noop,
        ),
    ]
