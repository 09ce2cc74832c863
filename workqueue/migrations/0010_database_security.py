"""The procedures cannot be turned against their owner, trust their callers less, and cost what
their caps allow.

Reinstalls the procedures from the current files:

- On PostgreSQL the SECURITY DEFINER functions run with ``search_path = pg_catalog, pg_temp``
  and name their own tables and functions by schema, so nothing a role creates in that schema
  is ever resolved inside them; installing refuses a schema where roles other than the owner
  may create objects (the README's Database security section has the REVOKE to run first).
- ``wq_publish`` counts the envelope it stores and trusts a caller's size only upward.
- ``wq_backlog``, ``wq_list_dead_letters`` and ``wq_list_partitions`` clamp their caps and
  bound their key walks; ``wq_list_partitions`` gains a ``kind`` column (its 'KeyCursor' row
  says where a walk stopped), so on PostgreSQL it is dropped and created again, and roles must
  be granted it again (``grant-operator``).

Grants are not changed: see the README's upgrade note under Database roles.
"""

from __future__ import annotations

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [("workqueue", "0009_names_match_in_full")]

    operations = [
        migrations.RunPython(
            install_procedures_step("0010_database_security"), migrations.RunPython.noop
        ),
    ]
