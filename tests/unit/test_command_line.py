"""How `manage.py workqueue VERB ...` reads its command line."""

from __future__ import annotations

import pytest
from django.core.management import CommandError

from workqueue.management.commands.workqueue import Command


def parse(*argv: str) -> dict:
    return vars(Command().create_parser("manage.py", "workqueue").parse_args(argv))


def test_djangos_own_options_are_taken_after_the_verb_too():
    """`workqueue stats --traceback` and `workqueue publish ... --settings X` stopped with
    "unrecognized arguments": only the options before the verb were read."""
    after = parse("stats", "--traceback", "-v", "2", "--settings", "shop.settings", "--no-color")
    before = parse("--traceback", "-v", "2", "--settings", "shop.settings", "--no-color", "stats")

    for options in (after, before):
        assert (options["verb"], options["traceback"], options["verbosity"]) == ("stats", True, 2)
        assert (options["settings"], options["no_color"]) == ("shop.settings", True)


def test_an_option_given_only_before_the_verb_is_not_reset_by_the_verb():
    options = parse("-v", "3", "stats")
    assert options["verbosity"] == 3 and options["traceback"] is False


def test_an_unknown_option_is_still_refused():
    with pytest.raises(CommandError, match="--tracebak"):
        Command().create_parser("manage.py", "workqueue").parse_args(["stats", "--tracebak"])
