"""System checks: misconfiguration is reported by ``manage.py check`` with the fix in the hint."""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.apps import AppConfig
from django.conf import settings
from django.core import checks
from django.db import DatabaseError
from django.utils import timezone

from workqueue.exceptions import WorkQueueConfigurationError


def check_settings(app_configs: list[AppConfig] | None = None, **kwargs: Any) -> list[Any]:
    from workqueue.conf import get_settings, setting_problems, unknown_settings_problem

    def read_error(text: str) -> checks.Error:
        return checks.Error(
            text,
            hint="Fix settings.WORKQUEUE or the WORKQUEUE_* environment variable named.",
            id="workqueue.E001",
        )

    # An unknown key beside the other settings' problems, not before them: one at a time, a
    # misspelt SHUTDOWN_DRAIN hid the misspelt concurrency of a SUBSCRIPTIONS entry.
    unknown = unknown_settings_problem()
    errors = [] if unknown is None else [read_error(unknown)]
    try:
        conf = get_settings(ignore_unknown=True)
    except WorkQueueConfigurationError as exc:
        return [*errors, read_error(str(exc))]
    hint = (
        "Fix it in settings.WORKQUEUE (or its WORKQUEUE_* environment variable); "
        "workqueue/conf.py describes each setting."
    )
    errors += [
        checks.Error(problem.text, hint=hint, id="workqueue.E008")
        if problem.serious
        else checks.Warning(problem.text, hint=hint, id="workqueue.W005")
        for problem in setting_problems(conf)
    ]
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
        driver_class = driver_class_for_alias(conf.DATABASE_ALIAS)
    except WorkQueueConfigurationError as exc:
        errors.append(
            checks.Error(
                str(exc),
                hint="Use PostgreSQL (django.db.backends.postgresql) or SQL Server (mssql).",
                id="workqueue.E003",
            )
        )
    else:
        # Warnings: a database that runs as it is (SQL Server on UTC) must not be refused
        # every manage.py command by an upgrade.
        errors.extend(
            checks.Warning(problem, hint="Change it in settings.py.", id="workqueue.W007")
            for problem in driver_class.settings_problems(conf.DATABASE_ALIAS)
        )
    errors.extend(_routing_errors(conf.DATABASE_ALIAS))
    from workqueue.scheduling import load_schedules

    try:
        schedules = load_schedules(conf.SCHEDULES)
    except WorkQueueConfigurationError as exc:
        errors.append(
            checks.Error(
                str(exc),
                hint="Fix the schedule named in WORKQUEUE['SCHEDULES'] (hosts refuse to start "
                "with it).",
                id="workqueue.E005",
            )
        )
    else:
        errors.extend(_scheduler_interval_warnings(schedules, conf.SCHEDULER_INTERVAL_MS))
    if not conf.SYSTEM_USER:
        errors.append(
            checks.Warning(
                "WORKQUEUE['SYSTEM_USER'] is not set; hosts will refuse to start.",
                hint="Set WORKQUEUE['SYSTEM_USER'] (or WORKQUEUE_SYSTEM_USER) to the username "
                "handlers should run as, then create that account with `manage.py workqueue "
                "create-system-user`.",
                id="workqueue.W001",
            )
        )
    return errors


def check_handler_modules(app_configs: list[AppConfig] | None = None, **kwargs: Any) -> list[Any]:
    """Import the apps' ``work_handlers`` modules and ``WORKQUEUE["HANDLER_MODULES"]`` as a
    host does at start: a module missing from a package that exists is misspelt, an error
    wherever it runs; one that raises while importing, or whose package is not installed, is a
    warning, since a web-only image may lack a worker's package or what its handlers import (its
    ``migrate`` must still run). An app's own module failed only at the host's start, with a
    traceback (helper-158)."""
    from workqueue.conf import get_settings
    from workqueue.runtime.handlers import app_handler_modules, handler_module_problems

    try:
        modules = get_settings(ignore_unknown=True).HANDLER_MODULES
    except WorkQueueConfigurationError:
        modules = ()  # reported by check_settings
    if not isinstance(modules, tuple) or not all(isinstance(m, str) for m in modules):
        modules = ()  # not a list of paths: check_settings says what it takes (E008)
    modules = (*app_handler_modules(), *modules)
    return [
        checks.Error(
            problem.text,
            hint="Fix the dotted path in WORKQUEUE['HANDLER_MODULES'] (or "
            "WORKQUEUE_HANDLER_MODULES): hosts refuse to start with it.",
            id="workqueue.E009",
        )
        if problem.missing
        else checks.Warning(
            problem.text,
            hint="Hosts refuse to start until it imports. Where no host runs (a web-only "
            "image without the handlers' libraries or secrets), silence it with "
            "SILENCED_SYSTEM_CHECKS = ['workqueue.W010'].",
            id="workqueue.W010",
        )
        for problem in handler_module_problems(modules)
    ]


