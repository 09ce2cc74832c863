"""``manage.py workqueue VERB``: operator and database verbs (see workqueue.cli)."""

from __future__ import annotations

import argparse
import copy
from typing import Any

from django.core.management.base import CommandError, CommandParser

from workqueue.cli import all_verbs
from workqueue.input_limits import text_problem
from workqueue.management.base import QueueCommand
from workqueue.runtime.process import database_errors_explained


class Command(QueueCommand):
    help = "Work-queue operations: run `manage.py workqueue VERB --help` for each verb."

    def add_arguments(self, parser: CommandParser) -> None:
        self._verbs = {verb.name: verb for verb in all_verbs()}
        # How each verb's arguments are spelt on the command line, by their option names.
        self._spellings: dict[str, dict[str, str]] = {}
        # Django's own options (--settings, --traceback, -v, ...), added before this runs, are
        # read after the verb too: with no default there, so one given before it stands.
        django_options = [
            copy.copy(action)
            for action in parser._actions
            if action.option_strings and action.dest not in ("help", "version")
        ]
        for action in django_options:
            action.default = argparse.SUPPRESS
        subparsers = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
        for verb in self._verbs.values():
            sub = subparsers.add_parser(verb.name, help=verb.help, description=verb.help)
            for action in django_options:
                sub._add_action(action)
            sub.add_argument("--json", action="store_true", help="Print JSON for machines.")
            verb.add_arguments(sub)
            self._spellings[verb.name] = {
                action.dest: action.option_strings[-1] if action.option_strings else action.dest
                for action in sub._actions
            }

    def handle(self, *args: Any, **options: Any) -> None:
        self._refuse_unstorable_text(options)
        # Django's own reads (topology, API keys, host records) failing: one line saying so.
        with database_errors_explained():
            self._verbs[options["verb"]].run(self, options)

    def _refuse_unstorable_text(self, options: dict[str, Any]) -> None:
        """Refuse text no verb could give the database, before any verb runs: a NUL character,
        or a lone surrogate, which is what Python makes of command-line bytes that are not
        UTF-8 (e.g. a Latin-1 terminal)."""
        spellings = self._spellings[options["verb"]]
        for dest, value in options.items():
            for text in value if isinstance(value, list) else [value]:
                if isinstance(text, str) and (problem := text_problem(text)) is not None:
                    raise CommandError(f"{spellings.get(dest, dest)} {problem}.")
