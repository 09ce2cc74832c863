"""The test suite's settings: the project's own (project/settings.py), loaded after the suite's
environment is set, since those settings read it at import and fail closed without it."""

from __future__ import annotations

from tests.support.environment import prepare

prepare()

from project.settings import *  # noqa: E402, F403
from tests.support.routers import QUEUE_ALIAS  # noqa: E402

# A second alias on the test database (a mirror of default), for the tests of a project that
# keeps the work queue on an alias of its own (tests.support.routers): nothing touches it
# unless a test names it in its databases.
DATABASES[QUEUE_ALIAS] = {**DATABASES["default"], "TEST": {"MIRROR": "default"}}  # noqa: F405
