"""How `manage.py workqueue VERB ...` reads its command line."""

from __future__ import annotations

import pytest
from django.core.management import CommandError

from workqueue.management.commands.workqueue import Command
from workqueue.management.commands.workqueue_host import Command as HostCommand
from workqueue.management.commands.workqueue_work import Command as WorkCommand


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


COMMANDS = [(HostCommand, ["-s", "orders"]), (WorkCommand, ["-s", "orders", "--once"])]


@pytest.mark.parametrize(("command", "argv"), COMMANDS)
@pytest.mark.parametrize("value", ["0", "1001", "5000", "many"])
def test_a_concurrency_outside_what_a_host_runs_is_refused_as_an_argument(command, argv, value):
    """--concurrency 5000 started a host whose every subscription then sat in Error (at most
    1,000 handlers of one subscription), and the host idled on."""
    parser = command().create_parser("manage.py", "x")
    with pytest.raises(CommandError, match="--concurrency"):
        parser.parse_args([*argv, "--concurrency", value])


@pytest.mark.parametrize(("command", "argv"), COMMANDS)
def test_a_concurrency_within_bounds_is_taken(command, argv):
    parser = command().create_parser("manage.py", "x")
    assert parser.parse_args([*argv, "--concurrency", "1000"]).concurrency == 1000
