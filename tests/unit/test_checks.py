from __future__ import annotations

import pytest

from workqueue.checks import _routing_errors, check_settings
from workqueue.exceptions import WorkQueueConfigurationError


def test_unknown_setting_is_reported_with_the_known_names(settings):
    settings.WORKQUEUE = {"SYSTEM_USER": "x", "IDLE_POLL_MN_MS": 5}
    [error] = check_settings()
    assert error.id == "workqueue.E001"
    assert "IDLE_POLL_MN_MS" in error.msg and "IDLE_POLL_MIN_MS" in error.msg


def test_an_unknown_setting_names_the_one_it_resembles_and_the_others_problems_too(settings):
    """Reported alone, it hid every other problem until fixed (a misspelt concurrency of a
    SUBSCRIPTIONS entry next), and left the reader to find the name it meant in the list."""
    settings.WORKQUEUE = {
        "SYSTEM_USER": "x",
        "SHUTDOWN_DRAIN": 1000,
        "SUBSCRIPTIONS": [{"name": "orders", "concurency": 4}],
    }

    unknown, entry = check_settings()

    assert unknown.id == "workqueue.E001"
    assert "SHUTDOWN_DRAIN (did you mean SHUTDOWN_DRAIN_MS?)" in unknown.msg
    assert entry.id == "workqueue.E008" and "'concurency'" in entry.msg


def test_bad_environment_override_names_the_variable(settings, monkeypatch):
    settings.WORKQUEUE = {"SYSTEM_USER": "x"}
    monkeypatch.setenv("WORKQUEUE_IDLE_POLL_MAX_MS", "soon")
    [error] = check_settings()
    assert "WORKQUEUE_IDLE_POLL_MAX_MS" in error.msg


def test_missing_system_user_is_a_warning_naming_the_setting(settings):
    settings.WORKQUEUE = {}
    [warning] = check_settings()
    assert warning.id == "workqueue.W001" and "SYSTEM_USER" in warning.hint


def test_unknown_database_alias_is_an_error(settings):
    settings.WORKQUEUE = {"SYSTEM_USER": "x", "DATABASE_ALIAS": "nowhere"}
    [error] = check_settings()
    assert error.id == "workqueue.E002"


def test_a_correct_configuration_passes(settings):
    settings.WORKQUEUE = {"SYSTEM_USER": "x"}
    assert check_settings() == []


class _QueueRouter:
    """Sends the work queue's models to the 'queue' alias."""

    def db_for_read(self, model, **hints):
        return "queue" if model._meta.app_label == "workqueue" else None

    db_for_write = db_for_read


def test_a_queue_alias_the_orm_does_not_route_to_is_an_error_naming_the_router_fix(settings):
    """The operators, the admin and Tasks API results read and wrote 'default' while the
    procedures ran on the queue's alias: a task's return value was not committed with its
    completion, and results were read from the wrong database."""
    # (check_settings reports an alias missing from DATABASES first, as E002.)
    [error] = _routing_errors("queue")
    assert error.id == "workqueue.E006"
    assert "Delivery (read from 'default')" in error.msg and "DATABASE_ROUTERS" in error.hint

    settings.DATABASE_ROUTERS = [f"{__name__}._QueueRouter"]
    assert _routing_errors("queue") == []
    assert [e.id for e in _routing_errors("default")] == ["workqueue.E006"]


