from __future__ import annotations

from django.apps import AppConfig
from django.core import checks


class WorkqueueConfig(AppConfig):
    name = "workqueue"
    verbose_name = "Work queue"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.core.signals import request_finished

        from workqueue.checks import check_settings
        from workqueue.driver import close_thread_connections

        checks.register(check_settings, "workqueue")
        request_finished.connect(close_thread_connections, dispatch_uid="workqueue-driver")
