from __future__ import annotations

from django.apps import AppConfig
from django.core import checks


class WorkqueueConfig(AppConfig):
    name = "workqueue"
    verbose_name = "Work queue"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.core.signals import request_finished
        from django.db.models.signals import pre_save

        from workqueue import signals
        from workqueue.checks import check_settings
        from workqueue.driver import close_thread_connections
        from workqueue.models.topology import (
            Subscription,
            Topic,
            Transport,
            validate_topology_write,
        )
        from workqueue.tasks.signals import send_task_finished_for_dead_letter

        checks.register(check_settings, "workqueue")
        request_finished.connect(close_thread_connections, dispatch_uid="workqueue-driver")
        # A task has FAILED once its delivery is dead-lettered: the Tasks API's task_finished.
        signals.dead_lettered.connect(
            send_task_finished_for_dead_letter, dispatch_uid="workqueue-tasks-finished"
        )
        # pre_save rather than save(): loaddata writes through Model.save_base (raw=True),
        # which skips a model's save() but still sends the signal.
        for model in (Transport, Topic, Subscription):
            pre_save.connect(
                validate_topology_write, sender=model, dispatch_uid=f"workqueue-{model.__name__}"
            )
