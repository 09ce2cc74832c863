from __future__ import annotations

from django.apps import AppConfig
from django.core import checks


class WorkqueueConfig(AppConfig):
    name = "workqueue"
    verbose_name = "Work queue"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from workqueue.checks import check_settings

        checks.register(check_settings, "workqueue")
