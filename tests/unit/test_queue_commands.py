"""Every management command the queue's packages ship is a QueueCommand, whose system checks
read no database: from Django 6.1 on, a plain BaseCommand's checks connect to every alias (a
SQL Server's JSONField check asks the server its version), before the command can retry or
explain a database that is down (review helpers 203, 204)."""

from __future__ import annotations

from django.core.management import get_commands, load_command_class

from workqueue.management.base import QueueCommand


def test_every_command_of_the_queues_packages_checks_no_database():
    ours = {name: app for name, app in get_commands().items() if app.startswith("workqueue")}

    assert set(ours) >= {"workqueue", "workqueue_host", "workqueue_work", "workqueue_sweep"}
    for name, app in ours.items():
        command = load_command_class(app, name)
        assert isinstance(command, QueueCommand), name
        assert command.get_check_kwargs({})["databases"] == [], name
