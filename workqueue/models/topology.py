"""Topology: transports, topics and subscriptions (ordinary, validated Django models).

A row the admin would refuse cannot be written from code either. The admin's form runs
``full_clean()``; every other ORM write runs the same rules (the fields' validators and the
model's ``check_rules()``, which ``clean()`` also runs) before it writes: ``save()`` (so
``objects.create`` and ``update_or_create``) and ``loaddata`` through the ``pre_save`` signal
(connected in ``WorkqueueConfig.ready``, which also fires for fixtures' raw saves), queryset
``update()`` (so ``bulk_update``) and ``bulk_create`` through ``TopologyQuerySet``. A refusal is
a ``TopologyValidationError`` naming the row, the field and the fix. The database guards what it
can on its own: CHECK constraints, and ``wq_sub_filter_valid`` for filters (filters.sql).
"""

from __future__ import annotations

import math
import re
import uuid
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ObjectDoesNotExist, ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import connections, models, router, transaction
from django.db.models import Q, QuerySet

from workqueue.exceptions import TopologyValidationError, WorkQueueConfigurationError
from workqueue.filters import FilterError, parse_filter, stored_filter_problem
from workqueue.types import (
    MAX_PAYLOAD_BYTES,
    HeartbeatMode,
    HostType,
    PartitionMode,
    SubscriptionStatus,
    TopologyStatus,
)

if TYPE_CHECKING:
    from workqueue.transports import BaseTransport

DATABASE_DRIVER = "Database"
#: The longest a topic keeps its settled work: a hundred years. The purges count every
#: topic's cutoff back from now in one statement, and "for ever" written as millions of days
#: took it out of the database's range, stopping every topic's retention.
MAX_RETENTION_DAYS = 36_500
#: The id migration 0003 gives the ``Database`` transport it seeds (fixed, so that topology
#: dumped in one environment loads into another).
SEEDED_TRANSPORT_ID = uuid.UUID("e39b2117-80ac-49fd-9883-79105f406947")

# Topic and subscription names: lower-case words of letters and digits joined by '.', '_' or '-'.
# \A...\Z, not ^...$: RegexValidator searches, and `$` also matches before a trailing newline.
DOTTED_NAME = re.compile(r"\A[a-z0-9]+(?:[._-][a-z0-9]+)*\Z")
TRANSPORT_NAME = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]*\Z")

dotted_name_validator = RegexValidator(
    DOTTED_NAME,
    "Use lower-case words of letters and digits joined by '.', '_' or '-' (e.g. orders.created).",
)
transport_name_validator = RegexValidator(
    TRANSPORT_NAME, "Use letters, digits, '.', '_' or '-', starting with a letter or digit."
)


def _require_json_object(value: Any, field: str) -> None:
    if value is not None and not isinstance(value, dict):
        raise ValidationError({field: "Must be a JSON object."})


# Prefix of the annotations that compute what a queryset update() would write.
_NEW_VALUE = "wq_new_"


