"""``conf.setting`` (one setting, read on per-call paths such as publishing) must give what
``get_settings()`` gives for that key, however the value is set."""

from __future__ import annotations

from dataclasses import fields

import pytest

from workqueue.conf import WorkQueueSettings, get_settings, setting

KEYS = [f.name for f in fields(WorkQueueSettings)]


def agree() -> None:
    whole = get_settings()
    for key in KEYS:
        assert setting(key) == getattr(whole, key), key


def test_defaults_agree(settings):
    settings.WORKQUEUE = {}
    agree()


def test_configured_values_agree(settings):
    settings.WORKQUEUE = {
        "SYSTEM_USER": "robot",
        "DATABASE_ALIAS": "queue",
        "SUBSCRIPTIONS": [{"name": "orders", "concurrency": 2}],
        "HANDLER_MODULES": ["a.b"],
        "PUBLISH_MAX_BATCH": 7,
    }
    agree()
    assert setting("SYSTEM_USER") == "robot"
    assert setting("SUBSCRIPTIONS") == ({"name": "orders", "concurrency": 2},)


@pytest.mark.parametrize(
    ("key", "raw", "expected"),
    [
        ("SYSTEM_USER", "from-env", "from-env"),
        ("DATABASE_ALIAS", "other", "other"),
        ("PUBLISH_MAX_BATCH", "12", 12),
        ("SWEEPER_ENABLED", "off", False),
        ("SUBSCRIPTIONS", '[{"name": "*", "concurrency": 3}]', ({"name": "*", "concurrency": 3},)),
        ("HANDLER_MODULES", "a.b, c.d", ("a.b", "c.d")),
        # JSON, as SUBSCRIPTIONS takes: it was read as one module named '["a.b"' (helper-158).
        ("HANDLER_MODULES", '["a.b", "c.d"]', ("a.b", "c.d")),
    ],
)
def test_environment_overrides_win_and_agree(settings, monkeypatch, key, raw, expected):
    # Configured too, where the key allows it: the environment wins over settings.WORKQUEUE.
    settings.WORKQUEUE = {"SYSTEM_USER": "configured-user", "PUBLISH_MAX_BATCH": 99}
    monkeypatch.setenv(f"WORKQUEUE_{key}", raw)
    assert setting(key) == expected
    agree()
