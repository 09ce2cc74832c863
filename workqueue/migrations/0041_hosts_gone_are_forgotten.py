"""Changes no table and no procedure: it is here so that ``migrate`` renews the grants of the
roles that hold one (``renew_grants``), as every workqueue migration does.

The runtime grant now includes DELETE on ``workqueue_hostrecord``: the sweeper deletes the
record of a host not seen for ``HOST_RECORD_RETENTION_DAYS`` (one is written per host start, and
nothing deleted them). A role granted before this release gets it from this migrate; without
it, each sweeper pass would fail its host-records step.
"""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0040_dead_letter_pages_without_payloads"),
    ]

    operations = [migrations.RunPython(migrations.RunPython.noop, migrations.RunPython.noop)]