class TopologyQuerySet(models.QuerySet):
    """Holds the queryset writes that skip ``save()`` to the model's rules: ``bulk_create``
    checks each new row; ``update()`` (which ``bulk_update`` uses, its objects' values in their
    stored form) computes each row's new values, checks them, then writes, in one
    transaction."""

    def bulk_create(self, objs: Any, *args: Any, **kwargs: Any) -> list[Any]:
        self._for_write = True
        objs = list(objs)
        with transaction.atomic(using=self.db):
            for obj in objs:
                obj.validate_for_write(self.db)
            return super().bulk_create(objs, *args, **kwargs)

    def bulk_update(self, objs: Any, fields: Any, *args: Any, **kwargs: Any) -> int:
        # update() checks the values of the Case that bulk_update builds, but writes the Case:
        # the objects' values go in as given unless put in their stored form first.
        objs = list(objs)
        for obj in objs:
            given = {name: getattr(obj, name) for name in fields}
            for name, value in self.model.normalise_update(given).items():
                if value is not given[name]:
                    setattr(obj, name, value)
        return super().bulk_update(objs, fields, *args, **kwargs)

    def update(self, **kwargs: Any) -> int:
        if self.query.is_sliced:
            raise TypeError("Cannot update a query once a slice has been taken.")
        self._for_write = True
        values = self.model.normalise_update(kwargs)
        meta = self.model._meta
        # Expressions (F(), the Case that bulk_update builds, ...) are computed by the database:
        # selected as annotations first, they can be checked before anything is written, which
        # the tables' own CHECK constraints would otherwise refuse with a bare IntegrityError.
        expressions = {n: v for n, v in values.items() if hasattr(v, "resolve_expression")}
        rows = self.model._base_manager.db_manager(self.db)
        with transaction.atomic(using=self.db):
            changed = list(
                rows.filter(pk__in=self.values("pk")).annotate(
                    **{_NEW_VALUE + name: value for name, value in expressions.items()}
                )
            )
            for row in changed:
                for name, value in values.items():
                    field = meta.get_field(name)
                    if name in expressions:
                        setattr(row, field.attname, getattr(row, _NEW_VALUE + name))
                    elif field.is_relation and isinstance(value, models.Model):
                        setattr(row, field.name, value)
                    else:
                        setattr(row, field.attname, value)
                row.validate_for_write(self.db)
            pks = [row.pk for row in changed]
            count = rows.filter(pk__in=pks).update(**values)
            if expressions:
                # The expressions ran again in the UPDATE; check what they wrote, now that this
                # transaction holds the rows, in case a field they read changed in between.
                for row in rows.filter(pk__in=pks):
                    row.validate_for_write(self.db)
            return count


class TopologyModel(models.Model):
    """Base of the topology models: the admin's rules hold on every write path."""

    objects = TopologyQuerySet.as_manager()

    class Meta:
        abstract = True

    def clean(self) -> None:
        self.check_rules(self._state.db or router.db_for_write(type(self), instance=self))

    def check_rules(self, using: str) -> None:
        """Raise ``ValidationError`` by field for what breaks the model's own rules (may read
        database ``using``, and normalise values in place)."""

    @classmethod
    def normalise_update(cls, values: dict[str, Any]) -> dict[str, Any]:
        """The values a queryset ``update()`` writes, in their stored form."""
        return values

    def save(self, *args: Any, **kwargs: Any) -> None:
        # One transaction for the check (pre_save) and the write, so a check that takes a
        # topic's topology lock (a partition-mode change, a move off the queue tables) holds it
        # until the row is written.
        using = kwargs.get("using") or router.db_for_write(type(self), instance=self)
        with transaction.atomic(using=using):
            super().save(*args, **kwargs)

    def validate_for_write(self, using: str) -> None:
        """Refuse to write a row the admin would refuse: the fields' validators and
        ``check_rules()``. The primary key and foreign keys are the database's to check
        (``loaddata`` may write a row before the row it points to, checked at commit)."""
        keys = [f.name for f in self._meta.concrete_fields if f.primary_key or f.is_relation]
        errors: dict[str, list[ValidationError]] = {}
        try:
            self.clean_fields(exclude=keys)
        except ValidationError as exc:
            errors = exc.update_error_dict(errors)
        try:
            self.check_rules(using)
        except ValidationError as exc:
            errors = exc.update_error_dict(errors)
        if errors:
            raise TopologyValidationError(f"{type(self).__name__} '{self}'", errors)


def validate_topology_write(
    sender: Any, instance: TopologyModel, using: str, **kwargs: Any
) -> None:
    """``pre_save`` receiver: saves and fixtures (raw saves included) pass the admin's rules."""
    instance.validate_for_write(using)


