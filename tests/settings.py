"""The test suite's settings: the project's own (project/settings.py), loaded after the suite's
environment is set, since those settings read it at import and fail closed without it."""

from __future__ import annotations

from tests.support.environment import prepare

prepare()

from project.settings import *  # noqa: E402, F403
