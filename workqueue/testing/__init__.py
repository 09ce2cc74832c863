"""Helpers for testing code that uses the work queue, and the transports it runs on.

``use_test_connection`` and ``run_until_idle`` (``workqueue.testing.inline``) let a project's
own tests publish and run handlers inside Django's ``TestCase``, ``TransactionTestCase`` or
pytest-django (README "Testing your code"). ``workqueue.testing.conformance`` holds the
transport conformance suite (cases C01-C47), which pytest runs per driver and
``manage.py workqueue conformance`` runs against any configured database. Nothing here imports
pytest.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DeliveryRun", "run_until_idle", "use_test_connection"]


def __getattr__(name: str) -> Any:
    # Lazy, so importing the conformance suite does not load the runtime it does not need.
    if name in __all__:
        from workqueue.testing import inline

        return getattr(inline, name)
    raise AttributeError(f"module 'workqueue.testing' has no attribute {name!r}")