class Transport(TopologyModel):
    """Where a topic's messages live. ``Database`` keeps them in this database's queue tables."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=100, unique=True, validators=[transport_name_validator])
    description = models.TextField(blank=True, default="")
    driver_class = models.CharField(max_length=100, default=DATABASE_DRIVER)
    configuration = models.JSONField(null=True, blank=True)
    status = models.CharField(
        max_length=20, choices=TopologyStatus.choices, default=TopologyStatus.ACTIVE
    )

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=Q(status__in=TopologyStatus.values), name="wq_transport_status_valid"
            ),
        ]

    def __str__(self) -> str:
        return self.name

    @classmethod
    def seeded(cls) -> Transport:
        """The ``Database`` transport as migration 0003 seeds it (unsaved), fixed id included:
        a transactional test's flush empties the table, and ``sync-topology`` makes it again
        for the topics declared on it."""
        return cls(
            id=SEEDED_TRANSPORT_ID,
            name=DATABASE_DRIVER,
            driver_class=DATABASE_DRIVER,
            description="Messages and deliveries live in this database's queue tables.",
        )

    @property
    def transport_class(self) -> type[BaseTransport]:
        """The registered transport class ``driver_class`` names (its capabilities and
        operations); raises ``WorkQueueConfigurationError`` for an unregistered name."""
        from workqueue.transports import transport_class

        return transport_class(self.driver_class)

    def check_rules(self, using: str) -> None:
        from workqueue.transports import driver_names

        _require_json_object(self.configuration, "configuration")
        if self.driver_class not in driver_names():
            raise ValidationError(
                {
                    "driver_class": f"No transport is registered as {self.driver_class!r}; "
                    f"choose one of: {', '.join(driver_names())}."
                }
            )
        problem = self.transport_class.configuration_problem(self.configuration)
        if problem is not None:
            raise ValidationError({"configuration": problem})
        # Locked before the topics are looked for, and held until the row is written: a topic
        # moving here at the same time (which locks this row first) is either seen below or
        # reads the new driver once this commits.
        stored = _locked(type(self)._base_manager.using(using).filter(pk=self.pk), using)
        driver = stored.values_list("driver_class", flat=True).first()
        if (
            driver not in (None, self.driver_class)
            and not _both_keep_deliveries_in_database(driver, self.driver_class)
            and self.topics.using(using).exists()
        ):
            # The topics' waiting work is where the old driver keeps it (the queue tables, or
            # queues named after them), which the new one would never read.
            raise ValidationError(
                {
                    "driver_class": f"Topics use this transport, and their waiting work is "
                    f"where the {driver} driver keeps it: the driver cannot change under them. "
                    f"Make a transport with the {self.driver_class} driver and move the topics "
                    "to it once their work is drained."
                }
            )


# A Tasks API message names the task to import and run, with its arguments: whoever may
# publish to the topic may run any task of the project with any arguments.
EXTERNAL_TASKS_PROBLEM = (
    "A topic that allows external publishing cannot be read by the Tasks API's handler "
    "(workqueue.tasks): any holder of a publish key for it could run any task with any "
    "arguments. Leave allow_external_publish off on task topics, or give the subscription "
    "another handler."
)


def _tasks_handler_key() -> str:
    # Imported here: the tasks package imports the models.
    from workqueue.tasks.messages import HANDLER_KEY

    return HANDLER_KEY


def _supports_external(transport: Transport) -> bool:
    try:
        return transport.transport_class.supports_external_consumers
    except WorkQueueConfigurationError:
        return True  # an unregistered driver is refused on the transport's own row


def _renamed_resources_problem(
    row: TopologyModel, using: str, fields: dict[str, str], transport_column: str
) -> dict[str, str]:
    """For each of ``fields`` (the field, its column) that this write changes, why it may not,
    when the transport the stored row is on names its resources after them: its old queues
    would keep their waiting work, read by nobody (audit helper-92 found a topic made FIFO
    stranding its messages). ``transport_column`` reads the stored row's transport."""
    stored = (
        type(row)
        ._base_manager.using(using)
        .filter(pk=row.pk)
        .values(*fields.values(), transport_column)
        .first()
    )
    if stored is None:
        return {}
    changed = [field for field, column in fields.items() if stored[column] != getattr(row, column)]
    if not changed:
        return {}
    transport = Transport._base_manager.using(using).filter(pk=stored[transport_column]).first()
    try:
        names_resources = transport is not None and (
            transport.transport_class.names_resources_after_topology
        )
    except WorkQueueConfigurationError:
        return {}  # an unregistered driver is refused on the transport's own row
    if not names_resources:
        return {}
    problem = (
        f"The {transport.driver_class} transport names its resources after this: changed, "
        "provisioning would make new ones, and the messages waiting in the old ones would be "
        "read by nobody. Make a new one instead, and retire this one once it is drained."
    )
    return dict.fromkeys(changed, problem)


def _both_keep_deliveries_in_database(driver: str, other: str) -> bool:
    """Whether two drivers both keep deliveries in the queue tables (Database and its variants),
    so that a transport may change from one to the other under its topics."""
    from workqueue.transports import transport_class

    try:
        return all(transport_class(name).keeps_deliveries_in_database for name in (driver, other))
    except WorkQueueConfigurationError:
        return False  # an unregistered driver: refused on its own, or its work is unknown