@pytest.mark.parametrize(
    ("subscriptions", "named"),
    [
        # A misspelt key ran the subscription at concurrency 1 without a word.
        ([{"name": "orders", "concurency": 8}], "'concurency'"),
        ([{"name": "orders", "concurrency": 5000}], "concurrency 5000"),
        ([{"name": "orders", "concurrency": "eight"}], "concurrency 'eight'"),
        ([{"name": "orders", "concurrency": True}], "concurrency True"),
        ([{"name": "orders", "prefetch": -1}], "prefetch -1"),
        ([{"name": "orders", "prefetch": 50_000}], "prefetch 50,000"),
        (["orders"], "'orders'"),
        ([{"concurrency": 4}], "no name"),
        ([{"name": " ", "concurrency": 4}], "no name"),
        ([{"name": "orders"}, {"name": "Orders ", "concurrency": 2}], "'Orders '"),
        ({"name": "*"}, "a list"),
    ],
)
def test_a_subscriptions_entry_a_host_would_misread_is_an_error_naming_it(
    settings, subscriptions, named
):
    """Hosts read these entries leniently (a misspelt key is ignored, 0 becomes 1, a bad
    value raised half way through starting): `check` names the entry and the fix."""
    settings.WORKQUEUE = {"SYSTEM_USER": "x", "SUBSCRIPTIONS": subscriptions}
    [error] = check_settings()
    assert error.id == "workqueue.E008"
    assert "WORKQUEUE['SUBSCRIPTIONS']" in error.msg and named in error.msg, error.msg
    assert error.hint


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"IDLE_POLL_MIN_MS": 0}, "IDLE_POLL_MIN_MS"),  # a busy claim loop
        ({"SCHEDULER_INTERVAL_MS": "10s"}, "SCHEDULER_INTERVAL_MS"),
        ({"PUBLISH_MAX_BATCH": 0}, "PUBLISH_MAX_BATCH"),
        ({"PUBLISH_BODY_LIMIT_BYTES": 0}, "PUBLISH_BODY_LIMIT_BYTES"),
        ({"METRICS_COUNT_CAP": 2_000_000}, "METRICS_COUNT_CAP"),
        ({"DEAD_ROWS_WARNING": 0}, "DEAD_ROWS_WARNING"),
        ({"VACUUM_HORIZON_WARNING_SECONDS": 0}, "VACUUM_HORIZON_WARNING_SECONDS"),
        ({"HOST_RECORD_RETENTION_DAYS": 0}, "HOST_RECORD_RETENTION_DAYS"),
        ({"HANDLER_RUN_WARNING_SECONDS": 0}, "HANDLER_RUN_WARNING_SECONDS"),
        ({"SWEEPER_ENABLED": "no"}, "SWEEPER_ENABLED"),
    ],
)
def test_a_number_setting_out_of_its_range_is_an_error_naming_the_range(settings, overrides, named):
    settings.WORKQUEUE = {"SYSTEM_USER": "x", **overrides}
    [error] = check_settings()
    assert error.id == "workqueue.E008"
    assert f"WORKQUEUE['{named}']" in error.msg, error.msg


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        # Values hosts have always read leniently: a warning, since an error stops every
        # command (migrate included) on upgrade.
        ({"SUBSCRIPTIONS": [{"name": "orders", "concurrency": 0}]}, "hosts run it at 1"),
        ({"IDLE_POLL_MIN_MS": 900, "IDLE_POLL_MAX_MS": 300}, "poll every 300 ms"),
        ({"SWEEPER_INTERVAL_MS": 0}, "workqueue_sweep"),
        ({"SHUTDOWN_DRAIN_MS": -1}, "read it as 0"),
        ({"RECONCILE_INTERVAL_MS": -5}, "read it as 0"),
    ],
)
def test_a_value_hosts_read_leniently_is_a_warning_saying_how_they_read_it(
    settings, overrides, named
):
    settings.WORKQUEUE = {"SYSTEM_USER": "x", **overrides}
    [warning] = check_settings()
    assert warning.id == "workqueue.W005"
    assert named in warning.msg, warning.msg


def test_a_concurrency_given_as_text_is_read_as_hosts_read_it(settings):
    """Hosts take int() of it: "4" from an environment variable has always run 4."""
    settings.WORKQUEUE = {"SYSTEM_USER": "x", "SUBSCRIPTIONS": [{"name": "*", "concurrency": "4"}]}
    assert check_settings() == []


def test_the_documented_subscriptions_shapes_pass(settings):
    settings.WORKQUEUE = {
        "SYSTEM_USER": "x",
        "SUBSCRIPTIONS": [
            {"name": "*", "concurrency": 4},
            {"name": "orders", "concurrency": 1000, "prefetch": 0},
            {"name": "emails"},
        ],
        "SWEEPER_ENABLED": False,
        "SWEEPER_INTERVAL_MS": 0,
        "RECONCILE_INTERVAL_MS": 0,
        "SCHEDULER_INTERVAL_MS": 0,
        "SHUTDOWN_DRAIN_MS": 0,
        "PUBLISH_BODY_LIMIT_BYTES": None,
    }
    assert check_settings() == []


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"HANDLER_MODULES": "myapp.jobs"}, "WORKQUEUE['HANDLER_MODULES'] is 'myapp.jobs'"),
        ({"SCHEDULES": {"name": "nightly"}}, "WORKQUEUE['SCHEDULES']"),
    ],
)
def test_a_single_value_where_a_list_belongs_is_named_not_read_as_its_letters(
    settings, overrides, named
):
    """A module path given as a string was read as a tuple of its letters (each one then
    failed to import)."""
    settings.WORKQUEUE = {"SYSTEM_USER": "x", **overrides}
    [error] = check_settings()
    assert named in error.msg, error.msg


# -- what plain `manage.py check` finds without a database (newcomer review, helper-139) -------


def test_check_names_a_handler_module_that_does_not_exist(settings):
    """A misspelt HANDLER_MODULES entry passed `manage.py check` and failed only at host start."""
    from workqueue.checks import check_handler_modules

    settings.WORKQUEUE = {
        "SYSTEM_USER": "x",
        "HANDLER_MODULES": ["tests.support.handlers", "tests.support.handlerz"],
    }

    [error] = check_handler_modules()

    assert error.id == "workqueue.E009"
    assert "'tests.support.handlerz'" in error.msg and "No module named" in error.msg
    assert "HANDLER_MODULES" in error.hint


