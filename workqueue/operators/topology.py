"""Topology as code: apply the topics and subscriptions declared in ``WORKQUEUE["TOPOLOGY"]``.

The declaration names rows and the fields the code owns::

    WORKQUEUE = {"TOPOLOGY": {
        "topics": {"orders.created": {"allow_external_publish": True}},
        "subscriptions": {
            "orders.created-billing": {"topic": "orders.created", "handler_key": "billing.invoice",
                                       "max_attempts": 5},
        },
    }}

(or a dotted path to such a dict, e.g. ``"shop.topology.TOPOLOGY"``). ``sync_topology`` makes
the database match: it creates missing rows, sets the declared fields of existing ones (code wins
for those; fields left out keep whatever the admin set, and take the model's default on
creation), validates every row as the admin does (``full_clean``), and writes all or nothing in
one transaction. Rows that are not declared are left alone unless ``prune``; even then a
subscription with deliveries, or a topic with messages or subscriptions, is never deleted.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from django.core.exceptions import ValidationError
from django.db import DatabaseError, connections, transaction
from django.db.models import Model, ProtectedError
from django.utils.module_loading import import_string

from workqueue.conf import get_settings, with_near_names
from workqueue.exceptions import (
    DeadlockError,
    NotFoundError,
    WorkQueueConfigurationError,
    WorkQueueError,
)
from workqueue.transports.base import ProvisionChange

logger = logging.getLogger(__name__)

#: Fields a declaration may not set: ids are the database's, names are the declaration's keys.
_NOT_DECLARABLE = {"id", "name"}

#: Runs of a sync the database may abort to break a deadlock with another writer of the same
#: rows (another sync, a queryset update), before the error is the caller's.
SYNC_ATTEMPTS = 5


class TopologySyncError(WorkQueueError):
    """A declared row breaks a rule the admin enforces; nothing was written. ``problems`` holds
    one line per row and field."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__(
            "The declared topology was not applied; fix WORKQUEUE['TOPOLOGY']:\n  "
            + "\n  ".join(problems)
        )
        self.problems = problems


@dataclass(frozen=True, slots=True)
class TopologyChange:
    """One row's difference. ``action``: ``create``, ``update``, ``delete``, ``keep`` (not
    declared, left alone) or ``refuse`` (not declared, but prune may not delete it)."""

    action: str
    kind: str
    name: str
    fields: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    note: str = ""


@dataclass(frozen=True, slots=True)
class SyncReport:
    changes: list[TopologyChange]
    dry_run: bool

    @property
    def writes(self) -> list[TopologyChange]:
        return [c for c in self.changes if c.action in {"create", "update", "delete"}]

    @property
    def refused(self) -> list[TopologyChange]:
        return [c for c in self.changes if c.action == "refuse"]


def declared_topology() -> dict[str, dict[str, dict[str, Any]]]:
    """``WORKQUEUE["TOPOLOGY"]``, resolved and checked for shape (not for values: the models'
    rules do that when it is applied)."""
    # Imported here: topology models need the app registry (layering rule 6).
    from workqueue.models import Subscription, Topic

    raw = get_settings().TOPOLOGY
    if raw is None:
        raise WorkQueueConfigurationError(
            'WORKQUEUE["TOPOLOGY"] is not set: declare {"topics": {...}, "subscriptions": '
            '{...}} there, or a dotted path to such a dict (e.g. "shop.topology.TOPOLOGY").'
        )
    if isinstance(raw, str):
        try:
            raw = import_string(raw)
        except ImportError as exc:
            raise WorkQueueConfigurationError(
                f'WORKQUEUE["TOPOLOGY"] names {raw!r}, which cannot be imported: {exc}'
            ) from None
    if not isinstance(raw, Mapping) or set(raw) - {"topics", "subscriptions"}:
        raise WorkQueueConfigurationError(
            'WORKQUEUE["TOPOLOGY"] must be a dict with the keys "topics" and "subscriptions", '
            "each mapping a name to that row's fields."
        )
    shaped: dict[str, dict[str, dict[str, Any]]] = {}
    for section, model, required in (
        ("topics", Topic, set()),
        ("subscriptions", Subscription, {"topic"}),
    ):
        allowed = {f.name for f in model._meta.concrete_fields} - _NOT_DECLARABLE
        rows = raw.get(section, {})
        if not isinstance(rows, Mapping):
            raise WorkQueueConfigurationError(
                f'WORKQUEUE["TOPOLOGY"]["{section}"] must map names to dicts of fields.'
            )
        shaped[section] = {}
        for name, values in rows.items():
            where = f'WORKQUEUE["TOPOLOGY"]["{section}"]["{name}"]'
            if not isinstance(values, Mapping):
                raise WorkQueueConfigurationError(f"{where} must be a dict of fields.")
            unknown = sorted(set(values) - allowed, key=str)
            if unknown:
                raise WorkQueueConfigurationError(
                    f"{where} has unknown field(s) {with_near_names(unknown, allowed)}; "
                    f"the fields are {', '.join(sorted(allowed))}."
                )
            missing = sorted(required - set(values))
            if missing:
                raise WorkQueueConfigurationError(f"{where} needs {', '.join(missing)}.")
            shaped[section][name] = dict(values)
    return shaped


