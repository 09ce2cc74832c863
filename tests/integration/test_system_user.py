"""The system user: ``manage.py check --database`` reports a missing one with the command that
creates it, never advising a superuser, and ``manage.py workqueue create-system-user`` creates
it without a usable password or admin rights. (A fresh project runs the same steps in
``tests/processes/test_packaging.py``.)"""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.core import mail
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from workqueue.checks import check_handler_keys, check_system_user
from workqueue.exceptions import WorkQueueConfigurationError
from workqueue.system_user import resolve_system_user

pytestmark = pytest.mark.django_db


@pytest.fixture
def outside_the_test_environment(monkeypatch, settings):
    """Database checks as `manage.py check --database default` runs them: Django's test
    environment (marked by mail.outbox) skips this check, since a new test database never
    holds the user."""
    monkeypatch.delattr(mail, "outbox")
    settings.WORKQUEUE = {"SYSTEM_USER": "robot"}


def test_check_database_reports_an_unknown_system_user_with_the_command_that_creates_it(
    outside_the_test_environment,
):
    with pytest.raises(SystemCheckError) as raised:
        call_command("check", "--database", "default", "--fail-level", "WARNING")
    report = str(raised.value)
    assert "workqueue.W003" in report
    assert "WORKQUEUE['SYSTEM_USER'] is 'robot'" in report
    assert "manage.py workqueue create-system-user" in report
    assert "superuser" not in report.lower()
    # A database check: the plain `manage.py check` does not query the database.
    call_command("check")


def test_the_host_refuses_to_start_with_the_same_advice(settings):
    settings.WORKQUEUE = {"SYSTEM_USER": "robot"}
    with pytest.raises(WorkQueueConfigurationError) as raised:
        resolve_system_user()
    assert "manage.py workqueue create-system-user" in str(raised.value)
    assert "superuser" not in str(raised.value).lower()


def test_create_system_user_makes_an_account_without_password_or_admin_rights_once(
    outside_the_test_environment,
):
    out = StringIO()
    call_command("workqueue", "create-system-user", stdout=out)
    assert "Created the system user 'robot'" in out.getvalue()
    user = get_user_model().objects.get(username="robot")
    assert not user.has_usable_password()
    assert not user.is_staff and not user.is_superuser and user.is_active

    out = StringIO()
    call_command("workqueue", "create-system-user", "--json", stdout=out)
    assert json.loads(out.getvalue()) == {"username": "robot", "created": False}
    assert get_user_model().objects.filter(username="robot").count() == 1
    call_command("check", "--database", "default")
    assert resolve_system_user() == user


def test_create_system_user_is_quiet_at_verbosity_0(outside_the_test_environment):
    """Review helper-175: the README's test fixtures call it with verbosity=0, and its line
    was printed in every test that did, where sync-topology stays quiet."""
    out = StringIO()
    call_command("workqueue", "create-system-user", verbosity=0, stdout=out)
    assert out.getvalue() == ""
    assert get_user_model().objects.filter(username="robot").exists()


def test_a_superuser_as_system_user_is_a_warning(outside_the_test_environment):
    get_user_model().objects.create_superuser("robot", "robot@example.com", "pw")
    [warning] = check_system_user(databases=["default"])
    assert warning.id == "workqueue.W002" and "superuser" in warning.msg


def test_an_unset_system_user_names_the_setting_and_the_command(settings):
    settings.WORKQUEUE = {}
    with pytest.raises(Exception, match="create-system-user"):
        call_command("workqueue", "create-system-user")


def test_the_check_is_silent_in_the_test_environment(settings):
    settings.WORKQUEUE = {"SYSTEM_USER": "robot"}
    assert check_system_user(databases=["default"]) == []


def test_check_database_names_the_handler_key_a_misspelt_one_meant(settings):
    """A typo in a subscription's handler key (`billing.invoce`) passed `check` and
    `sync-topology`, and surfaced only on a host as HandlerNotRegistered; validate-bindings
    warned about it and about correct keys alike when no host was live."""
    from tests.factories import SubscriptionFactory
    from workqueue.runtime.handlers import handler_registry

    registered = handler_registry.keys()[0]  # the samples' or the Tasks API's, as installed
    misspelt = registered[:-1] + ("x" if registered[-1] != "x" else "y")
    SubscriptionFactory(name="shop.typo", handler_key=misspelt)
    SubscriptionFactory(name="shop.elsewhere", handler_key="served.by-another-codebase")

    [warning] = check_handler_keys(databases=["default"])

    assert warning.id == "workqueue.W004"
    assert f"'shop.typo' runs handler key '{misspelt}'" in warning.msg
    assert f"did you mean '{registered}'" in warning.msg
    assert check_handler_keys(databases=None) == []  # the plain check reads no database


def test_the_handler_key_check_leaves_handler_modules_that_fail_to_import_to_the_hosts(settings):
    """W004 imports the project's handlers to compare keys: one that raised at import (a
    worker's library or secret missing from a web-only image) made every database check, and
    so `migrate`, fail."""
    settings.WORKQUEUE = {
        **settings.WORKQUEUE,
        "HANDLER_MODULES": ["tests.support.handlers_needing_a_secret"],
    }

    assert check_handler_keys(databases=["default"]) == []
    assert check_handler_keys(databases=["other"]) == []  # not the queue's database
