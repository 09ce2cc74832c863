"""Filters are valid wherever they are written.

Reinstalls the procedures from the current files: ``wq_filter_problem`` checks a stored filter
against the grammar, ``wq_filter_matches`` matches nothing for an invalid one (instead of failing
every publish to the topic on PostgreSQL, or matching everything on SQL Server), and the CHECK
constraint ``wq_sub_filter_valid`` refuses invalid filters on every later write. Rows written
before it are left as they are (NOT VALID / WITH NOCHECK); ``manage.py workqueue
validate-bindings`` reports any that are invalid.
"""

from __future__ import annotations

from django.db import migrations

from workqueue.driver.install import install_procedures_step


class Migration(migrations.Migration):
    dependencies = [("workqueue", "0006_claim_key_walk")]

    operations = [
        migrations.RunPython(
            install_procedures_step("0007_filter_guards"), migrations.RunPython.noop
        ),
    ]