def check_topology_declaration(
    app_configs: list[AppConfig] | None = None, **kwargs: Any
) -> list[Any]:
    """The shape of ``WORKQUEUE["TOPOLOGY"]`` (its sections, rows and field names), read as
    ``sync-topology`` reads it, without the database; its values are the models' rules, which
    ``sync-topology`` and the database check W006 apply."""
    from workqueue.conf import get_settings
    from workqueue.operators.topology import declared_topology

    try:
        if get_settings().TOPOLOGY is None:
            return []
    except WorkQueueConfigurationError:
        return []  # reported by check_settings
    try:
        declared_topology()
    except WorkQueueConfigurationError as exc:
        return [
            checks.Error(
                str(exc),
                hint="Fix WORKQUEUE['TOPOLOGY'] (README: Topology field reference); "
                "`manage.py workqueue sync-topology` refuses it as it is.",
                id="workqueue.E010",
            )
        ]
    return []


def check_environment(app_configs: list[AppConfig] | None = None, **kwargs: Any) -> list[Any]:
    """A ``WORKQUEUE_*`` environment variable nothing reads: a misspelt override changes
    nothing, silently."""
    from workqueue.conf import OTHER_ENVIRONMENT_VARIABLES, unknown_environment_problems

    others = ", ".join(OTHER_ENVIRONMENT_VARIABLES)
    return [
        checks.Warning(
            problem,
            hint="Rename or unset it. Each WORKQUEUE setting is read from WORKQUEUE_<KEY> "
            f"(workqueue/conf.py lists the keys); besides those, only {others} are read.",
            id="workqueue.W011",
        )
        for problem in unknown_environment_problems()
    ]


def _scheduler_interval_warnings(schedules: list[Any], interval_ms: int) -> list[Any]:
    """A schedule whose slots come no further apart than the scheduler's passes: a slot is
    publishable only until the next one, so passes as far apart skip slots for good (audit
    helper-130: a 90 s interval published 8 of 12 minutely slots, and nothing said so)."""
    if isinstance(interval_ms, bool) or not isinstance(interval_ms, int) or interval_ms <= 0:
        return []  # no scheduler runs, or a value the settings' own check reports (E008)
    from workqueue.scheduling import CronSearchError

    interval = dt.timedelta(milliseconds=interval_ms)
    now = timezone.now()
    warnings = []
    for schedule in schedules:
        try:
            gap = schedule.shortest_gap(now)
        except CronSearchError as exc:
            warnings.append(
                checks.Warning(
                    f"Schedule {schedule.name!r}: {exc}",
                    hint="Until then its passes log this error and publish nothing for it.",
                    id="workqueue.W009",
                )
            )
            continue
        # A gap of exactly one interval skips slots too: each pass starts an interval after
        # the last one ended, so passes drift later by their own length (review helper-201).
        if gap <= interval:
            warnings.append(
                checks.Warning(
                    f"WORKQUEUE['SCHEDULER_INTERVAL_MS'] is {interval_ms} ms, but schedule "
                    f"{schedule.name!r} ({schedule.cron}) has slots {gap.total_seconds():g} s "
                    "apart: a slot is publishable only until the next one, so a pass that "
                    "comes later skips it for good.",
                    hint="Lower SCHEDULER_INTERVAL_MS below the schedule's shortest gap (the "
                    "default, 10000, suits any cron), or space the schedule's slots further.",
                    id="workqueue.W009",
                )
            )
    return warnings


def _routing_errors(alias: str) -> list[Any]:
    """The ORM must read and write the app's models where the procedures keep them: the admin,
    the operators and the Tasks API's results use the ORM, the procedures DATABASE_ALIAS."""
    from django.db import router

    from workqueue.models import Delivery, Subscription, TaskResult

    elsewhere = sorted(
        {
            f"{model.__name__} ({how} {found!r})"
            for model in (Subscription, Delivery, TaskResult)
            for how, found in (
                ("read from", router.db_for_read(model)),
                ("written to", router.db_for_write(model)),
            )
            if found != alias
        }
    )
    if not elsewhere:
        return []
    return [
        checks.Error(
            f"WORKQUEUE['DATABASE_ALIAS'] is {alias!r}, but Django's database routing sends "
            f"the work queue's models elsewhere: {', '.join(elsewhere)}. The admin, the "
            "operator commands and Tasks API results would use another database than the "
            "queue's procedures.",
            hint=f"Add a router to DATABASE_ROUTERS that sends app label 'workqueue' to "
            f"{alias!r} (db_for_read, db_for_write, allow_migrate), or keep the queue on "
            "'default'.",
            id="workqueue.E006",
        )
    ]