def _lock_topology(using: str, topic_ids: set[Any]) -> None:
    """Take the topology lock of each of ``topic_ids`` exclusively until the transaction ends
    (publishes hold it shared while they fan out), in one order (by id), so two writes locking
    the same topics the opposite way wait for each other instead of deadlocking. Outside a
    transaction there is nothing to hold it for."""
    connection = connections[using]
    if not connection.in_atomic_block:
        return
    # Imported here: models must not depend on the driver at import time.
    from workqueue.driver import get_driver

    for topic_id in sorted(topic_ids, key=str):
        get_driver(using).call("wq_lock_topology", {"topic_id": topic_id}, connection=connection)


def _locked(rows: QuerySet, using: str) -> QuerySet:
    """``rows`` read FOR UPDATE, in primary key order, when a transaction holds the locks until
    this write commits; as they are otherwise."""
    rows = rows.order_by("pk")
    return rows.select_for_update() if connections[using].in_atomic_block else rows


def _stranded_work_problem(
    using: str, leaving_id: Any, joining_id: Any, topic_ids: set[Any], deliveries: Q
) -> str | None:
    """Why a move from the transport ``leaving_id`` to ``joining_id`` must wait, or None.

    Once on a transport that does not keep deliveries in this database, a subscription is run
    by that transport's receiver and the operators' procedures refuse it, so what still waits
    in the queue tables (the ``deliveries`` Pending, in flight or dead-lettered) would be read
    by nobody, with no way back (audit helper-129). ``topic_ids`` are the topics whose
    publishes may be writing such deliveries right now: their topology lock is taken before
    the deliveries are looked for, so those publishes are seen and later ones see the move.

    Two such writes at once wait for each other on the rows they read, taken in one order:
    topics' rows, then transports' rows, then topology locks (audit helper-131's residual)."""
    if leaving_id is None or joining_id is None or leaving_id == joining_id:
        return None
    # Locked whether or not this move strands anything: a change of the joining transport's
    # driver (which locks its row before it looks for topics) waits, then sees this topic; or
    # this move waits for it, then reads the new driver. (Rows, not the topology lock: that
    # one would make every move wait for the topics' publishes, a running task's enqueue
    # holding it until the task commits.)
    transports = _locked(Transport._base_manager.using(using), using)
    transports = transports.in_bulk([leaving_id, joining_id])
    leaving, joining = transports.get(leaving_id), transports.get(joining_id)
    try:
        stranded = (
            leaving is not None
            and joining is not None
            and leaving.transport_class.keeps_deliveries_in_database
            and not joining.transport_class.keeps_deliveries_in_database
        )
    except WorkQueueConfigurationError:
        return None  # an unregistered driver is refused on the transport's own row
    if not stranded:
        return None
    # Imported here: models must not depend on the queue tables at import time.
    from workqueue.models.queue import OPEN_STATUSES, Delivery

    _lock_topology(using, topic_ids)
    waiting = Delivery._base_manager.using(using).filter(deliveries, status__in=OPEN_STATUSES)
    if not waiting.exists():
        return None
    return (
        f"Deliveries still wait in the database on the {leaving.driver_class} transport "
        f"(Pending, in flight or dead-lettered); on {joining.name!r} hosts would no longer read "
        "them, and operators could not replay or discard them. Let them finish, replay or "
        "discard the dead letters (manage.py workqueue stats), then move it; or make a new one "
        f"on {joining.name!r} and retire this one once it is drained."
    )


