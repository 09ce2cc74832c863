"""Short forms of queue values for people reading a table (CLI, admin): full values stay in the
JSON, the REST API and the detail pages."""

from __future__ import annotations

from django.utils.crypto import salted_hmac

# Kept as it was first named, so that a host keeps its pseudonym across releases.
PSEUDONYM_SALT = "workqueue.api.health.host"

TRACEBACK_HEADER = "Traceback (most recent call last):"


def error_summary(last_error: str | None, width: int = 100) -> str:
    """The line of ``last_error`` that says what went wrong: for a stored traceback the final
    exception's ``Type: message`` line (its first line, when the message has several), else the
    text's first line; cut to ``width`` characters."""
    if not last_error:
        return ""
    lines = last_error.splitlines()
    start = 0
    for index, line in enumerate(lines):
        if line.startswith(TRACEBACK_HEADER) or line.startswith('  File "'):
            start = index + 1
    if start:
        # Frames and their source lines are indented; the exception line is the first after
        # the last frame that is not (a chained exception's traceback starts after the last
        # header found above). Of a traceback cut to its start and its end, the end's frames
        # are the last found (review helper-138: the cut's marker was taken for the
        # exception when only the header was looked for).
        lines = [line for line in lines[start:] if line and not line[0].isspace()]
    first = next((line for line in lines if line.strip()), "")
    return first if len(first) <= width else first[: width - 1] + "…"


def short_id(value: object) -> str:
    """The first 8 characters of a UUID: enough to tell rows apart on one screen."""
    return str(value)[:8]


def count_of(count: int, one: str, many: str) -> str:
    """``1 delivery is`` / ``3 deliveries are``: a count with its words in number."""
    return f"{count:,} {one if count == 1 else many}"


def host_pseudonym(instance_id: str) -> str:
    """A stable name for a host that reveals nothing of it (its instance id carries its
    hostname and process id) without the SECRET_KEY: what an API key limited to named
    subscriptions sees of hosts."""
    return "host-" + salted_hmac(PSEUDONYM_SALT, instance_id, algorithm="sha1").hexdigest()[:16]
