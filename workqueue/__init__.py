"""django-workqueue: a durable work queue for Django.

The public API is imported lazily so that ``import workqueue`` never touches models before the
app registry is ready.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BaseWorkHandler",
    "Cancelled",
    "FatalWorkError",
    "LeaseLost",
    "Outcome",
    "PublishRejectedError",
    "TransientWorkError",
    "publish",
    "publish_many",
    "publish_or_raise",
    "register_handler",
]

_EXPORTS = {
    "publish": "workqueue.publishing",
    "publish_many": "workqueue.publishing",
    "publish_or_raise": "workqueue.publishing",
    "PublishRejectedError": "workqueue.exceptions",
    "BaseWorkHandler": "workqueue.runtime.handlers",
    "register_handler": "workqueue.runtime.handlers",
    "Outcome": "workqueue.runtime.outcome",
    "FatalWorkError": "workqueue.runtime.outcome",
    "TransientWorkError": "workqueue.runtime.outcome",
    "LeaseLost": "workqueue.exceptions",
    "Cancelled": "workqueue.exceptions",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'workqueue' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(module), name)
