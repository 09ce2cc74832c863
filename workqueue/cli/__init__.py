"""The verbs of ``manage.py workqueue``: each a small class that declares its arguments and calls
the library (operators, publishing, the driver's install helpers). The management command only
dispatches."""

from __future__ import annotations

import argparse
from typing import Any, ClassVar

from django.core.management.base import BaseCommand


class Verb:
    """One ``manage.py workqueue <name>`` action."""

    name: ClassVar[str]
    help: ClassVar[str]

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Declare this verb's own arguments (``--json`` is added for every verb)."""

    def run(self, command: BaseCommand, options: dict[str, Any]) -> None:
        raise NotImplementedError


def all_verbs() -> list[Verb]:
    from workqueue.cli.accounts import ACCOUNT_VERBS
    from workqueue.cli.database import DATABASE_VERBS
    from workqueue.cli.operators import OPERATOR_VERBS
    from workqueue.cli.publishing import PUBLISHING_VERBS
    from workqueue.cli.recovery import RECOVERY_VERBS
    from workqueue.cli.topology import TOPOLOGY_VERBS

    verbs = [
        *PUBLISHING_VERBS,
        *OPERATOR_VERBS,
        *RECOVERY_VERBS,
        *TOPOLOGY_VERBS,
        *ACCOUNT_VERBS,
        *DATABASE_VERBS,
    ]
    return [cls() for cls in verbs]
