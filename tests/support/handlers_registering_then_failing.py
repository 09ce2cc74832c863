"""A handler module that registers a handler, then fails (a secret read after the classes are
defined): `manage.py check` imports it before a host's start imports it again."""

from __future__ import annotations

from workqueue.runtime.context import WorkContext, WorkMessage
from workqueue.runtime.handlers import BaseWorkHandler, register_handler
from workqueue.runtime.outcome import Outcome


@register_handler("tests.registered-then-failing")
class RegisteredThenFailing(BaseWorkHandler):
    def handle(self, message: WorkMessage, context: WorkContext) -> Outcome:
        return Outcome.complete()


raise RuntimeError("needs SOME_API_KEY in the environment")