def sync_topology(*, dry_run: bool = False, prune: bool = False) -> SyncReport:
    """Make the topology match the declaration (see the module's docstring). With ``dry_run``
    every row is validated and the differences are reported, then the transaction is rolled
    back. Raises ``TopologySyncError`` (nothing written) when a declared row is invalid."""
    declared = declared_topology()
    alias = get_settings().DATABASE_ALIAS
    attempt = 0
    while True:
        attempt += 1
        try:
            return _sync_once(declared, alias, dry_run=dry_run, prune=prune)
        except (DatabaseError, DeadlockError) as error:
            if attempt == SYNC_ATTEMPTS or not _deadlock_victim(error, alias):
                raise
            # Each run is all or nothing, so nothing of the aborted one is left; a pause of
            # varying length lets the other writer commit before this one locks its rows again.
            logger.warning(
                "The database aborted the topology sync to break a deadlock with another "
                "writer of the same rows; running it again (attempt %d of %d).",
                attempt + 1,
                SYNC_ATTEMPTS,
            )
            time.sleep(random.uniform(0.05, 0.25) * attempt)


def _sync_once(
    declared: dict[str, dict[str, dict[str, Any]]], alias: str, *, dry_run: bool, prune: bool
) -> SyncReport:
    """One all-or-nothing run of ``sync_topology``."""
    with transaction.atomic(using=alias):
        changes, topics, subscriptions = _declared_changes(declared, alias, save=True)
        for name, sub in subscriptions.items():
            if name not in declared["subscriptions"]:
                changes.append(_undeclared(sub, "subscription", prune, alias))
        for name, topic in topics.items():
            if name not in declared["topics"]:
                changes.append(_undeclared(topic, "topic", prune, alias))
        if dry_run:
            transaction.set_rollback(True, using=alias)
    return SyncReport(changes, dry_run)


def _deadlock_victim(error: BaseException, alias: str) -> bool:
    """Whether ``error`` says the database aborted this sync's own transaction to break a
    deadlock; inside a caller's transaction it is that transaction that must run again."""
    if connections[alias].in_atomic_block:
        return False
    if isinstance(error, DatabaseError):
        # Imported here: the topology commands must not need a driver until one answers.
        from workqueue.driver import get_driver

        error = get_driver(alias).translate_error(error)
    return isinstance(error, DeadlockError)


def topology_drift() -> list[TopologyChange]:
    """The rows ``sync_topology`` would create or update (``create`` and ``update`` changes),
    read without writing anything: what a deploy that forgot ``sync-topology`` runs without.
    Raises ``TopologySyncError`` when a declared row is invalid (the sync would refuse it too)
    and ``WorkQueueConfigurationError`` for a declaration of the wrong shape.

    Call it outside a transaction: validating a subscription inside one may take its topic's
    topology lock (as a save does), which would hold publishes until that transaction ends."""
    alias = get_settings().DATABASE_ALIAS
    changes, _, _ = _declared_changes(declared_topology(), alias, save=False)
    return changes


def topology_drift_warning() -> str | None:
    """What to tell an operator when the database's topology is not the one
    ``WORKQUEUE["TOPOLOGY"]`` declares (rows to create or update, or a declaration the sync
    would refuse); None when nothing is declared, it matches, or the tables cannot be read yet
    (``migrate`` checks before it creates them)."""
    if get_settings().TOPOLOGY is None:
        return None
    try:
        drift = topology_drift()
    except TopologySyncError as exc:
        return (
            "WORKQUEUE['TOPOLOGY'] declares rows that `manage.py workqueue sync-topology` "
            "would refuse, so the database keeps the topology it has; fix them: "
            + "; ".join(exc.problems)
        )
    except WorkQueueConfigurationError as exc:  # a declaration of the wrong shape
        return str(exc)
    except DatabaseError:
        return None
    except Exception as exc:
        # A value of a type no field takes (a list for a name, None for a handler key) fails
        # inside the models' rules: said, never raised, since `migrate`, `check` and host start
        # all call this.
        return (
            f"WORKQUEUE['TOPOLOGY'] could not be compared with the database "
            f"({type(exc).__name__}: {exc}); `manage.py workqueue sync-topology --dry-run` "
            "shows where."
        )
    if not drift:
        return None
    shown = [_drift_line(change) for change in drift[:_DRIFT_SHOWN]]
    if len(drift) > _DRIFT_SHOWN:
        shown.append(f"{len(drift) - _DRIFT_SHOWN} more")
    return (
        f"The database's topology is not the one WORKQUEUE['TOPOLOGY'] declares "
        f"({'; '.join(shown)}): run `manage.py workqueue sync-topology` (after `migrate`) to "
        "apply it."
    )


