"""The one reader of ``settings.WORKQUEUE`` and the ``WORKQUEUE_*`` environment overrides."""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from django.conf import settings

from workqueue.exceptions import WorkQueueConfigurationError


@dataclass(frozen=True, slots=True)
class WorkQueueSettings:
    #: Username or e-mail of an existing user that handlers, the sweeper and default publishes
    #: run as. Required to run a host.
    SYSTEM_USER: str = ""
    #: What a host runs: [{"name": "<subscription or *>", "concurrency": N}, ...]; an entry may
    #: add "prefetch": N (at most N deliveries claimed ahead while handlers are quick;
    #: default 256, or as many of the topic's largest messages as fit in 32 MiB).
    SUBSCRIPTIONS: tuple[dict[str, Any], ...] = ({"name": "*", "concurrency": 4},)
    #: Idle back-off bounds between empty claims (milliseconds).
    IDLE_POLL_MIN_MS: int = 250
    IDLE_POLL_MAX_MS: int = 5000
    #: How long a host waits for running handlers on shutdown before aborting them.
    SHUTDOWN_DRAIN_MS: int = 8000
    SWEEPER_ENABLED: bool = True
    SWEEPER_INTERVAL_MS: int = 60000
    #: How often a host re-reads topology (0: plan once at start).
    RECONCILE_INTERVAL_MS: int = 30000
    #: Recurring publishes, each {"name", "cron", "topic", and optionally "timezone" (default
    #: UTC), "payload", "partition_key", "attributes", "priority"}: see workqueue/scheduling.py.
    SCHEDULES: tuple[dict[str, Any], ...] = ()
    #: How often a host's scheduler looks for due slots (milliseconds; 0: no scheduler).
    SCHEDULER_INTERVAL_MS: int = 10000
    #: Extra modules holding handlers, besides each installed app's work_handlers.py.
    HANDLER_MODULES: tuple[str, ...] = ()
    #: The database alias whose queue tables the work queue uses.
    DATABASE_ALIAS: str = "default"
    #: Largest batch accepted by the REST publish endpoint.
    PUBLISH_MAX_BATCH: int = 100
    #: Largest REST publish request body, in bytes (larger bodies get 413 unparsed). None: room
    #: for PUBLISH_MAX_BATCH messages of the topic's max_payload_bytes plus 2 KiB each (the
    #: default, 100 x 258 KiB = 25.2 MiB for a topic of the largest size).
    PUBLISH_BODY_LIMIT_BYTES: int | None = None
    #: Most JSON values and keys a REST publish request body may hold, counted before it is
    #: parsed (larger get 413): decoded, a value costs up to some 70 bytes, so this bounds what
    #: one request makes the web process hold (about 70 MB at the default).
    PUBLISH_MAX_JSON_VALUES: int = 1_000_000
    #: Topology as code for ``manage.py workqueue sync-topology``: {"topics": {name: fields},
    #: "subscriptions": {name: fields}}, or a dotted path to such a dict (the environment
    #: override takes the path). None: nothing declared.
    TOPOLOGY: Any = None
    #: validate-bindings and /health warn once the oldest transaction horizon (a transaction,
    #: snapshot, prepared transaction or replication slot that keeps vacuum from cleaning the
    #: queue tables) has been held this long, in seconds.
    VACUUM_HORIZON_WARNING_SECONDS: int = 900
    #: ... and when a queue table holds at least this many dead rows, and more dead than live.
    DEAD_ROWS_WARNING: int = 100_000
    #: Each count a metrics scrape reads stops here, so a scrape costs milliseconds whatever
    #: the backlog (``workqueue_counts_capped`` says when one did); 1..1000000.
    METRICS_COUNT_CAP: int = 10_000
    #: Each count stats read (REST, the admin dashboard, ``workqueue stats`` unless given
    #: ``--cap``) stops here, so that a reader allowed one subscription cannot have a backlog of
    #: millions counted at every call (``capped`` says when one did); 1..1000000.
    STATS_COUNT_CAP: int = 100_000
    #: The sweeper deletes the record of a host not seen for this many days (a stopped host's
    #: or a dead one's); 1..3650.
    HOST_RECORD_RETENTION_DAYS: int = 7
    #: A host reports a handler run as stuck (health, the ``workqueue_stuck_handler_runs``
    #: gauge, one WARNING) once it has run this many seconds, when its subscription sets no
    #: ``max_processing_seconds`` (which is its threshold then); 1 or more.
    HANDLER_RUN_WARNING_SECONDS: int = 1800


