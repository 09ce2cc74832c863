from __future__ import annotations

from workqueue.checks import _routing_errors, check_settings


def test_unknown_setting_is_reported_with_the_known_names(settings):
    settings.WORKQUEUE = {"SYSTEM_USER": "x", "IDLE_POLL_MN_MS": 5}
    [error] = check_settings()
    assert error.id == "workqueue.E001"
    assert "IDLE_POLL_MN_MS" in error.msg and "IDLE_POLL_MIN_MS" in error.msg


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
    settings.WORKQUEUE = {"SYSTEM_USER": "x", "DATABASE_ALIAS": "queue"}
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