#: How many of the differences a drift warning names.
_DRIFT_SHOWN = 5


def _drift_line(change: TopologyChange) -> str:
    if change.action == "create":
        return f"{change.kind} {change.name} does not exist"
    return f"{change.kind} {change.name} differs in {', '.join(change.fields)}"


def _declared_changes(
    declared: dict[str, dict[str, dict[str, Any]]], alias: str, *, save: bool
) -> tuple[list[TopologyChange], dict[str, Model], dict[str, Model]]:
    """The declared rows' changes, saved when ``save``; with the topics and subscriptions by
    name (declared and stored). Raises ``TopologySyncError`` naming every invalid row."""
    from workqueue.models import Subscription, Topic, Transport

    changes: list[TopologyChange] = []
    problems: list[str] = []
    transports = {t.name: t for t in Transport.objects.using(alias)}
    seeded = Transport.seeded()
    if (
        seeded.name not in transports
        # Renamed in the admin, it is still there: declared topics then name a transport
        # that does not exist, said as such.
        and all(transport.pk != seeded.pk for transport in transports.values())
        and any(
            values.get("transport", seeded.name) == seeded.name
            for values in declared["topics"].values()
        )
    ):
        # The transport `migrate` seeds, gone after a transactional test's flush (Django's
        # TransactionTestCase, pytest-django's transactional_db): made again, as migrated.
        if save:
            seeded.save(using=alias)
        transports[seeded.name] = seeded
        changes.append(TopologyChange("create", "transport", seeded.name))
    topics = {t.name: t for t in Topic.objects.using(alias).select_related("transport")}
    for name, values in declared["topics"].items():
        values = dict(values)
        transport_name = values.pop("transport", seeded.name)
        if transport_name not in transports:
            problems.append(f"topic {name}: transport: no transport is named {transport_name!r}.")
            continue
        if transports[transport_name]._state.adding:
            # On the transport still to make (``save`` is off): to create with it, and
            # validated when the sync makes both.
            changes.append(TopologyChange("create", "topic", name))
            topics[name] = Topic(name=name, transport=transports[transport_name])
            continue
        values["transport"] = transports[transport_name]
        row = topics.get(name) or Topic(name=name, transport=transports[transport_name])
        change = _declare(row, "topic", values, alias, problems, save=save)
        if change is not None:
            changes.append(change)
            topics[name] = row
    subscriptions = {s.name: s for s in Subscription.objects.using(alias).select_related("topic")}
    for name, values in declared["subscriptions"].items():
        values = dict(values)
        topic = topics.get(values["topic"])
        if topic is None:
            problems.append(
                f"subscription {name}: topic: no topic is named {values['topic']!r} "
                '(declare it under "topics" or create it first).'
            )
            continue
        if topic._state.adding:
            # A topic still to create (``save`` is off): the subscription is to create, or to
            # move to it, and is validated when the sync does both.
            stored = subscriptions.get(name)
            if stored is None:
                changes.append(TopologyChange("create", "subscription", name))
            else:
                moved = {"topic": (str(stored.topic), values["topic"])}
                changes.append(TopologyChange("update", "subscription", name, moved))
            continue
        values["topic"] = topic
        row = subscriptions.get(name) or Subscription(name=name, topic=topic)
        change = _declare(row, "subscription", values, alias, problems, save=save)
        if change is not None:
            changes.append(change)
    if problems:
        raise TopologySyncError(problems)
    return changes, topics, subscriptions


