from __future__ import annotations

import pytest

from workqueue.checks import _routing_errors, check_settings


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