#: The most handlers of one subscription a host runs at once (each slot is two threads).
MAX_CONCURRENCY = 1000
#: The most deliveries one claim takes: ``wq_claim`` clamps what it is passed to 0..this on
#: both vendors, whoever calls it (review helper-176), and a host asks for no more. Far above
#: what a host asks for by default (MAX_CONCURRENCY free slots and DEFAULT_PREFETCH ahead);
#: a larger ``prefetch`` than it leaves room for claims this many at a time.
MAX_CLAIM_ROWS = 5000
#: The keys a ``SUBSCRIPTIONS`` entry may hold.
SUBSCRIPTION_ENTRY_KEYS = ("name", "concurrency", "prefetch")
#: Each number setting's smallest and largest value (None: no bound). A value outside them
#: would not fail where it is read, only misbehave: a busy claim loop, live host records purged.
_NUMBER_RANGES: dict[str, tuple[int, int | None]] = {
    "IDLE_POLL_MIN_MS": (1, None),
    "IDLE_POLL_MAX_MS": (1, None),
    "SHUTDOWN_DRAIN_MS": (0, None),
    "SWEEPER_INTERVAL_MS": (0, None),
    "RECONCILE_INTERVAL_MS": (0, None),
    "SCHEDULER_INTERVAL_MS": (0, None),
    "PUBLISH_MAX_BATCH": (1, None),
    "PUBLISH_BODY_LIMIT_BYTES": (1, None),
    "PUBLISH_MAX_JSON_VALUES": (1, None),
    "VACUUM_HORIZON_WARNING_SECONDS": (1, None),
    "DEAD_ROWS_WARNING": (1, None),
    "METRICS_COUNT_CAP": (1, 1_000_000),
    "STATS_COUNT_CAP": (1, 1_000_000),
    "HOST_RECORD_RETENTION_DAYS": (1, 3650),
    "HANDLER_RUN_WARNING_SECONDS": (1, None),
}


_INT_KEYS = {f.name for f in fields(WorkQueueSettings) if f.type in {"int", "int | None"}}
_BOOL_KEYS = {f.name for f in fields(WorkQueueSettings) if f.type == "bool"}


def _from_environment(key: str, raw: str) -> Any:
    if key in _INT_KEYS:
        try:
            return int(raw)
        except ValueError:
            raise WorkQueueConfigurationError(
                f"WORKQUEUE_{key}={raw!r} is not an integer; set it to a whole number (see "
                "workqueue/conf.py for its unit) or remove it."
            ) from None
    if key in _BOOL_KEYS:
        return raw.strip().lower() in {"1", "true", "yes", "on"}
    if key == "SUBSCRIPTIONS":
        try:
            return json.loads(raw)
        except ValueError:
            raise WorkQueueConfigurationError(
                f"WORKQUEUE_SUBSCRIPTIONS must be JSON, e.g. "
                f'\'[{{"name": "*", "concurrency": 4}}]\'; got {raw!r}.'
            ) from None
    if key == "SCHEDULES":
        try:
            return json.loads(raw)
        except ValueError:
            raise WorkQueueConfigurationError(
                "WORKQUEUE_SCHEDULES must be JSON, e.g. "
                '\'[{"name": "nightly", "cron": "0 3 * * *", "topic": "reports"}]\'; '
                f"got {raw!r}."
            ) from None
    if key == "HANDLER_MODULES":
        if raw.lstrip().startswith("["):
            # JSON, as the other list settings take (helper-158: read as one module's name).
            try:
                return tuple(json.loads(raw))
            except (ValueError, TypeError):
                raise WorkQueueConfigurationError(
                    "WORKQUEUE_HANDLER_MODULES must be module paths separated by commas, or a "
                    f'JSON list of them, e.g. \'["shop.jobs", "billing.jobs"]\'; got {raw!r}.'
                ) from None
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    return raw


