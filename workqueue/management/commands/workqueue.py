"""``manage.py workqueue VERB``: operator and database verbs (see workqueue.cli)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from workqueue.cli import all_verbs


class Command(BaseCommand):
    help = "Work-queue operations: run `manage.py workqueue VERB --help` for each verb."

    def add_arguments(self, parser: CommandParser) -> None:
        self._verbs = {verb.name: verb for verb in all_verbs()}
        subparsers = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
        for verb in self._verbs.values():
            sub = subparsers.add_parser(verb.name, help=verb.help, description=verb.help)
            sub.add_argument("--json", action="store_true", help="Print JSON for machines.")
            verb.add_arguments(sub)

    def handle(self, *args: Any, **options: Any) -> None:
        self._verbs[options["verb"]].run(self, options)
