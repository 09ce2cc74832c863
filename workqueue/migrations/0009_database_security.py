"""The procedures cannot be turned against their owner, and grant only what each role needs.

Reinstalls the procedures from the current files. On PostgreSQL the SECURITY DEFINER functions
now run with ``search_path = pg_catalog, pg_temp`` and name their own tables and functions by
schema, so nothing a role creates in that schema is ever resolved inside them; installing
refuses a schema where roles other than the owner may create objects (see the README's
database security section for the REVOKE to run first).
"""

from __future__ import annotations

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [("workqueue", "0008_operate_permission")]

    operations = [
        migrations.RunPython(
            install_procedures_step("0009_database_security"), migrations.RunPython.noop
        ),
    ]