_DEFAULTS = {f.name: f.default for f in fields(WorkQueueSettings)}
_TUPLE_KEYS = ("SUBSCRIPTIONS", "SCHEDULES", "HANDLER_MODULES")


def setting(name: str) -> Any:
    """One setting, as ``get_settings()`` would give it, reading only that one: for paths run
    per call (a publish reads two), where reading them all costs tens of microseconds.
    Unknown keys in ``settings.WORKQUEUE`` are reported by ``get_settings()`` (the system
    checks call it), not here."""
    raw = os.environ.get(f"WORKQUEUE_{name}")
    if raw is not None:
        value = _from_environment(name, raw)
    else:
        configured = getattr(settings, "WORKQUEUE", None) or {}
        value = configured[name] if name in configured else _DEFAULTS[name]
    # Only a list becomes a tuple: a string or a dict would become its letters or its keys,
    # which setting_problems could no longer tell from a list given.
    return tuple(value) if name in _TUPLE_KEYS and isinstance(value, list) else value


#: Hosts read a negative value of these as 0 (no wait, or the service off).
_NEGATIVE_READ_AS_ZERO = (
    "SHUTDOWN_DRAIN_MS",
    "SWEEPER_INTERVAL_MS",
    "RECONCILE_INTERVAL_MS",
    "SCHEDULER_INTERVAL_MS",
)


@dataclass(frozen=True, slots=True)
class SettingProblem:
    text: str
    #: False when hosts read the value leniently (clamp it, or take it for "off"): a warning
    #: then, since an error stops every command, ``migrate`` included.
    serious: bool = True


def setting_problems(conf: WorkQueueSettings) -> list[SettingProblem]:
    """What in ``conf`` a host or a web process would misread, each naming the setting and
    what it takes (``manage.py check`` reports them: the serious ones stop every command)."""
    problems = []
    for name, (low, high) in _NUMBER_RANGES.items():
        value = getattr(conf, name)
        if value is None and name == "PUBLISH_BODY_LIMIT_BYTES":
            continue
        if _is_whole_number(value) and low <= value and (high is None or value <= high):
            continue
        within = f"{low:,} or more" if high is None else f"{low:,} to {high:,}"
        text = f"WORKQUEUE['{name}'] is {value!r}: it takes a whole number, {within}."
        if name in _NEGATIVE_READ_AS_ZERO and _is_whole_number(value):
            problems.append(SettingProblem(f"{text} Hosts read it as 0.", serious=False))
        else:
            problems.append(SettingProblem(text))
    if conf.SWEEPER_ENABLED is True and conf.SWEEPER_INTERVAL_MS == 0:
        problems.append(
            SettingProblem(
                "WORKQUEUE['SWEEPER_INTERVAL_MS'] is 0 with SWEEPER_ENABLED on: hosts run no "
                "sweeper, so leases expire only if `manage.py workqueue_sweep` runs somewhere. "
                "Set SWEEPER_ENABLED to False to say so, or give the interval.",
                serious=False,
            )
        )
    polls = (conf.IDLE_POLL_MIN_MS, conf.IDLE_POLL_MAX_MS)
    if all(_is_whole_number(v) and v >= 1 for v in polls) and polls[1] < polls[0]:
        problems.append(
            SettingProblem(
                f"WORKQUEUE['IDLE_POLL_MAX_MS'] ({polls[1]}) is less than IDLE_POLL_MIN_MS "
                f"({polls[0]}): idle consumers poll every {polls[1]} ms.",
                serious=False,
            )
        )
    if not isinstance(conf.SWEEPER_ENABLED, bool):
        problems.append(
            SettingProblem(
                f"WORKQUEUE['SWEEPER_ENABLED'] is {conf.SWEEPER_ENABLED!r}: it takes True or False."
            )
        )
    modules = conf.HANDLER_MODULES
    if not isinstance(modules, tuple) or not all(isinstance(m, str) for m in modules):
        problems.append(
            SettingProblem(
                f"WORKQUEUE['HANDLER_MODULES'] is {modules!r}: it takes a list of dotted module "
                'paths, e.g. ["myapp.jobs"].'
            )
        )
    return problems + subscription_entry_problems(conf.SUBSCRIPTIONS)


