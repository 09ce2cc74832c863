"""Handler classes, the registry that maps handler keys to them, and their discovery."""

from __future__ import annotations

import difflib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import import_module
from typing import Any, ClassVar, TypeVar

from django.apps import apps
from django.utils.module_loading import module_has_submodule

from workqueue.exceptions import WorkQueueConfigurationError
from workqueue.runtime.context import WorkContext, WorkMessage
from workqueue.runtime.outcome import Outcome


class BaseWorkHandler:
    """Subclass, implement ``handle``, and register under a key with ``@register_handler``.

    A fresh instance handles each delivery, bound to the host's system user (``self.user``),
    never to the publisher: anyone allowed to publish can make this code run, so check
    authorisation inside the handler where it matters.
    """

    #: Set True when the handler logs the traceback of a failure itself (as the Tasks API's
    #: does, through django_tasks): the host's line for its dead letter then leaves it out.
    logs_failures: ClassVar[bool] = False

    def __init__(self, user: Any) -> None:
        self.user = user

    def handle(self, message: WorkMessage, context: WorkContext) -> Outcome:
        raise NotImplementedError(f"{type(self).__name__} must implement handle()")


H = TypeVar("H", bound=type[BaseWorkHandler])


class HandlerRegistry:
    """Handler key → handler class. One key has one class; a clash fails at import time."""

    def __init__(self) -> None:
        self._handlers: dict[str, type[BaseWorkHandler]] = {}
        self._lock = threading.Lock()

    def register(self, key: str, handler: type[BaseWorkHandler]) -> None:
        if not isinstance(handler, type) or not issubclass(handler, BaseWorkHandler):
            raise WorkQueueConfigurationError(
                f"Handler {handler!r} for key {key!r} must subclass BaseWorkHandler."
            )
        key = key.strip()
        with self._lock:
            existing = self._handlers.get(key)
            # The same class of the same module again is that module imported again after an
            # import that raised once its classes were defined (``manage.py check`` imports
            # HANDLER_MODULES before a host's start does): the later one stands.
            if existing is not None and _path(existing) != _path(handler):
                raise WorkQueueConfigurationError(
                    f"Handler key {key!r} is registered twice ({_path(existing)} and "
                    f"{_path(handler)}); give one of them another key."
                )
            self._handlers[key] = handler

    def get(self, key: str | None) -> type[BaseWorkHandler] | None:
        return self._handlers.get((key or "").strip())

    def keys(self) -> list[str]:
        return sorted(self._handlers)

    def near(self, key: str) -> list[str]:
        """Registered keys spelt almost like ``key`` (what a typo likely meant), closest first."""
        return difflib.get_close_matches(key.strip(), self.keys(), n=3, cutoff=0.8)


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


handler_registry = HandlerRegistry()


def register_handler(key: str) -> Callable[[H], H]:
    """Class decorator: ``@register_handler("billing.invoice-created")``."""

    def decorate(handler: H) -> H:
        handler_registry.register(key, handler)
        return handler

    return decorate


def autodiscover(extra_modules: tuple[str, ...] = ()) -> None:
    """Import every installed app's ``work_handlers`` module, then ``extra_modules``.

    Like the admin's autodiscovery: an app without the module is fine; a module that fails to
    import raises, so a broken handler never silently plans as HandlerNotRegistered: one that
    cannot import what it needs (ImportError) as WorkQueueConfigurationError, in a line naming
    it, anything else (a bug inside it) as itself, its traceback saying where.
    """
    for problem in handler_module_problems((*app_handler_modules(), *extra_modules)):
        if isinstance(problem.error, ImportError):
            raise WorkQueueConfigurationError(problem.text) from problem.error
        raise problem.error  # a bug inside the module: its own traceback says where


@dataclass(frozen=True, slots=True)
class HandlerModuleProblem:
    """A ``HANDLER_MODULES`` entry that would stop a host from starting."""

    module: str
    text: str
    #: True when the module named does not exist in a package that does (a misspelt path):
    #: wrong wherever it runs. False when it exists but raised while importing, or its package
    #: is not installed, which may be an image's doing (a web-only image without a worker's
    #: package, library or secret).
    missing: bool
    error: Exception = field(compare=False)


def app_handler_modules() -> tuple[str, ...]:
    """The ``work_handlers`` modules of the installed apps that have one."""
    return tuple(
        f"{app.name}.work_handlers"
        for app in apps.get_app_configs()
        if module_has_submodule(app.module, "work_handlers")
    )


def handler_module_problems(modules: tuple[str, ...]) -> list[HandlerModuleProblem]:
    """Import each of ``modules`` (apps' ``work_handlers`` and ``HANDLER_MODULES`` entries) as
    :func:`autodiscover` does at host start, and say which fail and how, instead of raising
    (``manage.py check`` reports them)."""
    problems = []
    for module in modules:
        try:
            import_module(module)
        except Exception as exc:
            text = _cannot_import(module, exc)
            problems.append(HandlerModuleProblem(module, text, _misspelt(module, exc), exc))
    return problems


def _misspelt(module: str, exc: Exception) -> bool:
    """Whether importing ``module`` failed because its last part does not exist inside a
    package that does (``shop.jobz``): wrong wherever it runs. A package that is not installed
    at all (``shop_worker``, missing from a web-only image) is the image's doing."""
    if not isinstance(exc, ModuleNotFoundError) or exc.name != module:
        return False
    package, _, _ = module.rpartition(".")
    return bool(package)


def _cannot_import(module: str, exc: Exception) -> str:
    # An ImportError's text names what is missing; any other exception is named by its type.
    reason = str(exc) if isinstance(exc, ImportError) else f"{type(exc).__name__}: {exc}"
    if module.endswith(".work_handlers") and module in app_handler_modules():
        return f"The handler module {module!r} (found in its app) cannot be imported: {reason}"
    return f"WORKQUEUE['HANDLER_MODULES'] names {module!r}, which cannot be imported: {reason}"
