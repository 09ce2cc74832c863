from __future__ import annotations

from django.db import migrations

from workqueue.driver.install import drop_procedures_step, install_procedures_step


class Migration(migrations.Migration):
    dependencies = [("workqueue", "0001_initial")]

    operations = [
        migrations.RunPython(install_procedures_step("0002_procedures"), drop_procedures_step),
    ]