class Topic(TopologyModel):
    """A named stream of messages; each publish fans out to the topic's subscriptions."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=200, unique=True, validators=[dotted_name_validator])
    description = models.TextField(blank=True, default="")
    transport = models.ForeignKey(Transport, on_delete=models.PROTECT, related_name="topics")
    is_fifo = models.BooleanField(default=False)
    allow_external_publish = models.BooleanField(
        default=False, help_text="Allow publishing through the REST API (with an API key)."
    )
    max_payload_bytes = models.PositiveIntegerField(
        default=MAX_PAYLOAD_BYTES,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_PAYLOAD_BYTES)],
    )
    default_deduplication_ttl_seconds = models.PositiveIntegerField(
        default=86_400, validators=[MinValueValidator(60), MaxValueValidator(2_592_000)]
    )
    retention_days = models.PositiveIntegerField(
        default=7,
        validators=[
            MinValueValidator(1),
            MaxValueValidator(
                MAX_RETENTION_DAYS,
                f"Keep settled work at most {MAX_RETENTION_DAYS} days (100 years): the "
                "longest retention the purges can count back.",
            ),
        ],
    )
    binding_config = models.JSONField(null=True, blank=True)
    status = models.CharField(
        max_length=20, choices=TopologyStatus.choices, default=TopologyStatus.ACTIVE
    )

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=Q(max_payload_bytes__gt=0, max_payload_bytes__lte=MAX_PAYLOAD_BYTES),
                name="wq_topic_max_payload_range",
            ),
            models.CheckConstraint(
                condition=Q(default_deduplication_ttl_seconds__gte=60),
                name="wq_topic_dedup_ttl_min",
            ),
            models.CheckConstraint(
                condition=Q(retention_days__gte=1, retention_days__lte=MAX_RETENTION_DAYS),
                name="wq_topic_retention_range",
            ),
            models.CheckConstraint(
                condition=Q(status__in=TopologyStatus.values), name="wq_topic_status_valid"
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def check_rules(self, using: str) -> None:
        _require_json_object(self.binding_config, "binding_config")
        if self.allow_external_publish and self.is_read_by_tasks(using):
            raise ValidationError({"allow_external_publish": EXTERNAL_TASKS_PROBLEM})
        fields = {"name": "name", "is_fifo": "is_fifo", "transport": "transport_id"}
        if problems := _renamed_resources_problem(self, using, fields, "transport_id"):
            raise ValidationError(problems)
        # Locked first: a subscription moving here at the same time (which locks this row
        # before it reads the transport) is either seen below, or reads the new transport.
        stored = _locked(type(self)._base_manager.using(using).filter(pk=self.pk), using)
        if problem := _stranded_work_problem(
            using,
            stored.values_list("transport_id", flat=True).first(),
            self.transport_id,
            {self.pk},
            Q(subscription__topic_id=self.pk),
        ):
            raise ValidationError({"transport": problem})

    def is_read_by_tasks(self, using: str | None = None) -> bool:
        """Whether a subscription runs this topic's messages as Tasks API tasks."""
        keys = Subscription._base_manager.using(using).filter(topic_id=self.pk)
        return any(
            key.strip() == _tasks_handler_key()
            for key in keys.values_list("handler_key", flat=True)
        )