def _declare(
    row: Model,
    kind: str,
    values: dict[str, Any],
    alias: str,
    problems: list[str],
    *,
    save: bool,
) -> TopologyChange | None:
    """Set ``values`` on ``row`` and validate it as the admin does; the change this makes (saved
    when ``save``), or None when nothing differs. A validation failure is added to
    ``problems``."""
    creating = row._state.adding
    before = {name: _shown(getattr(row, name)) for name in values}
    if not creating and all(before[name] == _shown(value) for name, value in values.items()):
        # Declared as stored (and the stored row passed these rules when written): nothing to
        # validate, which would cost a dozen queries a row at every host start.
        return None
    for name, value in values.items():
        setattr(row, name, value)
    try:
        # The admin's validation; it also stores the filter in its canonical form, so a filter
        # written differently but meaning the same is not a difference.
        row.full_clean()
    except ValidationError as exc:
        for name, messages in exc.message_dict.items():
            problems.append(f"{kind} {row}: {name}: {' '.join(messages)}")
        return None
    after = {name: _shown(getattr(row, name)) for name in values}
    differing = {n: (before[n], after[n]) for n in values if before[n] != after[n]}
    if creating:
        if save:
            row.save(using=alias)
        return TopologyChange("create", kind, str(row), {n: (None, v) for n, v in after.items()})
    if not differing:
        return None
    if save:
        row.save(using=alias, update_fields=list(differing))
    return TopologyChange("update", kind, str(row), differing)


def _shown(value: Any) -> Any:
    # Related rows compare and print by name, as they are declared.
    return str(value) if isinstance(value, Model) else value


def _undeclared(row: Model, kind: str, prune: bool, alias: str) -> TopologyChange:
    name = str(row)
    if _is_tasks_queue(row, kind, alias):
        # Made by the first enqueue, never declared: pruning an idle one would leave a
        # deployment whose runtime role may not create topology unable to enqueue on it.
        return TopologyChange("keep", kind, name, note="not declared; kept (a Tasks API queue)")
    if not prune:
        return TopologyChange("keep", kind, name, note="not declared; kept (--prune deletes it)")
    blocker = _delete_blocker(row, kind)
    if blocker is None:
        try:
            # A savepoint: a row that gained a dependant since the check above is refused
            # alone, and the rest of the sync still applies.
            with transaction.atomic(using=alias):
                row.delete(using=alias)
            return TopologyChange("delete", kind, name, note="not declared; deleted (--prune)")
        except ProtectedError:
            blocker = "it gained deliveries or dependants meanwhile"
    return TopologyChange("refuse", kind, name, note=f"not declared, but not deleted: {blocker}")


def _is_tasks_queue(row: Model, kind: str, alias: str) -> bool:
    """Whether ``row`` is a Tasks API queue's subscription, or the topic it runs on (both are
    named after the queue)."""
    from workqueue.models import Subscription, Topic
    from workqueue.tasks.messages import HANDLER_KEY

    if kind == "subscription":
        return row.handler_key == HANDLER_KEY and (
            Topic.objects.using(alias).filter(pk=row.topic_id, name=row.name).exists()
        )
    return (
        Subscription.objects.using(alias)
        .filter(topic=row, name=row.name, handler_key=HANDLER_KEY)
        .exists()
    )


def _delete_blocker(row: Model, kind: str) -> str | None:
    from workqueue.models import Delivery, Message

    if kind == "subscription":
        count = Delivery.objects.filter(subscription=row).count()
        if count:
            return (
                f"it has {count} deliveries; retire it with "
                f"`manage.py workqueue retire-subscription {row}`"
            )
        return None
    if row.subscriptions.exists():  # type: ignore[attr-defined]
        return "subscriptions still use it"
    if Message.objects.filter(topic=row).exists():
        return "it still has messages (retention purges them)"
    return None


@dataclass(frozen=True, slots=True)
class ProvisionReport:
    """What ``provision`` did (or, on a dry run, would do), by transport name."""

    dry_run: bool
    changes: dict[str, list[ProvisionChange]]

    @property
    def writes(self) -> int:
        return sum(
            c.action not in ("keep", "refuse") for found in self.changes.values() for c in found
        )


def provision(transport_name: str | None = None, *, dry_run: bool = False) -> ProvisionReport:
    """Create or update the cloud resources of every Active transport (or the one named) for
    its topics and subscriptions: SNS topics, SQS queues and subscriptions on AWS; nothing on
    the Database transport, whose tables the migrations create."""
    # Imported here: topology is read only when called (keeps imports cheap).
    from workqueue.models import Transport

    rows = Transport.objects.order_by("name")
    if transport_name is not None:
        rows = rows.filter(name=transport_name)
        if not rows.exists():
            raise NotFoundError(f"No transport is named {transport_name!r}.")
    else:
        rows = rows.filter(status="Active")
    changes = {row.name: row.transport_class().provision(row, dry_run=dry_run) for row in rows}
    return ProvisionReport(dry_run, changes)