def test_check_warns_of_a_handler_module_that_raises_on_import_naming_the_exception(settings):
    """Found but failing inside (a worker's library or secret missing from a web-only image):
    a warning, so that such an image's `migrate` still runs; hosts refuse to start with it."""
    from workqueue.checks import check_handler_modules

    settings.WORKQUEUE = {
        "SYSTEM_USER": "x",
        "HANDLER_MODULES": ["tests.support.handlers_needing_a_secret"],
    }

    [warning] = check_handler_modules()

    assert warning.id == "workqueue.W010"
    assert "'tests.support.handlers_needing_a_secret'" in warning.msg
    assert "RuntimeError: needs SOME_API_KEY in the environment" in warning.msg


def test_a_handler_package_not_installed_here_is_a_warning_not_an_error(settings):
    """Review helper-144: a web-only image without the worker's package answered E009, an
    error, which stops `migrate` there; a module missing inside a package that is installed
    is the misspelling E009 names."""
    from workqueue.checks import check_handler_modules

    settings.WORKQUEUE = {"SYSTEM_USER": "x", "HANDLER_MODULES": ["shop_worker.handlers"]}

    [warning] = check_handler_modules()

    assert warning.id == "workqueue.W010"
    assert "No module named 'shop_worker'" in warning.msg
    assert "SILENCED_SYSTEM_CHECKS" in warning.hint


def test_a_host_started_after_the_check_names_the_modules_own_error(settings):
    """Review helper-144: the check's import of a module that registered a handler and then
    raised left the registration behind, and the host's start (which runs the checks first)
    then said the key was "registered twice" instead of what the module raised."""
    from workqueue.checks import check_handler_modules
    from workqueue.runtime.handlers import autodiscover, handler_registry

    module = "tests.support.handlers_registering_then_failing"
    settings.WORKQUEUE = {"SYSTEM_USER": "x", "HANDLER_MODULES": [module]}
    try:
        [warning] = check_handler_modules()
        assert warning.id == "workqueue.W010"
        with pytest.raises(RuntimeError, match="needs SOME_API_KEY"):
            autodiscover((module,))
    finally:
        handler_registry._handlers.pop("tests.registered-then-failing", None)


def test_check_of_handler_modules_leaves_a_malformed_setting_to_the_settings_check(settings):
    from workqueue.checks import check_handler_modules

    settings.WORKQUEUE = {"SYSTEM_USER": "x", "HANDLER_MODULES": "myapp.jobs"}
    assert check_handler_modules() == []  # E008 says it takes a list


@pytest.mark.parametrize(
    ("topology", "named"),
    [
        (
            {
                "topics": {"hello": {}},
                "subscriptions": {"hello-greet": {"topic": "hello", "handler": "x"}},
            },
            'WORKQUEUE["TOPOLOGY"]["subscriptions"]["hello-greet"] has unknown field(s) '
            "handler (did you mean handler_key?)",
        ),
        (
            {"topics": {}, "subscriptions": {"hello-greet": {"handler_key": "x"}}},
            'WORKQUEUE["TOPOLOGY"]["subscriptions"]["hello-greet"] needs topic',
        ),
        ({"topic": {}}, 'WORKQUEUE["TOPOLOGY"] must be a dict with the keys "topics"'),
        ("tests.support.nowhere.TOPOLOGY", "cannot be imported"),
    ],
)
def test_check_names_the_topology_entry_and_field_sync_topology_would_refuse(
    settings, topology, named
):
    """A TOPOLOGY of the wrong shape passed `manage.py check` and failed only at
    `sync-topology`. Checked without a database (a unit test may not reach one)."""
    from workqueue.checks import check_topology_declaration

    settings.WORKQUEUE = {"SYSTEM_USER": "x", "TOPOLOGY": topology}

    [error] = check_topology_declaration()

    assert error.id == "workqueue.E010"
    assert named in error.msg, error.msg


def test_a_well_formed_or_absent_topology_passes_the_check(settings):
    from workqueue.checks import check_topology_declaration

    settings.WORKQUEUE = {"SYSTEM_USER": "x"}
    assert check_topology_declaration() == []
    settings.WORKQUEUE = {
        "SYSTEM_USER": "x",
        "TOPOLOGY": {
            "topics": {"hello": {}},
            "subscriptions": {"hello-greet": {"topic": "hello", "handler_key": "hello.greet"}},
        },
    }
    assert check_topology_declaration() == []


