"""Verbs about the accounts the work queue acts as."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from workqueue.cli import Verb
from workqueue.cli.output import to_json


class CreateSystemUserVerb(Verb):
    name = "create-system-user"
    help = (
        "Create the account WORKQUEUE['SYSTEM_USER'] names, which handlers run as: an unusable "
        "password, neither staff nor superuser. Does nothing when it exists."
    )

    def run(self, command: BaseCommand, options: dict[str, Any]) -> None:
        from workqueue.exceptions import WorkQueueConfigurationError
        from workqueue.system_user import create_system_user

        try:
            user, created = create_system_user()
        except WorkQueueConfigurationError as exc:
            raise CommandError(str(exc)) from exc
        username = user.get_username()
        if options["json"]:
            command.stdout.write(to_json({"username": username, "created": created}))
        elif options["verbosity"] == 0:
            pass  # a test's fixture creating it, say (as sync-topology is quiet then)
        elif created:
            command.stdout.write(
                f"Created the system user {username!r}: no usable password, not staff, not "
                "superuser. Grant it only the permissions your handlers need."
            )
        else:
            command.stdout.write(f"The system user {username!r} already exists.")
        if user.is_superuser:
            command.stderr.write(
                f"{username!r} is a superuser: every handler runs with every permission "
                "(workqueue.W002). Prefer an account with only what the handlers need."
            )


ACCOUNT_VERBS = [CreateSystemUserVerb]
