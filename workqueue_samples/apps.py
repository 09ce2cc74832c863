from __future__ import annotations

from django.apps import AppConfig


class WorkqueueSamplesConfig(AppConfig):
    name = "workqueue_samples"
    verbose_name = "Work queue samples"
    default_auto_field = "django.db.models.BigAutoField"
