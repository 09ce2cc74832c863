from __future__ import annotations

import gc

from django.apps import AppConfig
from django.core import checks

#: Objects frozen (``gc.freeze``) before Django loaded the apps, read as the interpreter's own:
#: CPython 3.12 reports a few hundred from its start (375 for 3.12.1; 3.11 and 3.13 none). Read
#: here, the first of the queue's modules a process imports, so that what the project freezes
#: later (a pre-forking server, say) counts as its own (workqueue.runtime.process).
FROZEN_BEFORE_THE_APPS = gc.get_freeze_count()


class WorkqueueConfig(AppConfig):
    name = "workqueue"
    verbose_name = "Work queue"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.core.signals import request_finished
        from django.db.backends.signals import connection_created
        from django.db.models.signals import post_migrate, pre_delete, pre_save

        from workqueue import signals
        from workqueue.checks import (
            check_environment,
            check_handler_keys,
            check_handler_modules,
            check_settings,
            check_system_user,
            check_task_queue_drift,
            check_topology_declaration,
            check_topology_drift,
        )
        from workqueue.driver import close_before_database_administration, close_thread_connections
        from workqueue.driver.install import renew_grants_after_migrate
        from workqueue.models.readonly import DriverOwnedModel, refuse_signalled_write
        from workqueue.models.topology import (
            Subscription,
            Topic,
            Transport,
            validate_topology_write,
        )
        from workqueue.tasks.signals import send_task_finished_for_dead_letter

        checks.register(check_settings, "workqueue")
        checks.register(check_handler_modules, "workqueue")
        checks.register(check_topology_declaration, "workqueue")
        checks.register(check_environment, "workqueue")
        post_migrate.connect(
            renew_grants_after_migrate, sender=self, dispatch_uid="workqueue-renew-grants"
        )
        checks.register(check_system_user, "workqueue", checks.Tags.database)
        checks.register(check_handler_keys, "workqueue", checks.Tags.database)
        checks.register(check_topology_drift, "workqueue", checks.Tags.database)
        checks.register(check_task_queue_drift, "workqueue", checks.Tags.database)
        request_finished.connect(close_thread_connections, dispatch_uid="workqueue-driver")
        connection_created.connect(
            close_before_database_administration, dispatch_uid="workqueue-driver-no-db"
        )
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
        # Model.save_base (loaddata's raw saves) and an unbound Model.delete skip the models'
        # own save()/delete(); the signals reach the driver-owned models all the same. Every
        # one of them: with no receiver an unbound delete takes Django's fast path.
        for model in self.get_models():
            if not issubclass(model, DriverOwnedModel):
                continue
            for signal in (pre_save, pre_delete):
                signal.connect(
                    refuse_signalled_write,
                    sender=model,
                    dispatch_uid=f"workqueue-readonly-{model.__name__}",
                )
