"""Task messages and task results: what a task's message holds, and how a result is built.

A task is one message on topic ``tasks.<queue>``, delivered to subscription ``tasks.<queue>``.
A result is read from three places, each the only holder of its facts:

* the message: the task's path, arguments, backend and queue; ``published_at`` is when it was
  enqueued;
* the delivery: the status (the subscription's retry and dead-letter policy decides it, and the
  operator's replay and discard change it) and when it finished;
* the ``TaskResult`` row the host writes: start times, worker ids, errors, the return value.
"""

from __future__ import annotations

import datetime as dt
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.utils.module_loading import import_string

from workqueue.input_limits import MAX_JSON_DEPTH, TOO_DEEP_PROBLEM, text_problem
from workqueue.tasks import api
from workqueue.types import DeliveryStatus

if TYPE_CHECKING:
    from workqueue.models import TaskResult

#: The handler key of every task subscription; the handler is registered by the app itself.
HANDLER_KEY = "workqueue.tasks"
TOPIC_PREFIX = "tasks."

STATUS_BY_DELIVERY = {
    DeliveryStatus.PENDING: api.TaskResultStatus.READY,
    DeliveryStatus.IN_FLIGHT: api.TaskResultStatus.RUNNING,
    DeliveryStatus.COMPLETED: api.TaskResultStatus.SUCCESSFUL,
    # FAILED only once the queue has given up: a failed run that will be retried leaves the
    # delivery Pending (READY), with the failure in ``errors``.
    DeliveryStatus.DEAD_LETTERED: api.TaskResultStatus.FAILED,
    DeliveryStatus.DISCARDED: api.TaskResultStatus.FAILED,
}


def topic_name(queue_name: str) -> str:
    """The topic (and subscription) name of a Tasks API queue."""
    return TOPIC_PREFIX + queue_name


@dataclass(frozen=True, slots=True)
class TaskMessage:
    """The payload of a task's message."""

    task_path: str
    args: list[Any]
    kwargs: dict[str, Any]
    backend: str
    queue_name: str
    priority: int = 0
    run_after: dt.datetime | None = None

    def to_payload(self) -> dict[str, Any]:
        payload = {
            "task": self.task_path,
            "args": self.args,
            "kwargs": self.kwargs,
            "backend": self.backend,
            "queue": self.queue_name,
        }
        # Kept with the task so that its result reads them back in any process; left out
        # when not given, so the payload of a plain task stays what it always was.
        if self.priority:
            payload["priority"] = self.priority
        if self.run_after is not None:
            payload["run_after"] = self.run_after.isoformat()
        return payload

    @classmethod
    def enqueued(
        cls,
        task: api.Task,
        args: Any,
        kwargs: Any,
        *,
        priority: int | None = None,
        run_after: dt.datetime | None = None,
    ) -> TaskMessage:
        """The message an enqueue of ``task`` publishes (``task.enqueue(*args, **kwargs)``, or
        a schedule's slot): tuples in the arguments made lists, then each argument checked
        (``require_json_round_trip``: ``TypeError`` or ``ValueError`` naming it)."""
        message = cls(
            task_path=task.module_path,
            args=tuples_as_lists(list(args)),
            kwargs=tuples_as_lists(dict(kwargs)),
            backend=task.backend,
            queue_name=task.queue_name,
            priority=task.priority if priority is None else priority,
            run_after=run_after,
        )
        # One level down in the message's payload, which may nest MAX_JSON_DEPTH levels.
        require_json_round_trip(message.args, "args", depth=1)
        require_json_round_trip(message.kwargs, "kwargs", depth=1)
        return message

    @classmethod
    def from_payload(cls, payload: Any) -> TaskMessage:
        """Read a payload written by ``to_payload``; ValueError says what is wrong with it."""
        if not isinstance(payload, Mapping):
            raise ValueError("the payload is not a JSON object")
        fields = {
            "task": str,
            "args": list,
            "kwargs": dict,
            "backend": str,
            "queue": str,
        }
        for name, kind in fields.items():
            if not isinstance(payload.get(name), kind):
                raise ValueError(f"payload[{name!r}] must be a {kind.__name__}")
        priority = payload.get("priority", 0)
        if type(priority) is not int:
            raise ValueError("payload['priority'] must be an int")
        run_after = payload.get("run_after")
        if run_after is not None and not isinstance(run_after, str):
            raise ValueError("payload['run_after'] must be a str")
        return cls(
            task_path=payload["task"],
            args=payload["args"],
            kwargs=payload["kwargs"],
            backend=payload["backend"],
            queue_name=payload["queue"],
            priority=priority,
            run_after=dt.datetime.fromisoformat(run_after) if run_after else None,
        )

    def load_task(self) -> api.Task:
        """Import the task (the module-level object ``@task`` made) with the enqueued options."""
        found = import_string(self.task_path)
        if not isinstance(found, api.Task):
            raise TypeError(f"{self.task_path} is not a task (decorate the function with @task)")
        if (found.queue_name, found.backend, found.priority, found.run_after) == (
            self.queue_name,
            self.backend,
            self.priority,
            self.run_after,
        ):
            # Enqueued as decorated, the usual case: the same task. ``using`` would make a copy
            # and have the backend validate it again, on every run.
            return found
        return found.using(
            queue_name=self.queue_name,
            backend=self.backend,
            priority=self.priority,
            run_after=self.run_after,
        )


