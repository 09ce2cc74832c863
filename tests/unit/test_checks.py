from __future__ import annotations

from workqueue.checks import check_settings


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