def subscription_entry_problems(entries: Any) -> list[SettingProblem]:
    """What in ``SUBSCRIPTIONS`` a host would misread: hosts ignore a misspelt key and run
    the subscription at concurrency 1."""
    where = "WORKQUEUE['SUBSCRIPTIONS']"
    if not isinstance(entries, (list, tuple)):
        return [
            SettingProblem(f"{where} is {entries!r}: it takes a list of entries, e.g. {_EXAMPLE}.")
        ]
    problems = []
    seen: dict[str, str] = {}
    for entry in entries:
        if not isinstance(entry, dict):
            problems.append(
                SettingProblem(f"{where} holds {entry!r}, which is not an entry like {_EXAMPLE}.")
            )
            continue
        name = entry.get("name")
        if not isinstance(name, str) or not name.strip():
            problems.append(SettingProblem(f"{where} holds an entry with no name: {entry!r}."))
            continue
        unknown = [key for key in entry if key not in SUBSCRIPTION_ENTRY_KEYS]
        if unknown:
            problems.append(
                SettingProblem(
                    f"{where} entry {name!r} holds {', '.join(map(repr, unknown))}: an entry "
                    f"takes only {', '.join(SUBSCRIPTION_ENTRY_KEYS)}."
                )
            )
        problems.extend(_concurrency_problems(where, name, entry.get("concurrency", 1)))
        prefetch = entry.get("prefetch", 0)
        if not _is_whole_number(prefetch) or prefetch < 0:
            problems.append(
                SettingProblem(
                    f"{where} entry {name!r} has prefetch {prefetch!r}: it takes a whole "
                    "number, 0 or more (0 claims only for free slots)."
                )
            )
        elif prefetch > MAX_CLAIM_ROWS:
            problems.append(
                SettingProblem(
                    f"{where} entry {name!r} has prefetch {prefetch:,}: a host claims at most "
                    f"{MAX_CLAIM_ROWS:,} deliveries at once; lower it (the default is at most "
                    "256)."
                )
            )
        normalised = name.strip().lower()
        if normalised in seen:
            problems.append(
                SettingProblem(
                    f"{where} holds two entries for one subscription, {seen[normalised]!r} and "
                    f"{name!r} (names are matched without case and spaces): keep one."
                )
            )
        seen[normalised] = name
    return problems


def _concurrency_problems(where: str, name: str, concurrency: Any) -> list[SettingProblem]:
    # Hosts take int(concurrency), then at least 1: "4" (from an environment variable) runs 4.
    try:
        value = int(concurrency) if not isinstance(concurrency, (bool, float)) else None
    except (TypeError, ValueError):
        value = None
    text = f"{where} entry {name!r} has concurrency {concurrency!r}: it takes a whole number"
    if value is None or value > MAX_CONCURRENCY:
        return [SettingProblem(f"{text}, 1 to {MAX_CONCURRENCY:,} (run more hosts for more).")]
    if value < 1:
        return [SettingProblem(f"{text} of at least 1; hosts run it at 1.", serious=False)]
    return []


_EXAMPLE = '[{"name": "*", "concurrency": 4}]'