def test_an_unknown_workqueue_environment_variable_is_warned_with_the_nearest_name(
    settings, monkeypatch
):
    """WORKQUEUE_SHUTDOWN_DRAIN (the setting is SHUTDOWN_DRAIN_MS) changed nothing, silently."""
    from workqueue.checks import check_environment

    settings.WORKQUEUE = {"SYSTEM_USER": "x"}
    monkeypatch.setenv("WORKQUEUE_SHUTDOWN_DRAIN", "1000")
    monkeypatch.setenv("WORKQUEUE_NOTHING_LIKE_IT", "1")
    monkeypatch.setenv("WORKQUEUE_SHUTDOWN_DRAIN_MS", "1000")  # known: no warning

    unlike, near = check_environment()  # in the variables' order

    assert near.id == unlike.id == "workqueue.W011"
    assert "WORKQUEUE_SHUTDOWN_DRAIN " in near.msg or "WORKQUEUE_SHUTDOWN_DRAIN is" in near.msg
    assert "did you mean WORKQUEUE_SHUTDOWN_DRAIN_MS" in near.msg
    assert "WORKQUEUE['SHUTDOWN_DRAIN_MS']" in near.msg
    assert "WORKQUEUE_NOTHING_LIKE_IT" in unlike.msg and "did you mean" not in unlike.msg


def test_the_environment_variables_the_project_reads_are_all_known():
    """Every WORKQUEUE_* name the app, the sample project or the test suite's support code
    spells is one the check knows, so the check never warns of a variable that is read."""
    import re
    from pathlib import Path

    from workqueue.conf import known_environment_variables

    root = Path(__file__).resolve().parents[2]
    spelt = {
        name
        for folder in ("workqueue", "project", "workqueue_samples", "tests/support")
        for path in (root / folder).rglob("*.py")
        for name in re.findall(r"\bWORKQUEUE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())
    }
    # A name the code builds others from, and the docstrings' example of a misspelt one.
    spelt -= {"WORKQUEUE_KEY", "WORKQUEUE_SHUTDOWN_DRAIN"}

    assert spelt, "found no variable at all: the search is wrong"
    assert spelt <= known_environment_variables(), spelt - known_environment_variables()


def test_manage_py_check_reports_handler_modules_topology_and_unknown_variables(
    settings, monkeypatch
):
    """The newcomer's view: plain `manage.py check` said "no issues" for all three."""
    import io

    from django.core.management import call_command
    from django.core.management.base import SystemCheckError

    settings.WORKQUEUE = {
        "SYSTEM_USER": "x",
        "HANDLER_MODULES": ["tests.support.handlerz"],
        "TOPOLOGY": {"topics": {}, "subscriptions": {"hello-greet": {"handler": "x"}}},
    }
    monkeypatch.setenv("WORKQUEUE_SHUTDOWN_DRAIN", "1000")

    with pytest.raises(SystemCheckError) as failed:
        call_command("check", stdout=io.StringIO(), stderr=io.StringIO())

    report = str(failed.value)
    assert "workqueue.E009" in report and "'tests.support.handlerz'" in report
    assert "workqueue.E010" in report and '["hello-greet"]' in report
    assert "workqueue.W011" in report and "WORKQUEUE_SHUTDOWN_DRAIN_MS" in report


def test_two_handlers_under_one_key_are_refused_but_a_module_imported_again_is_not():
    from workqueue.exceptions import WorkQueueConfigurationError
    from workqueue.runtime.handlers import BaseWorkHandler, HandlerRegistry

    def handler_class(module: str) -> type[BaseWorkHandler]:
        return type("Greet", (BaseWorkHandler,), {"__module__": module})

    registry = HandlerRegistry()
    registry.register("greet", handler_class("shop.handlers"))
    registry.register("greet", again := handler_class("shop.handlers"))  # imported again
    with pytest.raises(WorkQueueConfigurationError, match="registered twice"):
        registry.register("greet", handler_class("billing.handlers"))
    assert registry.get("greet") is again


def test_an_apps_own_handler_module_that_cannot_import_is_named_by_check_and_host(settings):
    """An app's ``work_handlers`` (found without HANDLER_MODULES, as the README suggests)
    importing a library not installed passed ``manage.py check``, and the host then ended in
    a thirty-line traceback (helper-158)."""
    from workqueue.checks import check_handler_modules
    from workqueue.runtime.handlers import autodiscover

    settings.WORKQUEUE = {"SYSTEM_USER": "x"}
    settings.INSTALLED_APPS = [*settings.INSTALLED_APPS, "tests.support.app_with_broken_handlers"]

    [warning] = check_handler_modules()
    with pytest.raises(WorkQueueConfigurationError) as refused:
        autodiscover(())

    module = "'tests.support.app_with_broken_handlers.work_handlers'"
    assert warning.id == "workqueue.W010" and module in warning.msg
    assert "No module named 'requests_oauthlib_not_installed'" in warning.msg
    assert str(refused.value) == warning.msg