def check_system_user(
    app_configs: list[AppConfig] | None = None,
    databases: list[str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Database check (``manage.py check --database default``, and ``migrate``): the
    configured SYSTEM_USER exists, and is not a superuser."""
    from django.core import mail

    from workqueue.conf import get_settings
    from workqueue.system_user import CREATE_COMMAND, find_system_user, unknown_user_problem

    # Django's test runner runs database checks against the new test database, where no user
    # exists until a test creates one; setup_test_environment() is what adds mail.outbox.
    if not databases or hasattr(mail, "outbox"):
        return []
    try:
        conf = get_settings()
    except WorkQueueConfigurationError:
        return []  # reported by check_settings
    if not conf.SYSTEM_USER.strip():
        return []  # reported by check_settings (W001)
    try:
        user = find_system_user(conf)
    except DatabaseError:
        # The user table is not there yet: `migrate` runs this check before it creates it.
        return []
    if user is None:
        return [
            # A Warning, not an Error: `migrate` runs database checks too, and a deployment
            # that runs no host (web processes only) needs no system user. Hosts refuse to start
            # without it, with the same advice.
            checks.Warning(
                unknown_user_problem(conf.SYSTEM_USER.strip()),
                hint=f"Run `{CREATE_COMMAND}`: it creates the account with an unusable "
                "password and no admin rights.",
                id="workqueue.W003",
            )
        ]
    if user.is_superuser:
        return [
            checks.Warning(
                f"WORKQUEUE['SYSTEM_USER'] {conf.SYSTEM_USER.strip()!r} is a superuser, so "
                "every handler runs with every permission, for whoever can publish.",
                hint="Point SYSTEM_USER at an account that holds only what the handlers need; "
                f"`{CREATE_COMMAND}` creates one.",
                id="workqueue.W002",
            )
        ]
    return []


def check_handler_keys(
    app_configs: list[AppConfig] | None = None,
    databases: list[str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Database check: a Worker subscription whose handler key no handler of this project
    registers, but one nearly does, is named with the key it likely meant. A key unlike every
    registered one may be served by hosts of another codebase: validate-bindings judges those
    against the live hosts."""
    from workqueue.conf import get_settings
    from workqueue.models import Subscription
    from workqueue.runtime.handlers import autodiscover, handler_registry
    from workqueue.types import HostType, SubscriptionStatus

    if not _checks_the_queue_database(databases):
        return []
    conf = get_settings()
    try:
        autodiscover(conf.HANDLER_MODULES)
    except Exception:
        # A web-only image may lack what a worker's handlers import (a library, an API key in
        # the environment): that is for the hosts to report, not a reason to fail `migrate`.
        return []
    try:
        subscriptions = list(
            Subscription.objects.using(conf.DATABASE_ALIAS)
            .filter(host_type=HostType.WORKER)
            .exclude(status=SubscriptionStatus.DISABLED)
            .values_list("name", "handler_key")
        )
    except DatabaseError:
        return []  # `migrate` runs database checks before it creates the tables
    warnings = []
    for name, key in subscriptions:
        near = handler_registry.near(key) if handler_registry.get(key) is None else []
        if near:
            warnings.append(
                checks.Warning(
                    f"Subscription {name!r} runs handler key {key!r}, which no handler of "
                    f"this project registers; did you mean {' or '.join(map(repr, near))}?",
                    hint="Fix the subscription's handler_key (admin or sync-topology), or "
                    "register a handler under that key (@register_handler).",
                    id="workqueue.W004",
                )
            )
    return warnings


def check_topology_drift(
    app_configs: list[AppConfig] | None = None,
    databases: list[str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Database check: the topology ``WORKQUEUE["TOPOLOGY"]`` declares is not the one the
    database holds (a deploy that skipped ``sync-topology``: hosts run the old one)."""
    from django.core import mail

    from workqueue.operators.topology import topology_drift_warning

    # Django's test runner checks the new test database, which no sync has run on (see
    # check_system_user).
    if not _checks_the_queue_database(databases) or hasattr(mail, "outbox"):
        return []
    if check_topology_declaration():
        return []  # a declaration of the wrong shape: E010 says so
    warning = topology_drift_warning()
    if warning is None:
        return []
    return [
        checks.Warning(
            warning,
            hint="`manage.py workqueue sync-topology --dry-run` prints every difference.",
            id="workqueue.W006",
        )
    ]


def check_task_queue_drift(
    app_configs: list[AppConfig] | None = None,
    databases: list[str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Database check: a Tasks API queue's subscription differs from its backend's
    ``OPTIONS['SUBSCRIPTION']`` (changed after the queue was made, which changes nothing)."""
    from django.core import mail

    from workqueue.tasks import WorkQueueBackend, api

    # Django's test runner checks the new test database, which holds no queue yet.
    if not _checks_the_queue_database(databases) or hasattr(mail, "outbox"):
        return []
    return [
        warning
        for backend in api.task_backends.all()
        if isinstance(backend, WorkQueueBackend)
        for warning in backend.subscription_option_drift()
    ]


def _checks_the_queue_database(databases: list[str] | None) -> bool:
    """Whether a database check was asked of the queue's alias (and the settings, which
    check_settings reports on, can be read)."""
    from workqueue.conf import get_settings

    if not databases:
        return False
    try:
        return get_settings().DATABASE_ALIAS in databases
    except WorkQueueConfigurationError:
        return False  # reported by check_settings
