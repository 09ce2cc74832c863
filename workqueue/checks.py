"""System checks: misconfiguration is reported by ``manage.py check`` with the fix in the hint."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.conf import settings
from django.core import checks

from workqueue.exceptions import WorkQueueConfigurationError


def check_settings(app_configs: list[AppConfig] | None = None, **kwargs: Any) -> list[Any]:
    from workqueue.conf import get_settings

    try:
        conf = get_settings()
    except WorkQueueConfigurationError as exc:
        return [
            checks.Error(
                str(exc),
                hint="Fix settings.WORKQUEUE or the WORKQUEUE_* environment variable named.",
                id="workqueue.E001",
            )
        ]
    errors = []
    if conf.DATABASE_ALIAS not in settings.DATABASES:
        errors.append(
            checks.Error(
                f"WORKQUEUE['DATABASE_ALIAS'] is {conf.DATABASE_ALIAS!r}, which is not in "
                "DATABASES.",
                hint="Set it to one of the aliases in DATABASES (usually 'default').",
                id="workqueue.E002",
            )
        )
        return errors
    from workqueue.driver import driver_class_for_alias

    try:
        driver_class_for_alias(conf.DATABASE_ALIAS)
    except WorkQueueConfigurationError as exc:
        errors.append(
            checks.Error(
                str(exc),
                hint="Use PostgreSQL (django.db.backends.postgresql) or SQL Server (mssql).",
                id="workqueue.E003",
            )
        )
    if not conf.SYSTEM_USER:
        errors.append(
            checks.Warning(
                "WORKQUEUE['SYSTEM_USER'] is not set; hosts will refuse to start.",
                hint="Set WORKQUEUE['SYSTEM_USER'] (or WORKQUEUE_SYSTEM_USER) to the username "
                "or e-mail of an existing user that handlers run as.",
                id="workqueue.W001",
            )
        )
    return errors