class Subscription(TopologyModel):
    """A consumer's view of a topic: its own delivery per message, claim rules and retry policy."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    topic = models.ForeignKey(Topic, on_delete=models.PROTECT, related_name="subscriptions")
    name = models.CharField(max_length=200, unique=True, validators=[dotted_name_validator])
    description = models.TextField(blank=True, default="")
    filter = models.JSONField(
        null=True,
        blank=True,
        help_text='Attribute filter, e.g. {"logic": "and", "filters": '
        '[{"field": "region", "operator": "eq", "value": "eu"}]}. Empty matches every message.',
    )
    partition_mode = models.CharField(
        max_length=20, choices=PartitionMode.choices, default=PartitionMode.NONE
    )
    max_attempts = models.PositiveIntegerField(default=5, validators=[MinValueValidator(1)])
    backoff_base_seconds = models.PositiveIntegerField(default=10)
    backoff_max_seconds = models.PositiveIntegerField(default=900)
    lease_seconds = models.PositiveIntegerField(default=60, validators=[MinValueValidator(5)])
    heartbeat_mode = models.CharField(
        max_length=20, choices=HeartbeatMode.choices, default=HeartbeatMode.AUTO
    )
    max_processing_seconds = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)]
    )
    rate_limit_per_second = models.FloatField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0.001), MaxValueValidator(1_000_000)],
        help_text="Most deliveries started per second across every host together (e.g. 0.5 for "
        "30 a minute). Empty: no limit. Deliveries over the limit wait Pending; they never fail.",
    )
    rate_limit_burst = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="How many may start at once after a quiet spell. Empty: the rate rounded up "
        "(at least 1).",
    )
    host_type = models.CharField(max_length=20, choices=HostType.choices, default=HostType.WORKER)
    handler_key = models.CharField(max_length=200, blank=True, default="")
    external_ref = models.CharField(max_length=500, blank=True, default="")
    binding_config = models.JSONField(null=True, blank=True)
    status = models.CharField(
        max_length=20, choices=SubscriptionStatus.choices, default=SubscriptionStatus.ACTIVE
    )

    class Meta:
        ordering = ["name"]
        # Apart from change_subscription, which edits topic and filter (where messages go).
        permissions = [("operate_subscription", "Can replay, discard and cancel deliveries")]
        constraints = [
            models.CheckConstraint(condition=Q(max_attempts__gte=1), name="wq_sub_attempts_min"),
            models.CheckConstraint(condition=Q(lease_seconds__gte=5), name="wq_sub_lease_min"),
            models.CheckConstraint(
                condition=Q(backoff_max_seconds__gte=models.F("backoff_base_seconds")),
                name="wq_sub_backoff_order",
            ),
            models.CheckConstraint(
                condition=Q(max_processing_seconds__isnull=True) | Q(max_processing_seconds__gt=0),
                name="wq_sub_max_processing_pos",
            ),
            models.CheckConstraint(
                condition=Q(rate_limit_per_second__isnull=True)
                | Q(rate_limit_per_second__gte=0.001, rate_limit_per_second__lte=1_000_000),
                name="wq_sub_rate_limit_range",
            ),
            models.CheckConstraint(
                condition=Q(rate_limit_burst__isnull=True) | Q(rate_limit_burst__gte=1),
                name="wq_sub_rate_burst_min",
            ),
            models.CheckConstraint(
                condition=Q(partition_mode__in=PartitionMode.values), name="wq_sub_mode_valid"
            ),
            models.CheckConstraint(
                condition=Q(status__in=SubscriptionStatus.values), name="wq_sub_status_valid"
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def check_rules(self, using: str) -> None:
        errors: dict[str, str] = {}
        # Stored as hosts read it (the registry strips keys): code that looks for a handler's
        # subscriptions by key (the Tasks API's results, signals and purges) finds this one.
        self.handler_key = self.handler_key.strip()
        try:
            parsed = parse_filter(self.filter)
        except FilterError as exc:
            errors["filter"] = str(exc)
        else:
            self.filter = parsed.to_json() if parsed is not None else None
        rate = self.rate_limit_per_second
        try:
            finite = rate is None or math.isfinite(float(rate))
        except (TypeError, ValueError):
            finite = False  # "20/s" from a topology file, say
        if not finite:
            # NaN slips past the range validators: no comparison holds for it.
            errors["rate_limit_per_second"] = (
                "Must be a number from 0.001 to 1,000,000 (deliveries started per second), or "
                "empty for no limit."
            )
        if rate is None and self.rate_limit_burst is not None:
            errors["rate_limit_burst"] = (
                "A burst needs a rate: set rate_limit_per_second too, or clear the burst (it "
                "limits nothing on its own)."
            )
        if self.backoff_max_seconds < self.backoff_base_seconds:
            errors["backoff_max_seconds"] = (
                "Must be at least backoff_base_seconds "
                f"({self.backoff_base_seconds}); raise it or lower the base."
            )
        if problem := (
            self.external_tasks_problem()
            or self._work_becoming_tasks_problem(using)
            or self._second_tasks_runner_problem(using)
        ):
            errors["handler_key"] = problem
        if self.host_type == HostType.WORKER and not self.handler_key.strip():
            errors["handler_key"] = (
                "A work-queue host subscription needs the handler key to run: set it to the key "
                "its handler is registered under (@register_handler)."
            )
        errors.update(
            _renamed_resources_problem(
                self, using, {"name": "name", "topic": "topic_id"}, "topic__transport_id"
            )
        )
        if "topic" not in errors and (problem := self._stranded_work_problem(using)):
            errors["topic"] = problem
        if self.host_type != HostType.WORKER:
            transport = self._transport()
            if transport is not None and not _supports_external(transport):
                errors["host_type"] = (
                    "External consumers need supports_external_consumers, which the "
                    f"{transport.driver_class} transport {transport.name!r} does not have; use "
                    f"{HostType.WORKER.value!r}."
                )
        try:
            _require_json_object(self.binding_config, "binding_config")
        except ValidationError as exc:
            errors.update({k: v[0] for k, v in exc.message_dict.items()})
        transport = self._transport()
        if transport is not None and "filter" not in errors:
            try:
                transport_class = transport.transport_class
            except WorkQueueConfigurationError:
                pass  # an unregistered driver is refused on the transport's own row
            else:
                for field, problem in transport_class.subscription_field_problems(
                    self, transport.configuration
                ).items():
                    errors.setdefault(field, problem)
        mode_error = self.partition_mode_change_error(using)
        if mode_error:
            errors["partition_mode"] = mode_error
        if errors:
            raise ValidationError(errors)

    @classmethod
    def normalise_update(cls, values: dict[str, Any]) -> dict[str, Any]:
        # The same canonical form save() stores; a filter that does not parse is left for the
        # row-by-row check to refuse, naming the subscription.
        key = values.get("handler_key")
        if isinstance(key, str):
            values = {**values, "handler_key": key.strip()}
        raw = values.get("filter")
        if raw is None or hasattr(raw, "resolve_expression"):
            return values
        try:
            parsed = parse_filter(raw)
        except FilterError:
            return values
        return {**values, "filter": parsed.to_json() if parsed is not None else None}

    def _stranded_work_problem(self, using: str) -> str | None:
        """Why this move to another topic must wait: see ``_stranded_work_problem``."""
        stored = type(self)._base_manager.using(using).filter(pk=self.pk).values("topic_id").first()
        if stored is None or stored["topic_id"] == self.topic_id:
            return None
        # Both topics' rows locked before their transports are read: a topic leaving the
        # database at the same time (which locks its row before it looks for waiting work) is
        # either read here on its new transport, or sees this subscription's work once this
        # commits.
        topics = _locked(Topic._base_manager.using(using), using).in_bulk(
            [stored["topic_id"], self.topic_id]
        )
        leaving, joining = topics.get(stored["topic_id"]), topics.get(self.topic_id)
        if leaving is None or joining is None:
            return None  # a fixture's topic not loaded yet; its foreign key is checked at commit
        return _stranded_work_problem(
            using,
            leaving.transport_id,
            joining.transport_id,
            {leaving.pk, joining.pk},
            Q(subscription_id=self.pk),
        )

    def _transport(self) -> Transport | None:
        if not self.topic_id:
            return None
        try:
            return self.topic.transport
        except ObjectDoesNotExist:
            return None  # a fixture's topic not loaded yet; its foreign key is checked at commit

    def _work_becoming_tasks_problem(self, using: str) -> str | None:
        """Why this subscription may not start running its waiting work as Tasks API tasks.

        A message names the task to import and run, with its arguments: work an API key
        published while the topic allowed external publishing (closed since, as the Tasks
        API's handler requires) would run as any task of the project, as the system user, once
        the subscription had that handler: pending, in flight, or dead-lettered (a replay
        would run it) (audit helper-137). Work published by the application (the Tasks API's
        own enqueues, under a mistyped handler key say) may switch."""
        if self.handler_key.strip() != _tasks_handler_key():
            return None
        stored = type(self)._base_manager.using(using).filter(pk=self.pk)
        previous = stored.values_list("handler_key", flat=True).first()
        if previous is None or previous.strip() == _tasks_handler_key():
            return None
        # Imported here: models must not depend on the queue tables at import time.
        from workqueue.models.queue import OPEN_STATUSES, Delivery

        waiting = Delivery._base_manager.using(using).filter(
            subscription_id=self.pk,
            status__in=OPEN_STATUSES,
            message__published_externally=True,
        )
        if not waiting.exists():
            return None
        return (
            "The subscription holds deliveries an API key published over the REST API, or "
            "stored before this release recorded who published them (for its handler "
            f"{previous.strip()!r}), pending, in flight or dead-lettered: run "
            "as Tasks API tasks, each would import and run whatever task its message names. "
            "Let them finish or discard them first, or make a new subscription for the tasks."
        )

    def _second_tasks_runner_problem(self, using: str) -> str | None:
        """Why this subscription may not run its topic's messages as Tasks API tasks: another
        one on the topic does already, and each task would run once for each (review
        helper-192: a queue's subscription renamed, and made again beside it)."""
        if (
            self.handler_key.strip() != _tasks_handler_key()
            or self.status == SubscriptionStatus.DISABLED
            or self.topic_id is None
        ):
            return None
        other = (
            type(self)
            ._base_manager.using(using)
            .filter(topic_id=self.topic_id, handler_key=_tasks_handler_key())
            .exclude(pk=self.pk)
            .exclude(status=SubscriptionStatus.DISABLED)
            .values_list("name", flat=True)
            .first()
        )
        if other is None:
            return None
        return (
            f"Subscription {other!r} already runs this topic's messages as Tasks API tasks: "
            "with a second one each task would run twice. Disable or delete it first, or "
            "disable this one."
        )

    def external_tasks_problem(self) -> str | None:
        """Why this subscription must not run its topic's messages as Tasks API tasks (its
        topic allows external publishing), or None."""
        if self.handler_key.strip() != _tasks_handler_key():
            return None
        try:
            external = self.topic.allow_external_publish
        except ObjectDoesNotExist:
            return None  # no topic yet: refused as a field error
        return EXTERNAL_TASKS_PROBLEM if external else None

    def filter_problem(self) -> str | None:
        """Why the filter this row holds is invalid, or None when it is valid.

        Writes through the ORM and the database's guard keep invalid filters out; one stored
        anyway (raw SQL behind the guard, or a row older than it) matches no message.
        """
        return stored_filter_problem(self.filter)

    def partition_mode_change_error(self, using: str | None = None) -> str | None:
        """Say why the partition mode may not change, or None when the change is allowed.

        Deliveries already written under one mode carry (or lack) partition keys for it, so the
        mode is fixed once the subscription has any delivery. The stored row is read whether or
        not this instance was loaded from it: a fixture overwrites rows it did not load.

        Also takes the topic's topology lock when this write changes what publishes decide
        under it (``_changes_what_publishes_lock``).
        """
        using = using or router.db_for_write(type(self), instance=self)
        rows = type(self)._base_manager.using(using).filter(pk=self.pk)
        previous = rows.values("partition_mode", "status", "filter", "topic_id").first()
        if self.topic_id is not None and self._changes_what_publishes_lock(previous):
            # (No topic yet: refused as a field error.) Publishes hold the topic's topology
            # lock shared while they fan out; taking it exclusive here (until this transaction
            # ends, after the row is written) means deliveries being written right now are seen
            # by the check below, and publishes that start later see this row. A move locks the
            # topic it leaves too: a publish there may be writing this subscription a delivery
            # now.
            _lock_topology(
                using, {self.topic_id, previous["topic_id"] if previous else self.topic_id}
            )
        if previous is None or previous["partition_mode"] == self.partition_mode:
            return None
        if self.partition_mode not in PartitionMode.values:
            # Not a mode at all ('exclusive'): the field's own error says so and lists the
            # choices; a second one about changing the mode pointed at the wrong cause.
            return None
        if self.deliveries.using(using).exists():
            return (
                f"The partition mode cannot change from {previous['partition_mode']} to "
                f"{self.partition_mode} once the subscription has deliveries; create a new "
                "subscription instead."
            )
        return None

    def _changes_what_publishes_lock(self, previous: dict[str, Any] | None) -> bool:
        """Whether publishes in progress must be waited for before this row is written.

        A publish checks for the topic's Ordered subscriptions first, locking the message's
        partition key if there is one, and fans out later, in a statement that sees what has
        committed by then. An Ordered subscription its check did not see (new, enabled again,
        refiltered, moved to the topic, or made Ordered) would get a delivery whose key was
        never locked, and a later publish of that key could commit its ordinal first: the key
        would run out of order. An Ordered subscription moved away must see the deliveries
        publishes to its old topic are writing it for the same reason. A partition-mode change
        must also see every delivery written.
        """
        if previous is not None and previous["partition_mode"] != self.partition_mode:
            return True
        if self.partition_mode != PartitionMode.ORDERED or (
            self.status == SubscriptionStatus.DISABLED
        ):
            return False
        return (
            previous is None
            or previous["status"] == SubscriptionStatus.DISABLED
            or previous["filter"] != self.filter
            or previous["topic_id"] != self.topic_id
        )