def _is_whole_number(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def get_settings(*, ignore_unknown: bool = False) -> WorkQueueSettings:
    """Read the settings now (call it where needed rather than caching it globally); each one
    as ``setting`` reads it. An unknown key in ``settings.WORKQUEUE`` raises, unless
    ``ignore_unknown`` (the check reports it, and the problems of the others beside it)."""
    problem = None if ignore_unknown else unknown_settings_problem()
    if problem is not None:
        raise WorkQueueConfigurationError(problem)
    return WorkQueueSettings(**{name: setting(name) for name in _DEFAULTS})


#: The ``WORKQUEUE_*`` environment variables read besides each setting's override
#: (``WORKQUEUE_<KEY>`` for every key of WorkQueueSettings), with what they do.
OTHER_ENVIRONMENT_VARIABLES: dict[str, str] = {
    "WORKQUEUE_DISABLE_HOST": "1 makes the host commands exit 0 at once",
    "WORKQUEUE_LOCALDB": "1 lets a process with DEBUG off use the embedded PostgreSQL",
    "WORKQUEUE_LOCALDB_DIR": "the embedded PostgreSQL's folder",
    "WORKQUEUE_LOCALDB_BINDIR": "the PostgreSQL server programs the embedded database runs",
    # This repository's sample project and test suite.
    "WORKQUEUE_TEST_MSSQL_URL": "the SQL Server the test suite also runs against",
    "WORKQUEUE_TEST_AWS_REGION": "the real AWS region the test suite's AWS cases run against",
}
_ENVIRONMENT_PREFIX = "WORKQUEUE_"


def known_environment_variables() -> frozenset[str]:
    """Every ``WORKQUEUE_*`` environment variable the work queue reads."""
    overrides = {f"{_ENVIRONMENT_PREFIX}{name}" for name in _DEFAULTS}
    return frozenset(overrides | set(OTHER_ENVIRONMENT_VARIABLES))


def unknown_environment_problems(environ: Mapping[str, str] | None = None) -> list[str]:
    """The ``WORKQUEUE_*`` variables of ``environ`` (default: this process's) that nothing
    reads, so that they change nothing (``WORKQUEUE_SHUTDOWN_DRAIN`` for
    ``WORKQUEUE_SHUTDOWN_DRAIN_MS``), each with the known name it resembles and what that
    one sets."""
    environ = os.environ if environ is None else environ
    known = known_environment_variables()
    problems = []
    for name in sorted(environ):
        if name in known or not name.upper().startswith(_ENVIRONMENT_PREFIX):
            continue
        text = (
            f"The environment variable {name} is set, but the work queue reads no variable "
            "of that name, so it changes nothing"
        )
        # Compared without the prefix they all share, which would make any two look alike.
        near = difflib.get_close_matches(
            name.upper().removeprefix(_ENVIRONMENT_PREFIX),
            sorted(known_name.removeprefix(_ENVIRONMENT_PREFIX) for known_name in known),
            n=1,
            cutoff=0.6,
        )
        if near:
            meant = f"{_ENVIRONMENT_PREFIX}{near[0]}"
            sets = (
                f"WORKQUEUE['{near[0]}']"
                if near[0] in _DEFAULTS
                else OTHER_ENVIRONMENT_VARIABLES[meant]
            )
            text += f"; did you mean {meant} ({sets})?"
        problems.append(text + ("" if near else "."))
    return problems


def with_near_names(
    unknown: Iterable[Any], known: Iterable[str], *, fold: Callable[[str], str] = str
) -> str:
    """``unknown`` names (a setting's keys, a declaration's fields) listed for an error, each
    with the ``known`` ones it resembles once ``fold``ed: ``handler (did you mean
    handler_key?), retries``."""
    known = sorted(known)
    named = []
    for name in unknown:
        near = difflib.get_close_matches(fold(str(name)), known, n=2, cutoff=0.6)
        named.append(f"{name} (did you mean {' or '.join(near)}?)" if near else str(name))
    return ", ".join(named)


def unknown_settings_problem() -> str | None:
    """The keys of ``settings.WORKQUEUE`` that are no setting, each with the names it
    resembles (``SHUTDOWN_DRAIN``: did you mean ``SHUTDOWN_DRAIN_MS``?), or None."""
    configured = getattr(settings, "WORKQUEUE", {}) or {}
    unknown = sorted(set(configured) - set(_DEFAULTS), key=str)
    if not unknown:
        return None
    named = with_near_names(unknown, _DEFAULTS, fold=str.upper)
    return (
        f"Unknown WORKQUEUE setting(s) {named}; known settings are {', '.join(sorted(_DEFAULTS))}."
    )