def tuples_as_lists(value: Any) -> Any:
    """``value`` with every tuple in it (at any depth of lists, tuples and dicts) made a list,
    as the Tasks API's own backends store arguments and return values (JSON has no tuple): a
    task returning ``(label, count)`` failed here, where the reference backend stored
    ``[label, count]``. Each container is copied once (one met again inside itself stays the
    same copy: a list holding itself twice took 2**64 calls, review helper-121), and nesting
    past ``MAX_JSON_DEPTH`` is left as it is: ``require_json_round_trip`` refuses both."""
    return _tuples_as_lists(value, {}, 0)


def _tuples_as_lists(value: Any, copies: dict[int, Any], depth: int) -> Any:
    kind = type(value)
    if kind not in (tuple, list, dict) or depth > MAX_JSON_DEPTH:
        return value
    if id(value) in copies:
        return copies[id(value)]
    if kind is dict:
        mapping: dict[Any, Any] = {}
        copies[id(value)] = mapping
        for key, item in value.items():
            mapping[key] = _tuples_as_lists(item, copies, depth + 1)
        return mapping
    items: list[Any] = []
    copies[id(value)] = items
    items.extend(_tuples_as_lists(item, copies, depth + 1) for item in value)
    return items


def require_json_round_trip(value: Any, where: str, depth: int = 0) -> None:
    """Raise ``TypeError`` (``ValueError`` for NaN and infinities, text the database cannot
    store, integers too long for JSON text, and nesting past ``MAX_JSON_DEPTH``, which a value
    that contains itself reaches) unless ``value`` comes back from
    ``json.loads(json.dumps(value))`` equal and of the same types, and can be stored, as the
    Tasks API requires of arguments and return values. The message names the offending part.
    ``depth``: how many containers hold ``value`` where it is stored (a task's arguments sit
    one level down in its message's payload)."""
    kind = type(value)
    if value is None or kind is bool:
        return
    if kind is str:
        if (problem := text_problem(value)) is not None:
            # Not the text itself: it may be long, and is not printable as it stands.
            raise ValueError(f"{where} {problem}.")
        return
    if kind is int:
        if value.bit_length() > _INT_BITS_ALWAYS_WRITABLE:
            try:
                str(value)
            except ValueError:
                raise ValueError(
                    f"{where} has more digits than Python writes as text "
                    f"({sys.get_int_max_str_digits()}), so JSON cannot carry it."
                ) from None
        return
    if kind is float:
        if not math.isfinite(value):
            raise ValueError(f"{where} is {value!r}, which JSON cannot represent.")
        return
    if kind in (list, dict) and depth >= MAX_JSON_DEPTH:
        raise ValueError(f"{where} {TOO_DEEP_PROBLEM} (a value that contains itself is).")
    if kind is list:
        for index, item in enumerate(value):
            require_json_round_trip(item, f"{where}[{index}]", depth + 1)
        return
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str:
                raise TypeError(
                    f"{where} has the key {key!r} ({type(key).__name__}); JSON object keys are "
                    "strings, so it would come back as a different key. Use string keys."
                )
            if (problem := text_problem(key)) is not None:
                raise ValueError(f"{where} has a key that {problem}.")
            require_json_round_trip(item, f"{where}[{key!r}]", depth + 1)
        return
    raise TypeError(
        f"{where} is a {kind.__name__}, which does not round-trip through JSON unchanged. Pass "
        "JSON values only (dict with string keys, list, str, int, float, bool, None): e.g. an ISO "
        "string for a datetime, a list for a tuple, a primary key for a model instance."
    )


#: Integers up to this many bits have fewer digits than Python's default limit on writing
#: them as text (4,300): only longer ones are written out to check.
_INT_BITS_ALWAYS_WRITABLE = 14_000


def unloadable_task(message: TaskMessage, error: Exception) -> api.Task:
    """A stand-in for the task ``message`` names that this process cannot load (renamed or
    removed since it was enqueued, say), so that its result can still be read: it carries the
    enqueued options, its ``module_path`` is the enqueued path, and calling it raises
    ImportError saying why it could not be loaded. Made without the backend's validation of a
    task (the Tasks API's dataclass runs it on creation), which it could never pass."""
    module, _, name = message.task_path.rpartition(".")

    def unloadable(*args: Any, **kwargs: Any) -> Any:
        raise ImportError(f"Task {message.task_path} cannot be loaded here: {error}")

    unloadable.__module__, unloadable.__name__, unloadable.__qualname__ = module, name, name
    stand_in = object.__new__(api.Task)
    for field, value in {
        "func": unloadable,
        "priority": message.priority,
        "backend": message.backend,
        "queue_name": message.queue_name,
        "run_after": message.run_after,
        "takes_context": False,
    }.items():
        object.__setattr__(stand_in, field, value)
    return stand_in


def build_result(
    task: api.Task,
    result_id: str,
    message: TaskMessage,
    status: str,
    *,
    enqueued_at: Any,
    finished_at: Any = None,
    record: TaskResult | None = None,
) -> api.TaskResult:
    result = api.TaskResult(
        task=task,
        id=result_id,
        status=status,
        enqueued_at=enqueued_at,
        started_at=record.started_at if record else None,
        finished_at=finished_at,
        last_attempted_at=record.last_attempted_at if record else None,
        args=message.args,
        kwargs=message.kwargs,
        backend=message.backend,
        errors=[
            api.TaskError(
                exception_class_path=error["exception_class_path"], traceback=error["traceback"]
            )
            for error in (record.errors if record else [])
        ],
        worker_ids=list(record.worker_ids) if record else [],
    )
    if status == api.TaskResultStatus.SUCCESSFUL and record is not None:
        # The API keeps the return value in a field that is not an __init__ argument.
        object.__setattr__(result, "_return_value", record.return_value)
    return result
