"""The AWS transport: a topic is an SNS topic, a subscription an SQS queue subscribed to it.

Resources (names derived from ``Transport.configuration["prefix"]``, see ``AwsNames``):

* topic ``orders.created`` → SNS topic ``{prefix}-orders--created`` (``.fifo`` when the topic
  is FIFO: ``Topic.is_fifo``);
* subscription ``orders.created.billing`` → SQS queue ``{prefix}-orders--created--billing``
  subscribed with raw message delivery and the subscription's filter as the SNS filter policy,
  and its dead-letter queue ``...-dlq`` (both ``.fifo`` on a FIFO topic). A ``.`` in a name
  becomes ``--`` (names never hold two separators in a row, so the mapping is one to one).

The message body is a JSON envelope holding what the Database transport keeps in its message
row (message id, partition key, correlation id, payload or reference, publisher, time); the
message's attributes travel as SNS/SQS message attributes too, for the filter policy.

Consuming: receive = ReceiveMessage with a short long poll, lease = visibility timeout, lease
token = receipt handle, attempt = ``ApproximateReceiveCount``. SQS accepts a stale receipt
handle (it does not fence), so the receiver fences by its own clock: a settle or heartbeat after
the lease it was granted has run out (less ``LEASE_SAFETY_SECONDS``) answers LeaseLost without
calling SQS. That is weaker than the Database transport's fencing in one place: a holder paused
between that check and SQS's answer (a stop-the-world pause longer than the safety margin) can
still settle a message another consumer has received since.

Deduplication keys, and message ids the publisher chose, use the Database ledger
(``workqueue.transports.ledger``): reserved before the message is sent, then confirmed, or
released when sending failed, so Duplicate and MessageIDConflict answer as on the Database
transport.

Dead letters are moved by the receiver itself (sent to the DLQ with the reason and error as
message attributes, then deleted), so the reason is kept; the queue's redrive policy, at one
receive more than the subscription's ``max_attempts``, is only a backstop for a move cut short.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import math
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

from workqueue.driver.base import canonical_json
from workqueue.exceptions import (
    TransientTransportError,
    TransportUnavailableError,
    UnsupportedByTransportError,
    WorkQueueConfigurationError,
)
from workqueue.filters import AnyOf, AttributeFilter, FilterError, Operator, parse_filter
from workqueue.payload_ref import stored_payload_ref
from workqueue.transport import new_instance_id
from workqueue.transports.base import (
    BaseTransport,
    ProvisionChange,
    TransportReceiver,
    without_url_credentials,
)
from workqueue.transports.ledger import (
    FOLLOWS,
    RESERVATION_SECONDS,
    PublishLedger,
    content_fingerprint,
)
from workqueue.types import (
    Backlog,
    ClaimedDelivery,
    ClaimResult,
    DeadLetterItem,
    DeliveryStatus,
    DiscardResult,
    ExpiredDeadLetter,
    HeartbeatMode,
    LeaseExtension,
    LeaseState,
    PartitionMode,
    PublishErrorCode,
    PublishStatus,
    RateTokens,
    SettleOutcome,
    SettleResult,
    SubscriptionStatus,
    fill_dead_letter_page,
)

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

logger = logging.getLogger(__name__)

AWS_DRIVER = "AWS"
INSTALL_HINT = (
    "The AWS transport needs boto3: install django-workqueue's aws extra "
    '(pip install "django-workqueue[aws] @ file:///path/to/django-workqueue") or boto3 itself.'
)

#: SNS's largest message (body and attributes, as SQS counts them): a publish must fit it.
SQS_MAX_MESSAGE_BYTES = 262_144
#: The largest message an SQS queue may be set to hold (256 KiB was its default until 2025).
SQS_QUEUE_MAX_MESSAGE_BYTES = 1_048_576
SQS_QUEUE_NAME_MAX = 80
SNS_TOPIC_NAME_MAX = 256
SQS_MAX_VISIBILITY_SECONDS = 43_200
SQS_MAX_RETENTION_SECONDS = 1_209_600
SQS_BATCH_MAX = 10
#: The longest a message sent to SQS may wait before it can be received (DelaySeconds).
SQS_MAX_DELAY_SECONDS = 900
#: The largest maxReceiveCount of an SQS redrive policy.
SQS_MAX_RECEIVE_COUNT = 1000
#: SNS refuses a filter policy whose values, multiplied out over its keys, exceed this.
SNS_FILTER_MAX_COMBINATIONS = 150
#: Seconds a receive waits for a message (SQS long polling) before answering empty.
RECEIVE_WAIT_SECONDS = 1
#: A lease counts as lost this long before its visibility timeout runs out, so a settle that
#: passes the check reaches SQS while the timeout still holds (network time, clock drift).
LEASE_SAFETY_SECONDS = 0.5
#: The longest a call on a held message's receipt handle (a heartbeat or a settle) may take,
#: at most (a tenth of a shorter lease, so settles fit between its heartbeats): its client
#: makes one attempt, with connect and read timeouts within it, and the call is made only while
#: more than that is left of the lease. botocore's own retries ran for up to a minute past the
#: check, and a visibility change that landed after another consumer's receive cut that
#: consumer's lease short: two holders at once.
LEASE_CALL_SECONDS = 3.0
#: SQS FIFO answers a ReceiveMessage made again with its ReceiveRequestAttemptId with the
#: messages the first try hid, for up to five minutes; a failed receive's id is made again
#: within this, and within half its lease (the rest of which its messages' handlers get).
RECEIVE_ATTEMPT_REUSE_SECONDS = 240
#: SQS refuses a visibility that ends more than 12 hours after the receive; a retry's delay
#: stops this far short of that (the call takes time to arrive).
VISIBILITY_CAP_MARGIN_SECONDS = 10
#: What an external publisher (an API key) is told when AWS cannot take its messages.
EXTERNAL_UNAVAILABLE_TEXT = (
    "The topic's transport cannot take messages right now; publish again later (the server's "
    "log says why)."
)
#: How many dead letters an operator read looks at, at most (each is received and released).
DEAD_LETTER_SCAN_LIMIT = 1000
#: How long a dead letter stays hidden while an operator read looks at the DLQ.
DEAD_LETTER_SCAN_VISIBILITY = 30
#: How long each receive of that read waits: long polling asks every SQS server, where short
#: polling (0) asks a sample of them and can answer empty while dead letters wait, so a scan
#: that stops at its first empty answer missed some (a replay by id said "not a dead letter").
DEAD_LETTER_SCAN_WAIT_SECONDS = 1
#: Tries of a send made through a one-attempt client (``AwsClients.sns_once``, ``sqs_once``)
#: while it fails in a way that cannot have reached AWS (no connection, throttled), as
#: botocore's three.
ONE_ATTEMPT_SAFE_TRIES = 3

CONFIGURATION_KEYS = ("region", "prefix", "endpoint_url", "profile")
PREFIX = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9_-]{0,39}\Z")
#: A MessageGroupId SNS and SQS FIFO take (with fullmatch).
MESSAGE_GROUP_ID = re.compile(r"[!-~]{1,128}")

# Message attributes the receiver writes on a dead letter (user attributes live in the body).
REASON_ATTRIBUTE = "wq_reason"
ERROR_ATTRIBUTE = "wq_error"
ATTEMPTS_ATTRIBUTE = "wq_attempts"
DEAD_LETTERED_AT_ATTRIBUTE = "wq_dead_lettered_at"
# The delivery id a dead letter had in the subscription's queue (its SQS message id there):
# operators list, replay and discard it by that id, as logs and signals named it.
DELIVERY_ID_ATTRIBUTE = "wq_delivery_id"
#: Sent to SNS with a message that has no attributes of its own: SNS matches no filter policy
#: against a message without attributes, not even ``exists: false``, so an ``isnull`` filter
#: would miss what it matches on the Database transport. Publishers cannot use the prefix, and
#: deliveries take their attributes from the envelope, so it is seen by SNS alone.
NO_ATTRIBUTES_MARKER = {"wq_no_attributes": "1"}


# -- configuration and names ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AwsSettings:
    """``Transport.configuration`` of an AWS transport, checked."""

    region: str
    prefix: str = "wq"
    endpoint_url: str | None = None
    profile: str | None = None

    @classmethod
    def parse(cls, configuration: dict[str, Any] | None) -> AwsSettings:
        problem = configuration_problem(configuration)
        if problem is not None:
            raise WorkQueueConfigurationError(problem)
        assert configuration is not None
        return cls(**{k: configuration[k] for k in CONFIGURATION_KEYS if k in configuration})


def configuration_problem(configuration: dict[str, Any] | None) -> str | None:
    if not configuration:
        return (
            'The AWS transport needs configuration {"region": ...}; optional keys: prefix, '
            "endpoint_url (for a local endpoint), profile."
        )
    unknown = sorted(set(configuration) - set(CONFIGURATION_KEYS))
    if unknown:
        return (
            f"Unknown configuration key(s) {', '.join(unknown)}; the AWS transport takes "
            f"{', '.join(CONFIGURATION_KEYS)}."
        )
    for key in CONFIGURATION_KEYS:
        value = configuration.get(key)
        if key in configuration and (not isinstance(value, str) or not value.strip()):
            return f"configuration key {key!r} must be non-empty text."
    if "region" not in configuration:
        return 'configuration key "region" is required, e.g. "eu-west-1".'
    prefix = configuration.get("prefix", "wq")
    if not PREFIX.match(prefix):
        return (
            "configuration key 'prefix' must be 1 to 40 letters, digits, '_' or '-', starting "
            f"with a letter or digit; got {prefix!r}."
        )
    endpoint = configuration.get("endpoint_url")
    if endpoint is not None:
        # Quoted without its user and password: the text reaches logs, health and the admin.
        shown = without_url_credentials(endpoint)
        if not endpoint.startswith(("http://", "https://")):
            return f"configuration key 'endpoint_url' must be an http(s) URL; got {shown!r}."
        if not _endpoint_botocore_accepts(endpoint):
            return (
                f"configuration key 'endpoint_url' has a host name botocore refuses ({shown!r}):"
                " use letters, digits, '-' and '.' (a docker-compose service named with '_' "
                "needs an alias or its IP address)."
            )
    return None


def _endpoint_botocore_accepts(endpoint: str) -> bool:
    """Whether botocore builds a client for ``endpoint``: it refuses, with the whole URL in
    its error, a host name it calls invalid (an underscore in it, say). True without botocore
    (the transport says then that it needs the extra)."""
    try:
        from botocore.utils import is_valid_endpoint_url, is_valid_ipv6_endpoint_url
    except ImportError:
        return True
    return bool(is_valid_endpoint_url(endpoint) or is_valid_ipv6_endpoint_url(endpoint))


#: Added to a subscription's queue name, the name of its dead-letter queue.
DEAD_LETTER_QUEUE_SUFFIX = "-dlq"


def _resource_part(name: str) -> str:
    return name.replace(".", "--")


@dataclass(frozen=True, slots=True)
class AwsNames:
    """The SNS and SQS names of one subscription's resources."""

    topic: str
    queue: str
    dead_letter_queue: str
    #: The subscription whose dead-letter queue this one's queue would be, if any.
    dead_letter_queue_of: str | None = None

    @classmethod
    def of(cls, prefix: str, topic_name: str, subscription_name: str, fifo: bool) -> AwsNames:
        suffix = ".fifo" if fifo else ""
        queue = f"{prefix}-{_resource_part(subscription_name)}"
        return cls(
            topic=f"{prefix}-{_resource_part(topic_name)}{suffix}",
            queue=f"{queue}{suffix}",
            dead_letter_queue=f"{queue}{DEAD_LETTER_QUEUE_SUFFIX}{suffix}",
            # Subscription names are unique, but "x-dlq"'s queue is "x"'s dead-letter queue:
            # its consumer would run, and by completing delete, x's dead letters, and its own
            # messages would be listed and replayed as x's. (A name never starts with "-", so
            # something is left; "x.dlq" makes "x--dlq", the dead-letter queue of no name.)
            dead_letter_queue_of=subscription_name.removesuffix(DEAD_LETTER_QUEUE_SUFFIX)
            if subscription_name.endswith(DEAD_LETTER_QUEUE_SUFFIX)
            else None,
        )

    def problem(self) -> str | None:
        if self.dead_letter_queue_of is not None:
            return (
                f"On the AWS transport a subscription name may not end in "
                f"{DEAD_LETTER_QUEUE_SUFFIX!r}: its SQS queue {self.queue!r} is the dead-letter "
                f"queue of subscription {self.dead_letter_queue_of!r}. Choose another name."
            )
        if len(self.topic) > SNS_TOPIC_NAME_MAX:
            return (
                f"The SNS topic name {self.topic!r} would be {len(self.topic)} characters; SNS "
                f"allows {SNS_TOPIC_NAME_MAX}. Shorten the topic name or the transport's prefix."
            )
        if len(self.dead_letter_queue) > SQS_QUEUE_NAME_MAX:
            return (
                f"The SQS dead-letter queue name {self.dead_letter_queue!r} would be "
                f"{len(self.dead_letter_queue)} characters; SQS allows {SQS_QUEUE_NAME_MAX}. "
                "Shorten the subscription name or the transport's prefix."
            )
        return None


# -- filters -------------------------------------------------------------------------------

#: The filter policy of a Disabled subscription: it asks for a message attribute no message
#: has (publishers may not use the ``wq_`` prefix), so SNS delivers nothing more to its queue,
#: as publishing fans out nothing more to a Disabled subscription on the Database transport.
#: A subscription whose stored filter is invalid gets it too: such a filter matches nothing.
DISABLED_FILTER_POLICY: dict[str, list[Any]] = {"wq_disabled": [{"exists": True}]}


def filter_policy(attribute_filter: AttributeFilter | None) -> dict[str, list[Any]] | None:
    """The SNS filter policy (on message attributes) that matches what ``attribute_filter``
    matches; None for no filter. Every clause of the filter language has an SNS form, and SNS,
    like the filter, fails every test but ``exists: false`` on an absent attribute."""
    if attribute_filter is None:
        return None
    policy: dict[str, list[Any]] = {}
    for clause in attribute_filter.clauses:
        if isinstance(clause, AnyOf):
            policy[clause.field] = list(clause.values)
            continue
        rule: Any
        if clause.operator is Operator.EQ:
            rule = clause.value
        elif clause.operator is Operator.NEQ:
            rule = {"anything-but": clause.value}
        elif clause.operator is Operator.STARTSWITH:
            rule = {"prefix": clause.value}
        else:
            rule = {"exists": clause.operator is Operator.ISNOTNULL}
        policy[clause.field] = [rule]
    return policy


def filter_policy_problem(attribute_filter: AttributeFilter | None) -> str | None:
    """Why SNS would refuse the translation of ``attribute_filter`` (None when it accepts it)."""
    policy = filter_policy(attribute_filter)
    if policy is None:
        return None
    combinations = math.prod(len(values) for values in policy.values())
    if combinations > SNS_FILTER_MAX_COMBINATIONS:
        return (
            f"On the AWS transport a filter becomes an SNS filter policy, which allows "
            f"{SNS_FILTER_MAX_COMBINATIONS} value combinations; this one has {combinations} "
            "(the product of each field's number of values). List fewer values, or filter on a "
            "Database topic."
        )
    return None


# -- clients -------------------------------------------------------------------------------


class AwsClients:
    """boto3 clients for one configuration, and the queue URLs and topic ARNs they resolved.

    boto3 clients are thread-safe (sessions are not: each configuration makes one session, once,
    under a lock)."""

    def __init__(self, settings: AwsSettings) -> None:
        try:
            import boto3
            import botocore.exceptions
            from botocore.config import Config
        except ImportError as exc:  # boto3 is the optional extra "aws"
            raise WorkQueueConfigurationError(INSTALL_HINT) from exc
        try:
            session = boto3.session.Session(
                profile_name=settings.profile, region_name=settings.region
            )
        except botocore.exceptions.ProfileNotFound as exc:
            raise WorkQueueConfigurationError(
                f"The AWS transport's configuration names the profile {settings.profile!r}, "
                "which this machine's AWS config does not have: set 'profile' to one it has "
                "(or leave it out to use the default credentials)."
            ) from exc
        config = Config(
            retries={"max_attempts": 3, "mode": "standard"},
            connect_timeout=5,
            # A receive waits up to RECEIVE_WAIT_SECONDS for messages before SQS answers.
            read_timeout=RECEIVE_WAIT_SECONDS + 20,
        )
        once = config.merge(Config(retries={"total_max_attempts": 1, "mode": "standard"}))
        try:
            self.sns = session.client("sns", endpoint_url=settings.endpoint_url, config=config)
            # For publishes that hold a deduplication reservation: a Publish whose answer was
            # lost may have arrived, and each arrival is a message (a standard topic has no
            # deduplication id), so botocore's retries sent one key's message up to three times.
            self.sns_once = session.client("sns", endpoint_url=settings.endpoint_url, config=once)
            self.sqs = session.client("sqs", endpoint_url=settings.endpoint_url, config=config)
            # For sends a lost answer must not repeat (an operator's replay; see sns_once).
            self.sqs_once = session.client("sqs", endpoint_url=settings.endpoint_url, config=once)
        except ValueError as exc:
            # botocore refuses what it cannot build a client for (a region it cannot parse; an
            # endpoint stored before configuration_problem asked what botocore accepts) with a
            # ValueError, which quotes an endpoint whole, credentials and all: not chained.
            raise WorkQueueConfigurationError(
                f"The AWS transport's configuration cannot be used: "
                f"{without_url_credentials(str(exc))} Fix its region or endpoint_url."
            ) from None
        self._session = session
        self._endpoint_url = settings.endpoint_url
        self._lease_clients: dict[float, Any] = {}
        self._lock = threading.Lock()
        self._queue_urls: dict[str, str] = {}
        self._topic_arns: dict[str, str] = {}

    def lease_sqs(self, seconds: float) -> Any:
        """The SQS client for calls on a held message: one attempt, whose connect and read
        timeouts together stay within ``seconds``."""
        from botocore.config import Config

        with self._lock:  # a session is not thread-safe
            client = self._lease_clients.get(seconds)
            if client is None:
                config = Config(
                    retries={"total_max_attempts": 1, "mode": "standard"},
                    connect_timeout=seconds / 3,
                    read_timeout=seconds * 2 / 3,
                )
                client = self._lease_clients[seconds] = self._session.client(
                    "sqs", endpoint_url=self._endpoint_url, config=config
                )
            return client

    def queue_url(self, name: str) -> str:
        url = self._queue_urls.get(name)
        if url is None:
            url = _call(
                self.sqs.get_queue_url,
                QueueName=name,
                missing=f"The SQS queue {name!r} does not exist: run `manage.py workqueue "
                "provision`.",
            )["QueueUrl"]
            self._queue_urls[name] = url
        return url

    def forget_queue(self, name: str) -> None:
        self._queue_urls.pop(name, None)

    def topic_arn(self, name: str) -> str:
        arn = self._topic_arns.get(name)
        if arn is None:
            arn = _find_topic_arn(self, name)
            if arn is None:
                raise TransportUnavailableError(
                    f"The SNS topic {name!r} does not exist: run `manage.py workqueue provision`."
                )
            self._topic_arns[name] = arn
        return arn


_clients: dict[AwsSettings, AwsClients] = {}
_clients_lock = threading.Lock()


def clients_for(settings: AwsSettings) -> AwsClients:
    with _clients_lock:
        found = _clients.get(settings)
        if found is None:
            found = _clients[settings] = AwsClients(settings)
        return found


_NOT_FOUND_CODES = frozenset(
    {"AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist", "NotFound"}
)


def _error_code(exc: Exception) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def _call(method: Any, *, missing: str | None = None, **params: Any) -> dict[str, Any]:
    """Call a boto3 client method; its failures become ``TransportUnavailableError`` (with
    ``missing`` as the text when the resource does not exist), ``TransientTransportError``
    when worth making again soon."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return method(**params)
    except ClientError as exc:
        if missing is not None and _error_code(exc) in _NOT_FOUND_CODES:
            raise TransportUnavailableError(missing, code=_error_code(exc)) from None
        raise _unavailable(f"AWS refused {method.__name__}", exc) from None
    except BotoCoreError as exc:
        raise _unavailable(f"AWS could not be reached ({method.__name__})", exc) from None


#: Error codes AWS answers when it throttled a call (HTTP 400, yet worth making again soon).
_THROTTLED_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "SlowDown",
        "AWS.SimpleQueueService.RequestThrottled",
        "KMS.ThrottlingException",
    }
)


def _unavailable(what: str, exc: Exception) -> TransportUnavailableError:
    """The error to raise for boto3's ``exc``: transient when the call could not be made or
    answered (a connection or timeout), was throttled or failed on AWS's side (HTTP 5xx); a
    refusal otherwise (denied, invalid, missing: made again, it would only fail again). Raised
    ``from None``: botocore's exception text names the endpoint as configured, credentials
    and all, and a traceback would print it."""
    from botocore.exceptions import (
        ConnectionError,
        ConnectTimeoutError,
        EndpointConnectionError,
        HTTPClientError,
        ProxyConnectionError,
    )

    code = _error_code(exc)
    status = (
        (getattr(exc, "response", None) or {}).get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    )
    transient = (
        isinstance(exc, ConnectionError | HTTPClientError)
        or code in _THROTTLED_CODES
        or status >= 500
    )
    text = f"{what}: {without_url_credentials(str(exc))}"
    if not transient:
        return TransportUnavailableError(text + _fix_for(exc, code), code=code)
    # A connection never made, or a throttled call, was not carried out; a lost answer (a read
    # timeout, a dropped connection, a TLS error, which can come while reading the answer) or
    # AWS's own failure may have been.
    never_sent = isinstance(
        exc, EndpointConnectionError | ConnectTimeoutError | ProxyConnectionError
    )
    return TransientTransportError(
        text, code=code, may_have_arrived=not never_sent and code not in _THROTTLED_CODES
    )


#: Error codes AWS answers when it does not take the caller's credentials at all.
_CREDENTIALS_CODES = frozenset(
    {
        "InvalidClientTokenId",
        "UnrecognizedClientException",
        "SignatureDoesNotMatch",
        "IncompleteSignature",
        "InvalidAccessKeyId",
        "MissingAuthenticationToken",
        "ExpiredToken",
        "ExpiredTokenException",
        "RequestExpired",
    }
)
#: Error codes AWS answers when the caller's identity may not make the call.
_DENIED_CODES = frozenset(
    {"AccessDenied", "AccessDeniedException", "AuthorizationError", "KMS.AccessDeniedException"}
)


def _fix_for(exc: Exception, code: str) -> str:
    """What to do about a refusal, to follow AWS's words (which say what is wrong, not what to
    change here): a queue that does not exist said only "The specified queue does not exist",
    and credentials that were missing read as AWS that "could not be reached"."""
    from botocore.exceptions import NoCredentialsError, PartialCredentialsError

    if isinstance(exc, NoCredentialsError | PartialCredentialsError) or code in (
        _CREDENTIALS_CODES
    ):
        return (
            " Fix the credentials the server's boto3 session uses for this transport: its "
            "'profile' key, or boto3's usual chain (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "the instance or pod role); they are missing, wrong or expired."
        )
    if code in _DENIED_CODES:
        return (
            " The server's AWS identity may not make this call: allow it in the identity's IAM "
            "policy (the README's AWS transport section lists the calls each part makes)."
        )
    if code in _NOT_FOUND_CODES:
        return (
            " Run `manage.py workqueue provision` to create the transport's SNS topics and SQS "
            "queues (it creates only what is missing)."
        )
    return ""


# -- the subscription as SQS sees it -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QueueBinding:
    """One subscription's queues and the settings its receiver needs (read from its row)."""

    subscription_id: str
    subscription_name: str
    topic_name: str
    fifo: bool
    exclusive: bool
    lease_seconds: int
    max_attempts: int
    names: AwsNames
    clients: AwsClients

    @classmethod
    def of(cls, subscription_id: str) -> QueueBinding:
        # Imported here: the transport reads topology only when it binds a subscription.
        from workqueue.models import Subscription

        row = (
            Subscription.objects.select_related("topic__transport")
            .filter(pk=subscription_id)
            .first()
        )
        if row is None:
            raise WorkQueueConfigurationError(f"No subscription has id {subscription_id}.")
        return cls.of_row(row)

    @classmethod
    def of_row(cls, row: Any) -> QueueBinding:
        topic = row.topic
        settings = AwsSettings.parse(topic.transport.configuration)
        names = AwsNames.of(settings.prefix, topic.name, row.name, topic.is_fifo)
        if (problem := names.problem()) is not None:
            # Saved before the rule above (or through a path that skips validation): never
            # bound, so that no consumer reads another subscription's dead letters.
            raise WorkQueueConfigurationError(f"Subscription {row.name!r}: {problem}")
        return cls(
            subscription_id=str(row.id),
            subscription_name=row.name,
            topic_name=topic.name,
            fifo=topic.is_fifo,
            exclusive=row.partition_mode == PartitionMode.EXCLUSIVE,
            lease_seconds=row.lease_seconds,
            max_attempts=row.max_attempts,
            names=names,
            clients=clients_for(settings),
        )

    @property
    def queue_url(self) -> str:
        return self.clients.queue_url(self.names.queue)

    @property
    def dead_letter_queue_url(self) -> str:
        return self.clients.queue_url(self.names.dead_letter_queue)

    @property
    def lease_call_seconds(self) -> float:
        """The longest a call on a held message's receipt handle may take (LEASE_CALL_SECONDS)."""
        return min(LEASE_CALL_SECONDS, self.lease_seconds / 10)

    @property
    def lease_sqs(self) -> Any:
        return self.clients.lease_sqs(self.lease_call_seconds)


class _NoTimeLeftForACall(Exception):
    """Less of the lease is left than a call on its receipt handle may take."""


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _string_attributes(values: dict[str, str]) -> dict[str, dict[str, str]]:
    return {k: {"DataType": "String", "StringValue": v} for k, v in values.items()}


def _attribute_bytes(values: dict[str, str]) -> int:
    # SQS counts each attribute's name, type and value towards the message size.
    return sum(len(k.encode()) + len(b"String") + len(v.encode()) for k, v in values.items())


def _group_id(partition_key: str | None, message_id: str) -> str:
    """The FIFO message group: the partition key (one at a time per key); a message without a
    key is a group of its own. SNS and SQS take a group id of 1 to 128 printable ASCII
    characters; a key that is not one (a space, an accent, 200 characters) is written as a
    digest of itself, one group per key all the same."""
    if partition_key is None:
        return message_id
    if MESSAGE_GROUP_ID.fullmatch(partition_key):
        return partition_key
    return "key-sha256-" + hashlib.sha256(partition_key.encode()).hexdigest()


# -- the receiver --------------------------------------------------------------------------


class AwsReceiver:
    """Receives and settles one subscription's messages from its SQS queue.

    Fencing is by this receiver's clock (see the module docstring): ``_leases`` maps each
    receipt handle it holds to the monotonic time its lease counts as lost.
    """

    def __init__(self, binding: QueueBinding, lease_owner: str | None = None) -> None:
        self.binding = binding
        self.subscription_id = binding.subscription_id
        self.lease_owner = lease_owner or new_instance_id()
        self._leases: dict[str, float] = {}
        # Receipt handle -> when its receive was sent (monotonic): SQS counts the 12-hour cap
        # on a message's visibility from then.
        self._received_at: dict[str, float] = {}
        # Held messages whose copy (a release's or retry's) or dead letter a settle has sent,
        # and the lock that makes each send once (see _send_once).
        self._copied: set[str] = set()
        self._sending = threading.Lock()
        self._lock = threading.Lock()
        # Receipt handle -> the lock its calls (a renewal, a settle) take one at a time: made
        # independently (the host renews on a thread of its own), a renewal sent before a
        # retry and landing after it set the message's visibility back to the lease, and the
        # retry ran again at once instead of after its backoff.
        self._handle_locks: dict[str, threading.Lock] = {}
        #: Deliveries received on their last attempt's expired lease and dead-lettered since the
        #: last claim returned, for the next to report (see receive).
        self._moved: list[ExpiredDeadLetter] = []
        #: The threads making those moves (close() lets them end).
        self._movers: list[threading.Thread] = []
        #: On a FIFO queue, the ReceiveRequestAttemptId of a receive that failed and when it was
        #: first sent: the next receive sends it again (see _receive_attempt).
        self._unanswered_receive: tuple[str, float] | None = None
        #: The receiver this one replaced (carry_over_from), while a receive of its may still
        #: fail (one hung past its consumer's stop).
        self._previous: AwsReceiver | None = None

    @property
    def enlist_alias(self) -> str | None:
        return None  # SQS cannot settle inside a database transaction

    def carry_over_from(self, previous: TransportReceiver) -> None:
        """Send again the FIFO receive ``previous`` would have (its answer lost, now or when a
        receive of its still out fails), if it read the same queue with the same lease: what
        SQS hid for another lease, or in another queue, is not what this one would be answered
        (review helper-159). Nothing from another transport's receiver."""
        if not isinstance(previous, AwsReceiver) or (
            previous.binding.queue_url,
            previous.binding.lease_seconds,
        ) != (self.binding.queue_url, self.binding.lease_seconds):
            return
        previous._previous = None  # one step back: not a chain of every receiver since start
        self._previous = previous

    def close(self) -> None:
        """Let moves to the dead-letter queue under way end (each within its lease: a process
        exiting between a move's send and its delete left the dead letter listed twice once
        SQS redrove the message), and log those no claim will report now. boto3 clients are
        shared by the process: nothing else to close."""
        with self._lock:
            movers, self._movers = self._movers, []
        for mover in movers:
            mover.join(timeout=self.binding.lease_seconds)
        with self._lock:
            unreported, self._moved = self._moved, []
        for moved in unreported:
            logger.warning(
                "%s: delivery %s was dead-lettered (LeaseExpired: the lease of its last attempt "
                "expired) as its consumer stopped",
                self.binding.subscription_name,
                moved.delivery_id,
            )

    # -- receiving -----------------------------------------------------------------------

    def receive(self, max_rows: int) -> ClaimResult:
        self._forget_lapsed_leases()
        messages = list(self._receive_messages(max(1, max_rows)))
        claimed: list[ClaimedDelivery] = []
        last_attempts: list[ClaimedDelivery] = []
        for message, received_at in messages:
            delivery = self._delivery(message)
            with self._lock:
                self._leases[delivery.lease_token] = (
                    received_at + self.binding.lease_seconds - LEASE_SAFETY_SECONDS
                )
                self._received_at[delivery.lease_token] = received_at
            if delivery.attempt > self.binding.max_attempts:
                # The lease of its last attempt expired (its holder died or hung): as on the
                # Database transport, that attempt counts and the delivery is dead-lettered,
                # recorded with max_attempts attempts (this receive is none).
                last_attempts.append(replace(delivery, attempt=self.binding.max_attempts))
            else:
                claimed.append(delivery)
        if claimed and last_attempts:
            # Moved beside the fresh deliveries' handlers, within the lease this receive gave
            # them: each move is a send and a delete, and made before handing the fresh ones
            # over, on a slow SQS, they took their leases (handed over with none left, their
            # attempt spent without running; a last one then dead-lettered LeaseExpired having
            # never run). Reported by the next claim.
            mover = threading.Thread(
                target=self._move_to_dead_letters,
                args=(last_attempts,),
                name=f"wq-aws-{self.binding.subscription_name}-dead-letters",
                daemon=True,
            )
            with self._lock:
                self._movers = [m for m in self._movers if m.is_alive()] + [mover]
            mover.start()
        else:
            self._move_to_dead_letters(last_attempts)
        with self._lock:
            # Reported once a claim succeeds: one that fails after a move would lose them.
            moved, self._moved = self._moved, []
        return ClaimResult(claimed, moved)

    def _move_to_dead_letters(self, last_attempts: list[ClaimedDelivery]) -> None:
        """Dead-letter held messages whose last attempt's lease expired; those moved are
        reported by the next claim."""
        for delivery in last_attempts:
            try:
                settled = self.dead_letter(
                    delivery, "LeaseExpired", "The lease of the last attempt expired."
                )
            except TransportUnavailableError as exc:
                # Left hidden for its lease; SQS's redrive then moves it to the DLQ itself
                # (its receive was its last: MaxReceiveCountExceeded, the backstop). The rest
                # of the claim is not lost with it.
                logger.warning(
                    "%s: could not dead-letter a delivery whose last lease expired "
                    "(trying again after its lease): %s",
                    self.binding.subscription_name,
                    exc,
                )
                self._let_go(delivery)
                continue
            if settled.settled:
                moved = ExpiredDeadLetter(
                    delivery.delivery_id,
                    self.subscription_id,
                    delivery.partition_key,
                    "LeaseExpired",
                )
                with self._lock:
                    self._moved.append(moved)

    def _receive_messages(self, wanted: int) -> Iterator[tuple[dict[str, Any], float]]:
        """Up to ``wanted`` messages, each with the moment (monotonic) its receive was sent,
        from which its lease counts.

        On an Exclusive subscription one message per call: SQS FIFO returns several messages of
        one group in one answer, and they must not run at once. A later call returns no message
        of a group with one in flight. Either way a claim takes at most SQS_BATCH_MAX messages
        (one batch call's worth): a host claiming far ahead (see ``consumer.DEFAULT_PREFETCH``)
        would otherwise hold the first messages of an Exclusive claim through a hundred more
        calls before any of them could start."""
        wanted = min(wanted, SQS_BATCH_MAX)
        per_call = 1 if self.binding.exclusive else wanted
        wait = RECEIVE_WAIT_SECONDS
        received = 0
        while wanted > 0:
            started = time.monotonic()
            attempt: dict[str, str] = {}
            if self.binding.fifo:
                attempt_id, started = self._receive_attempt(started)
                attempt["ReceiveRequestAttemptId"] = attempt_id
            try:
                answer = _call(
                    self.binding.clients.sqs.receive_message,
                    QueueUrl=self.binding.queue_url,
                    MaxNumberOfMessages=min(per_call, wanted),
                    WaitTimeSeconds=wait,
                    VisibilityTimeout=self.binding.lease_seconds,
                    MessageSystemAttributeNames=["ApproximateReceiveCount", "SentTimestamp"],
                    MessageAttributeNames=["All"],
                    **attempt,
                )
            except TransportUnavailableError:
                if attempt:
                    with self._lock:
                        self._unanswered_receive = (attempt["ReceiveRequestAttemptId"], started)
                if not received:
                    raise
                # What earlier calls received is claimed (each spent an attempt): raised, it
                # would stay hidden for its lease without running, and on a last attempt come
                # back a dead letter that never ran. The next claim meets the failure.
                return
            found = answer.get("Messages", [])
            for message in found:
                yield message, started
            received += len(found)
            wanted -= len(found)
            if not found or not self.binding.exclusive:
                return
            wait = 0

    def _receive_attempt(self, now: float) -> tuple[str, float]:
        """The ReceiveRequestAttemptId for a receive from a FIFO queue, and the moment the
        visibility of what it receives counts from.

        A receive whose answer was lost (a dropped connection, a timeout) hid what SQS answered
        for a lease, and on a FIFO queue every later message of those groups behind it.
        botocore's retries send the call again as it was, its id with it, and SQS answers with
        what the lost answer held; a receive that failed through all of them is sent again, id
        and all, by the next claim, while SQS still keeps the id. What that answers was hidden
        when the failed receive was first sent, so its lease counts from then."""
        previous = self._previous
        with self._lock:
            unanswered, self._unanswered_receive = self._unanswered_receive, None
        if unanswered is None and previous is not None:
            with previous._lock:  # taken, so sent again by one of us only
                unanswered, previous._unanswered_receive = previous._unanswered_receive, None
        if unanswered is not None:
            attempt_id, first_sent = unanswered
            if now - first_sent < min(
                RECEIVE_ATTEMPT_REUSE_SECONDS, self.binding.lease_seconds / 2
            ):
                return attempt_id, first_sent
        return uuid.uuid4().hex, now

    def _delivery(self, message: dict[str, Any]) -> ClaimedDelivery:
        envelope = _envelope(message["Body"])
        system = message.get("Attributes", {})
        payload, payload_json = _payload_held_as_text(envelope.get("payload"))
        return ClaimedDelivery(
            # A replayed message is a new SQS message carrying the id its delivery had. As
            # text whatever the body holds (one written by hand): a dead letter carries the id
            # as an attribute, and an int there made its move raise TypeError.
            delivery_id=str(envelope.get("delivery_id") or message["MessageId"]),
            subscription_id=self.subscription_id,
            lease_token=message["ReceiptHandle"],
            lease_expires_at=_now() + dt.timedelta(seconds=self.binding.lease_seconds),
            # Receives of this SQS message, plus the attempts its released predecessors spent
            # (a release sends the message again: see AwsReceiver.release).
            attempt=int(system.get("ApproximateReceiveCount", "1")) + _attempts_before(envelope),
            is_replay=bool(envelope.get("replayed")),
            message_id=str(envelope.get("message_id") or message["MessageId"]),
            topic_id=envelope.get("topic_id", ""),
            partition_key=envelope.get("partition_key"),
            attributes=envelope.get("attributes") or {},
            payload=payload,
            payload_json=payload_json,
            payload_ref=stored_payload_ref(envelope.get("payload_ref")),
            correlation_id=envelope.get("correlation_id"),
            published_at=_parse_time(envelope.get("published_at")) or _now(),
            lease_seconds=self.binding.lease_seconds,
        )

    def _forget_lapsed_leases(self) -> None:
        now = time.monotonic()
        with self._lock:
            for token in [t for t, deadline in self._leases.items() if deadline <= now]:
                del self._leases[token]
                self._received_at.pop(token, None)
                self._copied.discard(token)
                self._handle_locks.pop(token, None)
            # Those a call made after its lease was let go (it found nothing to do).
            for token in [t for t, lock in self._handle_locks.items() if t not in self._leases]:
                if not self._handle_locks[token].locked():
                    del self._handle_locks[token]

    # -- fencing ----------------------------------------------------------------------------

    def _holds(self, delivery: ClaimedDelivery) -> bool:
        with self._lock:
            deadline = self._leases.get(delivery.lease_token)
        return deadline is not None and time.monotonic() < deadline

    def _let_go(self, delivery: ClaimedDelivery) -> None:
        with self._lock:
            self._leases.pop(delivery.lease_token, None)
            self._received_at.pop(delivery.lease_token, None)
            self._copied.discard(delivery.lease_token)
            # A call waiting for it holds it already, and then finds the lease gone.
            self._handle_locks.pop(delivery.lease_token, None)

    def _handle_lock(self, delivery: ClaimedDelivery) -> threading.Lock:
        """The lock a call on ``delivery``'s receipt handle holds while it is made."""
        with self._lock:
            return self._handle_locks.setdefault(delivery.lease_token, threading.Lock())

    def _send_once(self, delivery: ClaimedDelivery, send: Callable[[], None]) -> None:
        """Make ``send`` (a release's or retry's copy, or a dead letter) for a held message once:
        a settle made again after its delete failed, or by two threads at once (a late
        hand-back and a stop), then only deletes. Sent twice, a standard queue kept both copies
        and ran them at once, and the DLQ listed the dead letter twice. Sends are rare (each a
        failure or a hand-back): one at a time per receiver. Not begun without the time for
        the send and the delete after it: a send whose delete came too late left a copy beside
        the message (a dead letter listed twice once SQS's redrive moved it too)."""
        with self._sending:
            with self._lock:
                if delivery.lease_token in self._copied:
                    return
            if not self._time_for_a_call(delivery, calls=2):
                raise _NoTimeLeftForACall
            send()
            with self._lock:
                if delivery.lease_token in self._leases:
                    self._copied.add(delivery.lease_token)

    def _time_for_a_call(self, delivery: ClaimedDelivery, calls: int = 1) -> bool:
        """Whether ``calls`` calls on the receipt handle made now one after the other end, at
        their longest, before the visibility timeout does (counted from when its receive or
        renewal was sent, so the calls' own time takes the place of LEASE_SAFETY_SECONDS)."""
        with self._lock:
            deadline = self._leases.get(delivery.lease_token)
        return (
            deadline is not None
            and time.monotonic() + calls * self.binding.lease_call_seconds
            < deadline + LEASE_SAFETY_SECONDS
        )

    def _settle(self, delivery: ClaimedDelivery, status: str, action: Any) -> SettleResult:
        # After a renewal under way: one landing after the settle undid a retry's backoff (or
        # hid a released message for a whole lease). The lease is read once it is done.
        with self._handle_lock(delivery):
            return self._settle_holding(delivery, status, action)

    def _settle_holding(self, delivery: ClaimedDelivery, status: str, action: Any) -> SettleResult:
        if not self._holds(delivery):
            self._let_go(delivery)
            return SettleResult(SettleOutcome.LEASE_LOST)
        try:
            action()
        except _NoTimeLeftForACall:
            self._let_go(delivery)
            return SettleResult(SettleOutcome.LEASE_LOST)
        except TransportUnavailableError as exc:
            if exc.code in {"ReceiptHandleIsInvalid", "InvalidParameterValue"}:
                self._let_go(delivery)
                return SettleResult(SettleOutcome.LEASE_LOST)
            raise
        self._let_go(delivery)
        return SettleResult(SettleOutcome.SETTLED, status)

    def _set_visibility(
        self, delivery: ClaimedDelivery, seconds: int, *, may_end_late: bool = False
    ) -> None:
        """``may_end_late``: the change lengthens whoever holds the message's lease, even
        when it lands after a new receive, so it need not end before this lease does."""
        queue_url = self.binding.queue_url  # resolved before the time is measured
        if not may_end_late and not self._time_for_a_call(delivery):
            raise _NoTimeLeftForACall
        _call(
            self.binding.lease_sqs.change_message_visibility,
            QueueUrl=queue_url,
            ReceiptHandle=delivery.lease_token,
            VisibilityTimeout=min(max(int(seconds), 0), SQS_MAX_VISIBILITY_SECONDS),
        )

    def _delete(self, delivery: ClaimedDelivery) -> None:
        queue_url = self.binding.queue_url
        if not self._time_for_a_call(delivery):
            raise _NoTimeLeftForACall
        _call(
            self.binding.lease_sqs.delete_message,
            QueueUrl=queue_url,
            ReceiptHandle=delivery.lease_token,
        )

    # -- heartbeat and settles --------------------------------------------------------------

    def extend_lease(
        self, delivery: ClaimedDelivery, progress: dict[str, Any] | None = None
    ) -> LeaseExtension:
        """Extend the visibility timeout by ``lease_seconds`` from now (``progress`` is not
        kept: SQS has nowhere to keep it); after a settle under way, which it then finds made
        (see ``_handle_locks``)."""
        with self._handle_lock(delivery):
            return self._extend_lease_holding(delivery)

    def _extend_lease_holding(self, delivery: ClaimedDelivery) -> LeaseExtension:
        if not self._holds(delivery):
            self._let_go(delivery)
            return LeaseExtension(LeaseState.LOST)
        started = time.monotonic()
        # Never past 12 hours from the receive: SQS refuses such a visibility, and the refusal
        # read as a lost lease (with a 12-hour lease, at the first heartbeat). Near that end
        # the renewal grants what is left, and the holder's lease ends with it.
        granted = min(self.binding.lease_seconds, self._visibility_left(delivery))
        if granted <= 0:
            self._let_go(delivery)
            return LeaseExtension(LeaseState.LOST)
        try:
            # A whole lease from when it lands is at least what a receive since then hid the
            # message for; a shortened one (near SQS's 12 hours) could cut that short.
            self._set_visibility(
                delivery, granted, may_end_late=granted == self.binding.lease_seconds
            )
        except _NoTimeLeftForACall:
            self._let_go(delivery)
            return LeaseExtension(LeaseState.LOST)
        except TransportUnavailableError as exc:
            if exc.code in {"ReceiptHandleIsInvalid", "InvalidParameterValue"}:
                self._let_go(delivery)
                return LeaseExtension(LeaseState.LOST)
            raise
        if not self._holds(delivery):
            # The answer came after the lease ran out: the message may have been received
            # since (the renewal then lengthened that holder's hiding of it), so the lease is
            # not brought back.
            self._let_go(delivery)
            return LeaseExtension(LeaseState.LOST)
        with self._lock:
            self._leases[delivery.lease_token] = started + granted - LEASE_SAFETY_SECONDS
        return LeaseExtension(
            LeaseState.HELD,
            _now() + dt.timedelta(seconds=granted),
            None if granted == self.binding.lease_seconds else granted,
        )

    def _visibility_left(self, delivery: ClaimedDelivery) -> int:
        """Seconds SQS still lets the message be hidden, from now: 12 hours from its receive,
        less a margin for the call's own time."""
        with self._lock:
            received_at = self._received_at.get(delivery.lease_token, time.monotonic())
        return (
            SQS_MAX_VISIBILITY_SECONDS
            - VISIBILITY_CAP_MARGIN_SECONDS
            - math.ceil(time.monotonic() - received_at)
        )

    def take_rate_tokens(self, wanted: int) -> RateTokens:
        return RateTokens(wanted, 0.0, 0.0)  # supports_rate_limit is off: the host never asks

    def return_rate_tokens(self, unused: int, held_seconds: float, full_in_seconds: float) -> None:
        """Nothing to return (no rate limit on this transport)."""

    def complete(
        self,
        delivery: ClaimedDelivery,
        *,
        connection: BaseDatabaseWrapper | None = None,
        holding_key: bool = False,
    ) -> SettleResult:
        if connection is not None or holding_key:
            raise UnsupportedByTransportError(
                "Completing inside a database transaction needs a transport that settles in "
                "the database; the AWS transport settles in SQS.",
                "enlist_alias",
            )
        return self._settle(delivery, DeliveryStatus.COMPLETED, lambda: self._delete(delivery))

    def release_key(self, delivery: ClaimedDelivery) -> SettleResult:
        raise UnsupportedByTransportError(
            "Only a completion inside a database transaction holds a key; the AWS transport "
            "settles in SQS.",
            "enlist_alias",
        )

    def complete_many(
        self, deliveries: Iterable[ClaimedDelivery]
    ) -> dict[str, SettleResult | Exception]:
        results: dict[str, SettleResult | Exception] = {}
        settling = list(deliveries)
        queue_url = self.binding.queue_url
        for start in range(0, len(settling), SQS_BATCH_MAX):
            chunk = []
            for delivery in settling[start : start + SQS_BATCH_MAX]:
                if self._time_for_a_call(delivery):
                    chunk.append(delivery)
                else:
                    self._let_go(delivery)
                    results[delivery.delivery_id] = SettleResult(SettleOutcome.LEASE_LOST)
            if not chunk:
                continue
            try:
                answer = _call(
                    self.binding.lease_sqs.delete_message_batch,
                    QueueUrl=queue_url,
                    Entries=[
                        {"Id": str(i), "ReceiptHandle": d.lease_token} for i, d in enumerate(chunk)
                    ],
                )
            except TransportUnavailableError as exc:
                # This chunk's failure is its own: the chunks deleted before it stay Completed
                # (raised for the whole call, their completions were made again and, let go,
                # answered LeaseLost), and its deliveries stay held for their holders to
                # complete again.
                results.update(dict.fromkeys((d.delivery_id for d in chunk), exc))
                continue
            refused = {int(f["Id"]): f for f in answer.get("Failed", [])}
            for i, delivery in enumerate(chunk):
                failure = refused.get(i)
                if failure is not None and not failure.get("SenderFault", True):
                    # SQS's own failure, not the receipt handle's: still held, made again.
                    results[delivery.delivery_id] = TransientTransportError(
                        f"SQS could not delete the message: {failure.get('Code')}: "
                        f"{failure.get('Message')}",
                        code=failure.get("Code", ""),
                    )
                    continue
                self._let_go(delivery)
                results[delivery.delivery_id] = (
                    SettleResult(SettleOutcome.LEASE_LOST)
                    if failure is not None
                    else SettleResult(SettleOutcome.SETTLED, DeliveryStatus.COMPLETED)
                )
        return results

    def retry(
        self, delivery: ClaimedDelivery, delay_seconds: int = 0, error: str | None = None
    ) -> SettleResult:
        """Have the message received again after ``delay_seconds``: its next receive is the
        next attempt. ``error`` is not kept: only a dead letter records its error.

        On a standard queue a delay of up to 15 minutes sends the message again as a new SQS
        message delayed that long (the envelope carries the attempts spent, as a release's
        does), then deletes the received one: SQS counts a message hidden by its visibility as
        in flight, and a standard queue takes no receive past 120,000 in flight (long polls
        then answer empty, without an error), so an outage whose failures waited out their
        backoffs hidden would stop fresh work. A failure between the send and the delete
        leaves both copies (at least once, never none); a failed send hides the message
        instead. Longer delays, and FIFO queues (which delay per queue only), hide it, but no
        longer than 12 hours after its receive (SQS refuses a visibility past that, and the
        refusal would bring the message back at the end of its lease)."""
        delay = max(int(delay_seconds), 0)

        def hide() -> None:
            self._set_visibility(delivery, min(delay, max(self._visibility_left(delivery), 0)))

        def send_delayed_then_delete() -> None:
            try:
                self._send_once(
                    delivery,
                    lambda: send_copy(
                        self.binding, delivery, attempts_before=delivery.attempt, delay=delay
                    ),
                )
            except (TransportUnavailableError, _NoTimeLeftForACall):
                hide()  # one call, held to the lease by itself
                return
            self._delete(delivery)

        resend = not self.binding.fifo and 0 < delay <= SQS_MAX_DELAY_SECONDS
        return self._settle(
            delivery, DeliveryStatus.PENDING, send_delayed_then_delete if resend else hide
        )

    def settles_go_through(self) -> bool:
        # An IAM refusal is a transport error of its own, naming the policy to change, never a
        # database grant refused: this transport's settles are never paused for one.
        return True

    def max_attempts(self, planned: int) -> int:
        # The receive path dead-letters by the binding's value, read at the last re-plan (and
        # SQS's redrive by the queue's, set when it was provisioned): going by a newer one here
        # would retry a message that its next receive then dead-letters without running it.
        return planned

    def release(self, delivery: ClaimedDelivery) -> SettleResult:
        """Give the message back at once, and its attempt with it, as the Database transport
        does. SQS counts every receive (making the message visible again would spend the
        attempt, and on a last attempt have it dead-lettered as LeaseExpired without running),
        so the message is sent to the queue again as a new SQS message whose envelope carries
        the attempts spent before this one, then the received one is deleted. When that send
        fails the message is made visible instead (the attempt stays spent); a failure between
        the send and the delete leaves both copies (at least once, never none). On a FIFO
        queue the copy goes behind the messages its partition key already has waiting."""

        def give_back() -> None:
            try:
                self._send_once(
                    delivery,
                    lambda: send_copy(self.binding, delivery, attempts_before=delivery.attempt - 1),
                )
            except (TransportUnavailableError, _NoTimeLeftForACall):
                self._set_visibility(delivery, 0)  # one call, held to the lease by itself
                return
            self._delete(delivery)

        return self._settle(delivery, DeliveryStatus.PENDING, give_back)

    def dead_letter(
        self, delivery: ClaimedDelivery, reason: str, error: str | None = None
    ) -> SettleResult:
        """Send the message to the subscription's DLQ with ``reason`` and ``error`` as message
        attributes, then delete it from the queue (in that order: a failure between the two
        leaves a copy in each, never none)."""

        def move() -> None:
            self._send_once(
                delivery, lambda: send_dead_letter(self.binding, delivery, reason, error)
            )
            self._delete(delivery)

        return self._settle(delivery, DeliveryStatus.DEAD_LETTERED, move)

    def completed_at_its_attempt(self, delivery: ClaimedDelivery) -> bool:
        return False  # a deleted SQS message leaves nothing to read back

    def dead_lettered_at_its_attempt(self, delivery: ClaimedDelivery, reason: str) -> bool:
        return False  # the DLQ cannot be searched by delivery without receiving from it

    def acknowledge_cancel(self, delivery: ClaimedDelivery) -> SettleResult:
        raise UnsupportedByTransportError(
            "Cancelling a running delivery needs supports_cancel, which the AWS transport does "
            "not have.",
            "supports_cancel",
        )


def send_dead_letter(
    binding: QueueBinding, delivery: ClaimedDelivery, reason: str, error: str | None
) -> None:
    """Put ``delivery``'s message on the DLQ, its reason, error and attempts as attributes."""
    attributes = {
        DELIVERY_ID_ATTRIBUTE: delivery.delivery_id,
        REASON_ATTRIBUTE: reason,
        ATTEMPTS_ATTRIBUTE: str(delivery.attempt),
        DEAD_LETTERED_AT_ATTRIBUTE: _now().isoformat(),
    }
    # SQS refuses an attribute value holding a character it does not allow in a body (a
    # traceback's terminal colours): the move would fail and the message run again.
    attributes = {name: _sqs_text(value) for name, value in attributes.items()}
    if error:
        # Escaped, then cut: the message stays within SQS's size limit whatever the error.
        attributes[ERROR_ATTRIBUTE] = _sqs_text(error)[:4000]
    params: dict[str, Any] = {
        "QueueUrl": binding.dead_letter_queue_url,
        "MessageBody": _sqs_json(_envelope_of(delivery)),
        "MessageAttributes": _string_attributes(attributes),
    }
    if binding.fifo:
        # SQS FIFO drops a send whose deduplication id it saw in the last five minutes, even
        # if that message was deleted since: the id names this receive (its receipt handle),
        # so a replay that fails again is dead-lettered anew, while a settle retried after an
        # error sends the same id and stores one copy.
        deduplication_id = _deduplication_id("dead", delivery.delivery_id, delivery.lease_token)
        params["MessageDeduplicationId"] = deduplication_id
        # A group of its own, not the partition key's: a FIFO queue hands out nothing more of
        # a group while some of it is received, so an operator's read of the DLQ (which
        # receives what it lists) saw at most one answer's ten dead letters of a key, and a
        # replay or discard by id of the others said "not a dead letter". Dead letters keep
        # no order (their key is in the envelope; a replay goes back under the key's group).
        params["MessageGroupId"] = deduplication_id
    _send_for_a_settle(binding, params)


#: What SQS refuses in a message body or a string attribute value.
_NOT_SQS_TEXT = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _sqs_text(text: str) -> str:
    """``text`` with each character SQS refuses written as its escape (``\\x1b``)."""
    return _NOT_SQS_TEXT.sub(lambda m: m[0].encode("unicode_escape").decode("ascii"), text)


def _sqs_json(value: Any) -> str:
    """``value`` as a message body SQS accepts: its canonical JSON, with each character SQS
    refuses (U+FFFE and U+FFFF: JSON already escapes the controls) written as a JSON escape,
    which reads back as the same character. Sent raw, SNS took the message and SQS refused it
    on the way to the subscription queues: a message published as Accepted, then lost."""
    return _NOT_SQS_TEXT.sub(lambda m: f"\\u{ord(m[0]):04x}", canonical_json(value))


def _attribute_problem(attributes: dict[str, str] | None) -> str | None:
    """Why SQS would refuse one of ``attributes``' values, or None. They cannot be escaped as
    a body is: SNS filter policies match a value as it is written."""
    for name, value in (attributes or {}).items():
        found = _NOT_SQS_TEXT.search(value)
        if found is not None:
            return (
                f"Attribute {name!r} holds {found[0]!a} (at position {found.start()}), a "
                "character SQS does not carry in a message attribute on this AWS transport: "
                "allowed are tab, newline, carriage return and Unicode from U+0020 up, less "
                "U+FFFE and U+FFFF. Put such text in the payload instead."
            )
    return None


def _deduplication_id(kind: str, *parts: str) -> str:
    """A FIFO deduplication id (at most 128 characters) for ``kind`` of send of ``parts``."""
    return f"{kind}-" + hashlib.sha256("\n".join(parts).encode()).hexdigest()


def send_copy(
    binding: QueueBinding, delivery: ClaimedDelivery, *, attempts_before: int, delay: int = 0
) -> None:
    """Put a delivery's message back on its queue as a new SQS message: same delivery id, its
    receive count starting again, ``attempts_before`` kept in the envelope, so its next receive
    is attempt ``attempts_before + 1`` (a release gives this attempt back: ``attempt - 1``; a
    retry spends it: ``attempt``), receivable after ``delay`` seconds (standard queues only)."""
    envelope = {
        **_envelope_of(delivery),
        "delivery_id": delivery.delivery_id,
        "replayed": delivery.is_replay,
        "attempts_before": attempts_before,
    }
    params: dict[str, Any] = {
        "QueueUrl": binding.queue_url,
        "MessageBody": _sqs_json(envelope),
        "MessageAttributes": _string_attributes(delivery.attributes or {}),
    }
    if not params["MessageAttributes"]:
        del params["MessageAttributes"]
    if delay:
        params["DelaySeconds"] = delay
    if binding.fifo:
        params["MessageGroupId"] = _group_id(delivery.partition_key, delivery.message_id)
        # A new id per release: SQS FIFO drops a repeated one for 5 minutes.
        # Of this receive: a release retried after its send succeeded (and its delete failed)
        # stores one copy, not two (see _deduplication_id).
        params["MessageDeduplicationId"] = _deduplication_id(
            "release", delivery.delivery_id, delivery.lease_token
        )
    _send_for_a_settle(binding, params)


def _send_for_a_settle(binding: QueueBinding, params: dict[str, Any]) -> None:
    """SendMessage for a settle of a held message, through the lease's client: one attempt,
    within LEASE_CALL_SECONDS. The default client made up to three, and a send whose answer
    was lost is a send made: on a standard queue (no deduplication id) each attempt that
    reached SQS queued a copy, so one release ran four times, and the settle could outlast
    the lease it was made in (helper-123). A failed send is the settle's to handle."""
    _call(binding.lease_sqs.send_message, **params)


def _envelope_of(delivery: ClaimedDelivery) -> dict[str, Any]:
    return {
        "message_id": delivery.message_id,
        "topic_id": delivery.topic_id,
        "partition_key": delivery.partition_key,
        "attributes": delivery.attributes or None,
        "payload": delivery.decoded_payload(),
        "payload_ref": delivery.payload_ref,
        "correlation_id": delivery.correlation_id,
        "published_at": delivery.published_at.isoformat(),
    }


def _attempts_before(envelope: dict[str, Any]) -> int:
    """The attempts a released message's predecessors spent: 0 when the envelope does not
    say so as a count (one written to the queue by hand must not fail the claim it is in)."""
    value = envelope.get("attempts_before")
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return 0


def _payload_held_as_text(payload: Any) -> tuple[Any, str | None]:
    """A claimed delivery's ``payload`` and ``payload_json``: the payload as JSON text until
    its handler starts, as on the Database transport (a delivery claimed ahead may wait for a
    slot, and decoded a payload can take some 25 times its size). The envelope is one JSON
    body, decoded to read the rest, so the payload is written back as the text it was sent as
    (canonical JSON); one nested too deep to be written again from here is kept decoded."""
    if payload is None:
        return None, None
    try:
        return None, canonical_json(payload)
    except RecursionError:
        return payload, None


def _envelope(body: str) -> dict[str, Any]:
    try:
        found = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: a thousand nested brackets
        found = None
    if not isinstance(found, dict):
        # Not sent by this transport (someone wrote to the queue directly): handed to the
        # handler as a payload of its own.
        return {"payload": body}
    return found


def _parse_time(text: Any) -> dt.datetime | None:
    """A time the transport wrote (ISO 8601, in UTC); one written without its zone (by hand)
    is read as UTC, as ours are: compared with an aware time (a bulk operation's window), a
    naive one raised TypeError."""
    if not isinstance(text, str):
        return None
    try:
        found = dt.datetime.fromisoformat(text)
    except ValueError:
        return None
    return found if found.tzinfo is not None else found.replace(tzinfo=dt.UTC)


def _count(text: Any) -> int:
    """A count an attribute holds; 0 when it holds none (written by hand)."""
    try:
        return max(int(text), 0)
    except (TypeError, ValueError):
        return 0


# -- the transport -------------------------------------------------------------------------


class AwsTransport(BaseTransport):
    """SNS topics and SQS queues; see the module docstring for names and guarantees."""

    name: ClassVar[str] = AWS_DRIVER

    supports_exclusive = True
    honours_topic_is_fifo = True
    names_resources_after_topology = True
    supports_ordered = False
    heartbeat_modes: ClassVar[frozenset[str]] = frozenset({HeartbeatMode.AUTO})
    supports_rate_limit = False
    supports_external_consumers = False
    # Through the Database ledger: reserve, send, confirm (or release when sending failed).
    supports_deduplication = True
    # SNS Publish has no delay, and SQS's own (at most 900 s) is per queue on FIFO queues.
    supports_scheduled_publish = False
    supports_priority = False
    supports_enlisted_publish = False
    supports_replay = True
    supports_cancel = False
    supports_partition_listing = False
    supports_bulk_discard_pending = False

    conformance_traits: ClassVar[dict[str, Any]] = {
        # SQS keeps no history of deleted messages.
        "completed_counts": False,
        # A message waiting in SQS cannot be picked out by id.
        "cancel_pending": False,
        # The receiver fences by its own clock (SQS accepts stale receipt handles).
        "settles_after_expiry_until_taken_back": False,
        # Exclusive runs on FIFO queues, which only a FIFO topic feeds.
        "fifo_topics": True,
        # SQS keeps time itself.
        "shifts_time": False,
    }

    # -- rules checked on save -------------------------------------------------------------

    @classmethod
    def configuration_problem(cls, configuration: dict[str, Any] | None) -> str | None:
        return configuration_problem(configuration)

    @classmethod
    def subscription_problem(cls, subscription: Any, transport_name: str) -> str | None:
        problem = super().subscription_problem(subscription, transport_name)
        if (
            problem is None
            and subscription.partition_mode == PartitionMode.EXCLUSIVE
            and not subscription.topic.is_fifo
        ):
            return (
                "Exclusive on the AWS transport needs a FIFO topic (is_fifo), whose SQS FIFO "
                "queues run one message per partition key at a time; set is_fifo on topic "
                f"{subscription.topic.name!r} before provisioning it."
            )
        return problem

    @classmethod
    def subscription_field_problems(
        cls, subscription: Any, configuration: dict[str, Any] | None
    ) -> dict[str, str]:
        problems: dict[str, str] = {}
        try:
            parsed = parse_filter(subscription.filter)
        except FilterError:
            parsed = None  # the model reports the filter itself
        problem = filter_policy_problem(parsed)
        if problem is not None:
            problems["filter"] = problem
        if subscription.lease_seconds > SQS_MAX_VISIBILITY_SECONDS:
            # The queue's visibility timeout is the lease: SQS refuses one past 12 hours, so
            # provisioning and every receive would fail.
            problems["lease_seconds"] = (
                f"SQS hides a received message for at most {SQS_MAX_VISIBILITY_SECONDS:,} s (12 "
                "hours), the longest lease the AWS transport can grant: lower lease_seconds, "
                "and renew the lease with heartbeats for handlers that run longer."
            )
        if subscription.max_attempts > SQS_MAX_RECEIVE_COUNT - 1:
            # The queue's redrive backstop is max_attempts + 1 receives: SQS takes 1 to 1,000,
            # so provisioning the queue would fail.
            problems["max_attempts"] = (
                f"On the AWS transport max_attempts is at most {SQS_MAX_RECEIVE_COUNT - 1:,}: "
                "the SQS queue moves a message to its dead-letter queue after max_attempts + 1 "
                f"receives, and SQS counts at most {SQS_MAX_RECEIVE_COUNT:,}."
            )
        if configuration_problem(configuration) is None:
            assert configuration is not None
            names = AwsNames.of(
                configuration.get("prefix", "wq"),
                subscription.topic.name,
                subscription.name,
                subscription.topic.is_fifo,
            )
            if (problem := names.problem()) is not None:
                problems["name"] = problem
        return problems

    # -- publishing -------------------------------------------------------------------------

    def publish(
        self,
        topic: Any,
        messages: list[dict[str, Any]],
        *,
        publisher: str,
        enlist: bool,
        external: bool,
        chosen_message_ids: frozenset[str] = frozenset(),
    ) -> list[dict[str, Any]]:
        """SNS Publish (PublishBatch for several, ten to a call) of each message's envelope,
        its attributes as message attributes; the message ids are ours. Deduplication keys and
        the message ids in ``chosen_message_ids`` go through the Database ledger first
        (``workqueue.transports.ledger``), so Duplicate and MessageIDConflict answer as on the
        Database transport."""
        refusal = _topic_refusal(topic, external)
        if refusal is not None:
            return [_row(m["message_id"], PublishStatus.REJECTED, refusal) for m in messages]
        settings = AwsSettings.parse(topic.transport.configuration)
        clients = clients_for(settings)
        try:
            topic_arn = clients.topic_arn(
                AwsNames.of(settings.prefix, topic.name, "", topic.is_fifo).topic
            )
        except TransportUnavailableError as exc:
            # As when SNS refuses the send itself: rejected and retryable, never raised (the
            # lookup happens once a process, so only a process's first publish could raise).
            detail = _what_the_publisher_reads(str(exc), topic.name, external, len(messages))
            return [
                _row(
                    m["message_id"],
                    PublishStatus.REJECTED,
                    PublishErrorCode.TRANSPORT_UNAVAILABLE,
                    detail,
                )
                for m in messages
            ]
        rows: list[dict[str, Any] | None] = [None] * len(messages)
        entries: list[tuple[int, dict[str, Any]]] = []
        published_at = _now().isoformat()
        for index, message in enumerate(messages):
            problem = _attribute_problem(message["attributes"])
            if problem is not None:
                rows[index] = _row(
                    message["message_id"],
                    PublishStatus.REJECTED,
                    PublishErrorCode.INVALID_ATTRIBUTES,
                    problem,
                )
                continue
            entry, size = _sns_entry(topic, message, publisher, published_at)
            if size > SQS_MAX_MESSAGE_BYTES:
                rows[index] = _row(
                    message["message_id"],
                    PublishStatus.REJECTED,
                    PublishErrorCode.PAYLOAD_TOO_LARGE,
                    f"The message is {size} bytes as an SNS/SQS message (envelope and "
                    f"attributes); SQS allows {SQS_MAX_MESSAGE_BYTES}. Store the payload "
                    "elsewhere and publish a claim-check reference instead (payload_ref).",
                )
                continue
            entries.append((index, entry))
        ledger = PublishLedger(topic, chosen_message_ids)
        refused: dict[int, str] = {}
        for candidates in _batches(entries):
            # Each batch reserves its keys and ids just before it is sent, in message order:
            # all reserved before the first send, a long publish_many's later keys lapsed
            # (RESERVATION_SECONDS) while a slow SNS took the earlier batches, and another
            # publisher's message under one was sent beside this one's (review helper-168).
            batch = []
            for index, entry in candidates:
                admitted = ledger.admit(index, messages[index])
                if admitted is None:
                    batch.append((index, entry))
                elif admitted is not FOLLOWS:
                    rows[index] = admitted  # type: ignore[assignment]
            if not batch:
                continue
            # A FIFO topic's deduplication id makes botocore's re-sends safe.
            once = not topic.is_fifo and any(ledger.holds(index) for index, _ in batch)
            for index, refusal, arrived in _sent(clients, topic_arn, batch, once=once):
                if refusal is None:
                    ledger.settle(index, messages[index], sent=True)
                    rows[index] = _row(messages[index]["message_id"], PublishStatus.ACCEPTED)
                    continue
                if arrived and ledger.holds(index):
                    # Kept reserved, to lapse: a publish again meanwhile is
                    # DeduplicationPending rather than a second message under the key.
                    ledger.settle(index, messages[index], sent=None)
                    refusal += (
                        " It may have reached SNS all the same: its deduplication key (or "
                        f"message id) stays reserved for {RESERVATION_SECONDS} s, and a "
                        "publish with it meanwhile answers DeduplicationPending."
                    )
                else:
                    ledger.settle(index, messages[index], sent=False)
                refused[index] = refusal
        if refused:
            # One log line a call, not one a message, for a batch that SNS refused whole.
            told = _what_the_publisher_reads(
                next(iter(refused.values())), topic.name, external, len(refused)
            )
            for index, refusal in refused.items():
                rows[index] = _row(
                    messages[index]["message_id"],
                    PublishStatus.REJECTED,
                    PublishErrorCode.TRANSPORT_UNAVAILABLE,
                    refusal if not external else told,
                )
        ledger.follow_up(rows, messages)
        return [row for row in rows if row is not None]

    # -- provisioning -----------------------------------------------------------------------

    def provision(self, transport: Any, *, dry_run: bool) -> list[ProvisionChange]:
        # Imported here: the transport reads topology only to provision it.
        from workqueue.models import Topic

        settings = AwsSettings.parse(transport.configuration)
        provisioner = _Provisioner(clients_for(settings), dry_run)
        topics = Topic.objects.filter(transport=transport).prefetch_related("subscriptions")
        for topic in topics.order_by("name"):
            topic_names = AwsNames.of(settings.prefix, topic.name, "", topic.is_fifo)
            topic_arn = provisioner.topic(topic_names.topic, topic.is_fifo)
            for subscription in sorted(topic.subscriptions.all(), key=lambda s: s.name):
                names = AwsNames.of(settings.prefix, topic.name, subscription.name, topic.is_fifo)
                problem = names.problem()
                if names.dead_letter_queue_of is not None:
                    # Saved by an earlier release: refused, and the rest provisioned (the
                    # subscription that replaces it among them). What an earlier provision
                    # made of it on the shared queue is for an operator to remove.
                    cleanup = (
                        f" Remove by hand what an earlier provision made for it: the SNS "
                        f"subscription of topic {names.topic!r} to that queue (or its topic's "
                        f"messages keep arriving among the dead letters) and the queue's "
                        f"redrive policy (`aws sqs set-queue-attributes --attributes "
                        f"RedrivePolicy=`; or the dead letters move on to "
                        f"{names.dead_letter_queue!r} after max_attempts + 1 reads of the "
                        "dead-letter queue)."
                    )
                    provisioner.changes.append(
                        ProvisionChange("refuse", "SQS queue", names.queue, f"{problem}{cleanup}")
                    )
                    continue
                if problem is not None:
                    raise WorkQueueConfigurationError(problem)
                provisioner.subscription(topic, subscription, names, topic_arn)
        return provisioner.changes

    # -- autoscaling ------------------------------------------------------------------------

    def scaler_query_refusal(self, subscription: Any) -> str | None:
        topic = subscription.topic
        settings = AwsSettings.parse(topic.transport.configuration)
        queue = AwsNames.of(settings.prefix, topic.name, subscription.name, topic.is_fifo).queue
        return (
            f"Subscription {subscription.name!r} is on the AWS transport: its messages wait in "
            f"the SQS queue {queue!r} (region {settings.region}), not in this database, so the "
            "scaler query would always answer 0. Scale `workqueue_work --once` jobs with "
            f"KEDA's aws-sqs-queue scaler on that queue (queueURL: {queue}, awsRegion: "
            f"{settings.region}); see the README's AWS transport section."
        )

    # -- consuming --------------------------------------------------------------------------

    def receiver(self, subscription_id: str, lease_owner: str | None = None) -> AwsReceiver:
        return AwsReceiver(QueueBinding.of(subscription_id), lease_owner)

    # -- operator reads ---------------------------------------------------------------------

    def subscription_stats(
        self, subscription_id: str, cap: int | None = None
    ) -> dict[str, Any] | None:
        """Counts from the queues' approximate attributes, which cost the same whatever the
        backlog (so never capped). SQS keeps no history: completions of the last hour and the
        oldest message's age are not known (reported as None)."""
        binding = QueueBinding.of(subscription_id)
        queue = _queue_counts(binding, binding.names.queue)
        dead = _queue_counts(binding, binding.names.dead_letter_queue)
        return {
            "pending": queue["ApproximateNumberOfMessages"]
            + queue["ApproximateNumberOfMessagesDelayed"],
            "in_flight": queue["ApproximateNumberOfMessagesNotVisible"],
            "dead_lettered": dead["ApproximateNumberOfMessages"]
            + dead["ApproximateNumberOfMessagesNotVisible"],
            "blocked_keys": None,
            "oldest_pending_age_seconds": None,
            "completed_last_hour": None,
            "as_of": _now(),
            "capped": False,
        }

    def queue_gauges(self, subscription_id: str, cap: int) -> dict[str, Any] | None:
        """The approximate queue counts; SQS's counts cost the same whatever the backlog."""
        stats = self.subscription_stats(subscription_id)
        if stats is None:
            return None
        keys = ("pending", "in_flight", "dead_lettered")
        return {
            **{key: min(stats[key], cap) for key in keys},
            "blocked_keys": None,
            "oldest_pending_age_seconds": None,
        }

    def backlog(self, subscription_id: str) -> Backlog | None:
        binding = QueueBinding.of(subscription_id)
        queue = _queue_counts(binding, binding.names.queue)
        return Backlog(
            claimable=queue["ApproximateNumberOfMessages"],
            in_flight=queue["ApproximateNumberOfMessagesNotVisible"],
            capped=False,
        )

    def list_dead_letters(
        self,
        subscription_id: str,
        after_delivery_id: str | None,
        page_size: int,
        *,
        with_payload: bool = True,
    ) -> list[DeadLetterItem]:
        """A page of the DLQ by id. SQS cannot be read without receiving: the DLQ's messages
        (up to DEAD_LETTER_SCAN_LIMIT) are received, read and made visible again; their bodies
        come whole, and each keeps its payload only ``with_payload`` (as text: one body is
        decoded at a time)."""
        binding = QueueBinding.of(subscription_id)
        with _dead_letter_scan(binding) as found:
            items = sorted(
                (_dead_letter_item(binding, m, with_payload) for m in found),
                key=lambda i: i.delivery_id,
            )
        page: list[DeadLetterItem] = []
        later = [i for i in items if after_delivery_id is None or i.delivery_id > after_delivery_id]
        fill_dead_letter_page(page, later, page_size)
        return page

    # -- operator writes --------------------------------------------------------------------

    def replay(
        self, subscription_id: str, delivery_id: str, actor: str | None, note: str | None
    ) -> bool:
        """Send the dead letter back to the subscription's queue as a new SQS message (so its
        receive count, the attempt, starts again at 1), then delete it from the DLQ."""
        binding = QueueBinding.of(subscription_id)
        replayed = _resolve_dead_letter_by_id(binding, "Replay", delivery_id)
        if replayed:
            _log_resolution(binding, f"Dead letter {delivery_id}", "replayed", actor, note)
        return replayed

    def discard(
        self, subscription_id: str, delivery_id: str, actor: str | None, reason: str | None
    ) -> DiscardResult:
        """Delete a dead letter from the DLQ. A message waiting in the queue itself cannot be
        picked out by id without receiving it from under the consumers: not discarded."""
        binding = QueueBinding.of(subscription_id)
        discarded = _resolve_dead_letter_by_id(binding, "Discard", delivery_id)
        if discarded:
            _log_resolution(binding, f"Dead letter {delivery_id}", "discarded", actor, reason)
        return DiscardResult(changed=discarded)

    def resolve_dead_letters(
        self, subscription_id: str, action: str, selection: dict[str, Any], **options: Any
    ) -> dict[str, Any]:
        """One batch of a bulk replay or discard of the dead letters matching ``selection``,
        in delivery id order after the cursor ``after_delivery_id`` (``_bulk_cursor``).

        A read of the DLQ sees at most DEAD_LETTER_SCAN_LIMIT dead letters, chosen by SQS,
        with ids anywhere: a DLQ holding more has dead letters below the cursor that no batch
        of that walk saw, and a bulk replay of an outage's 5,000 changed about 1,000 and
        reported itself done. So when a walk of the ids reaches the end of what its reads saw,
        and a read was full, and the walk changed some (they left the DLQ, making room for
        others in the next read), a new walk starts from the lowest id, within this batch.
        A walk that changed nothing ends the operation: what its reads saw did not match, and
        a read again would see the same. A dry run changes nothing, so it makes one walk."""
        binding = QueueBinding.of(subscription_id)
        batch_size = options["batch_size"]
        dry_run = bool(options.get("dry_run"))
        walk, walk_changed, after = _bulk_cursor(options.get("after_delivery_id"))
        changed = examined = 0
        while True:
            done, looked_at, after, full = self._resolve_a_batch(
                binding, action, selection, after, batch_size - examined, dry_run
            )
            changed += done
            examined += looked_at
            walk_changed = walk_changed or done > 0
            if examined >= batch_size or dry_run or not full or not walk_changed:
                break
            # The end of this walk's ids: the next read, from the lowest id, sees dead
            # letters this walk's reads could not (the changed ones left the DLQ).
            walk, walk_changed, after = walk + 1, False, None
        if changed and not dry_run:
            done_to = "replayed" if action == "Replay" else "discarded"
            what = f"{changed} dead letter{'s' if changed != 1 else ''} (a bulk batch)"
            _log_resolution(binding, what, done_to, options.get("actor"), options.get("note"))
        return {
            "examined": examined,
            "changed": changed,
            "last_delivery_id": None
            if after is None
            else f"{walk}{_CURSOR_SEPARATOR}{int(walk_changed)}{_CURSOR_SEPARATOR}{after}",
        }

    @staticmethod
    def _resolve_a_batch(
        binding: QueueBinding,
        action: str,
        selection: dict[str, Any],
        after: str | None,
        batch_size: int,
        dry_run: bool,
    ) -> tuple[int, int, str | None, bool]:
        """Up to ``batch_size`` dead letters of one read of the DLQ after the id ``after``:
        (how many were changed, how many examined, the last id examined, or ``after`` when
        none was, whether the read was full: the DLQ may hold more than it saw)."""
        changed = 0
        late: list[str] = []
        scan = _dead_letter_scan(binding)
        with scan as found:
            full = len(found) >= DEAD_LETTER_SCAN_LIMIT
            ordered = sorted(
                (m for m in found if after is None or _dead_letter_id(m) > after),
                key=_dead_letter_id,
            )[:batch_size]
            for message in ordered:
                if not _selected(_dead_letter_item(binding, message, False), selection):
                    continue
                if dry_run:
                    changed += 1
                elif scan.holds_hidden():
                    # Changed with the receipt handle of this scan, which hides it from every
                    # other reader meanwhile. Each looked up by a scan of its own instead, a
                    # batch of N dead letters read the DLQ N + 1 times (a 1,000-letter replay
                    # took tens of minutes).
                    _resolve_dead_letter(binding, action, message)
                    found.remove(message)
                    changed += 1
                else:
                    late.append(_dead_letter_id(message))
        for delivery_id in late:
            # Past half the scan's hiding: each looked up again once the scan let go of it (one
            # another caller changed meanwhile is not counted here).
            changed += int(_resolve_dead_letter_by_id(binding, action, delivery_id))
        last = _dead_letter_id(ordered[-1]) if ordered else after
        return changed, len(ordered), last, full


def _log_resolution(
    binding: QueueBinding, what: str, done: str, actor: str | None, note: str | None
) -> None:
    """The record of an operator's replay or discard: the Database transport writes who acted
    and the note on the delivery (``resolved_by``, ``resolution_note``), but a dead letter SQS
    held leaves the DLQ with the operation, and a discard left no trace of who deleted it or
    why. The actor and note are written as Python literals: they cannot forge a line."""
    logger.info("%s of %s %s by %r (note: %r)", what, binding.subscription_name, done, actor, note)


#: Separates a bulk operation's cursor's parts (``_bulk_cursor``).
_CURSOR_SEPARATOR = "/"


def _bulk_cursor(cursor: str | None) -> tuple[int, bool, str | None]:
    """A bulk operation's cursor, as ``resolve_dead_letters`` wrote it: (which walk of the ids,
    whether that walk changed any dead letter, the last delivery id it examined)."""
    if not cursor:
        return 0, False, None
    walk, walk_changed, after = cursor.split(_CURSOR_SEPARATOR, 2)
    return int(walk), walk_changed == "1", after


# -- publishing helpers --------------------------------------------------------------------


def _row(
    message_id: str, status: str, error_code: str | None = None, error_message: str | None = None
) -> dict[str, Any]:
    row = {"message_id": message_id, "status": status, "error_code": error_code}
    if error_message:
        row["error_message"] = error_message
    return row


def _topic_refusal(topic: Any, external: bool) -> str | None:
    if topic.status != "Active" or topic.transport.status != "Active":
        return PublishErrorCode.TOPIC_DISABLED
    if external and not topic.allow_external_publish:
        return PublishErrorCode.TOPIC_NOT_EXTERNALLY_PUBLISHABLE
    return None


def _find_topic_arn(clients: AwsClients, name: str) -> str | None:
    for topic in _listed(clients, "list_topics", "Topics"):
        if topic["TopicArn"].rsplit(":", 1)[-1] == name:
            return str(topic["TopicArn"])
    return None


def _subscription_arn(clients: AwsClients, topic_arn: str, queue_arn: str) -> str | None:
    """The SNS subscription of ``topic_arn`` that delivers to ``queue_arn``, if any."""
    for subscription in _listed(
        clients, "list_subscriptions_by_topic", "Subscriptions", TopicArn=topic_arn
    ):
        if subscription["Endpoint"] == queue_arn:
            return str(subscription["SubscriptionArn"])
    return None


def _listed(clients: AwsClients, operation: str, key: str, **params: Any) -> Iterator[Any]:
    """Every item SNS's paginated ``operation`` lists under ``key``; AWS's failures, raised
    lazily page by page, as TransportUnavailableError (as ``_call`` turns a single call's)."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        for page in clients.sns.get_paginator(operation).paginate(**params):
            yield from page.get(key, [])
    except (BotoCoreError, ClientError) as exc:
        raise _unavailable(f"AWS could not {operation}", exc) from None


def _sns_entry(
    topic: Any, message: dict[str, Any], publisher: str, published_at: str
) -> tuple[dict[str, Any], int]:
    """The PublishBatch entry of one message, and its size as SQS counts it."""
    envelope = {
        "message_id": message["message_id"],
        "topic_id": str(topic.id),
        "partition_key": message["partition_key"],
        "attributes": message["attributes"],
        "payload": message["payload"],
        "payload_ref": message["payload_ref"],
        "correlation_id": message["correlation_id"],
        "published_at": published_at,
        "published_by": publisher,
    }
    body = _sqs_json(envelope)
    attributes = message["attributes"] or NO_ATTRIBUTES_MARKER
    entry: dict[str, Any] = {"Message": body, "MessageAttributes": _string_attributes(attributes)}
    if topic.is_fifo:
        entry["MessageGroupId"] = _group_id(message["partition_key"], message["message_id"])
        # Our message id and its content: SNS drops a re-publish of the same message within
        # its 5-minute window (botocore's retry of a send whose answer was lost). The id alone
        # also dropped a publish that reused an id this process generated (the ledger records
        # only the ids a publisher chose) with other content: Accepted, then lost.
        entry["MessageDeduplicationId"] = _deduplication_id(
            "publish", message["message_id"], content_fingerprint(topic.id, message)
        )
    return entry, len(body.encode()) + _attribute_bytes(attributes)


def _sent(
    clients: AwsClients, topic_arn: str, batch: list[tuple[int, dict[str, Any]]], *, once: bool
) -> list[tuple[int, str | None, bool]]:
    """(index, None when SNS took it else what SNS said, whether it may have arrived all the
    same) of each entry of ``batch`` (one of ``_batches``), published in one call; with
    ``once``, a call whose answer may be lost is never made again (see
    ``AwsClients.sns_once``), while one that cannot have arrived is, as botocore would."""
    try:
        failed = (
            _publish_batch(clients.sns_once, topic_arn, batch, ONE_ATTEMPT_SAFE_TRIES)
            if once
            else _publish_batch(clients.sns, topic_arn, batch, 1)  # botocore retries
        )
    except TransportUnavailableError as exc:
        # Through botocore's retries the last failure tells nothing of the earlier tries.
        arrived = isinstance(exc, TransientTransportError) and (exc.may_have_arrived or not once)
        failed = dict.fromkeys(range(len(batch)), (str(exc), arrived))
    return [(index, *failed.get(i, (None, False))) for i, (index, _) in enumerate(batch)]


def _publish_batch(
    sns: Any, topic_arn: str, batch: list[tuple[int, dict[str, Any]]], tries: int
) -> dict[int, tuple[str, bool]]:
    """Publish ``batch`` (one entry: Publish; more: PublishBatch); SNS's refusals of single
    entries by position, with False (not taken). A failure of the call is raised, after up to
    ``tries`` tries while it cannot have arrived (no connection, throttled)."""
    if len(batch) == 1:
        _call_while_unsent(tries, sns.publish, TopicArn=topic_arn, **batch[0][1])
        return {}
    request = [{"Id": str(i), **entry} for i, (_, entry) in enumerate(batch)]
    answer = _call_while_unsent(
        tries, sns.publish_batch, TopicArn=topic_arn, PublishBatchRequestEntries=request
    )
    return {
        int(f["Id"]): (f"SNS refused it: {f.get('Code')}: {f.get('Message')}", False)
        for f in answer.get("Failed", [])
    }


def _call_while_unsent(tries: int, method: Any, **params: Any) -> dict[str, Any]:
    """``_call(method, **params)``, made again, up to ``tries`` calls in all, while it fails in
    a way that cannot have reached AWS (no connection, throttled): through a one-attempt
    client a send whose answer was lost is never made twice, and these lose nothing."""
    for attempt in range(1, tries + 1):
        try:
            return _call(method, **params)
        except TransientTransportError as exc:
            if exc.may_have_arrived or attempt == tries:
                raise
            time.sleep(0.05 * 2**attempt)
    raise AssertionError("unreachable")


def _what_the_publisher_reads(detail: str, topic_name: str, external: bool, count: int) -> str:
    """What AWS said when it took none of ``count`` messages (``detail``, the first refusal):
    for a publisher in this process, as said. What AWS says (the server's IAM identity, its
    endpoint, the topic's SNS name) is for this server's operators, not for an API key's
    publisher: they get it logged instead, once."""
    if not external:
        return detail
    logger.warning("Publishing %d message(s) to topic %r failed: %s", count, topic_name, detail)
    return EXTERNAL_UNAVAILABLE_TEXT


def _batches(
    entries: list[tuple[int, dict[str, Any]]],
) -> Iterator[list[tuple[int, dict[str, Any]]]]:
    batch: list[tuple[int, dict[str, Any]]] = []
    size = 0
    for index, entry in entries:
        entry_size = len(entry["Message"].encode()) + _attribute_bytes(
            {k: v["StringValue"] for k, v in entry.get("MessageAttributes", {}).items()}
        )
        if batch and (len(batch) == SQS_BATCH_MAX or size + entry_size > SQS_MAX_MESSAGE_BYTES):
            yield batch
            batch, size = [], 0
        batch.append((index, entry))
        size += entry_size
    if batch:
        yield batch


# -- provisioning helpers ------------------------------------------------------------------


class _Provisioner:
    """Creates or updates resources (or, on a dry run, says it would), recording each."""

    def __init__(self, clients: AwsClients, dry_run: bool) -> None:
        self.clients = clients
        self.dry_run = dry_run
        self.changes: list[ProvisionChange] = []

    def _record(self, action: str, kind: str, name: str, detail: str = "") -> None:
        self.changes.append(ProvisionChange(action, kind, name, detail))

    def topic(self, name: str, fifo: bool) -> str | None:
        arn = _find_topic_arn(self.clients, name)
        if arn is not None:
            self._record("keep", "sns-topic", name)
            return arn
        self._record("create", "sns-topic", name, "FIFO" if fifo else "")
        if self.dry_run:
            return None
        attributes = {"FifoTopic": "true", "ContentBasedDeduplication": "false"} if fifo else {}
        return _call(self.clients.sns.create_topic, Name=name, Attributes=attributes)["TopicArn"]

    def subscription(
        self, topic: Any, subscription: Any, names: AwsNames, topic_arn: str | None
    ) -> None:
        fifo = topic.is_fifo
        dead_arn = self.queue(
            names.dead_letter_queue,
            fifo,
            {
                "MessageRetentionPeriod": str(SQS_MAX_RETENTION_SECONDS),
                "MaximumMessageSize": str(SQS_QUEUE_MAX_MESSAGE_BYTES),
            },
        )
        wanted = {
            "VisibilityTimeout": str(subscription.lease_seconds),
            # SNS carries at most SQS_MAX_MESSAGE_BYTES, but a settle's send is bigger: a
            # copy's body names its delivery and attempts, and a dead letter carries its
            # reason and error as attributes, which SQS counts. A queue made with the 256 KiB
            # that was SQS's default until 2025 refused the dead letter of a message near
            # the limit; SQS's largest leaves room for all of them.
            "MaximumMessageSize": str(SQS_QUEUE_MAX_MESSAGE_BYTES),
            # SQS deletes a message its retention outlived, settled or not: the topic's
            # retention_days is about settled work (which SQS deletes at once), so waiting work
            # is kept as long as SQS allows, as the Database transport keeps it for ever.
            "MessageRetentionPeriod": str(SQS_MAX_RETENTION_SECONDS),
            # A backstop only: the receiver moves a message whose receive count passed
            # max_attempts itself, with its reason; SQS moves one a receive later.
            "RedrivePolicy": json.dumps(
                {
                    "deadLetterTargetArn": dead_arn
                    or _queue_arn_beside(topic_arn, names.dead_letter_queue),
                    "maxReceiveCount": subscription.max_attempts + 1,
                },
                sort_keys=True,
            ),
        }
        if topic_arn is not None:
            wanted["Policy"] = json.dumps(
                _queue_policy(_queue_arn_beside(topic_arn, names.queue), topic_arn)
            )
        queue_arn = self.queue(names.queue, fifo, wanted)
        if topic_arn is None or queue_arn is None:
            self._record("create", "subscription", f"{names.topic} -> {names.queue}")
            return
        self.sns_subscription(subscription, names, topic_arn, queue_arn)

    def queue(self, name: str, fifo: bool, wanted: dict[str, str]) -> str | None:
        sqs = self.clients.sqs
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            url = sqs.get_queue_url(QueueName=name)["QueueUrl"]
        except ClientError as exc:
            if _error_code(exc) not in _NOT_FOUND_CODES:
                raise _unavailable("AWS refused get_queue_url", exc) from None
            url = None
        except BotoCoreError as exc:  # unreachable, no credentials, ...: not "missing"
            raise _unavailable("AWS could not answer get_queue_url", exc) from None
        if url is None:
            self._record("create", "sqs-queue", name, ", ".join(sorted(wanted)))
            if self.dry_run:
                return None
            attributes = dict(wanted)
            if fifo:
                attributes["FifoQueue"] = "true"
            url = _call(sqs.create_queue, QueueName=name, Attributes=attributes)["QueueUrl"]
            self.clients.forget_queue(name)
            return _queue_arn(self.clients, url)
        current = _call(sqs.get_queue_attributes, QueueUrl=url, AttributeNames=["All"])[
            "Attributes"
        ]
        differing = {k: v for k, v in wanted.items() if not _same_attribute(current.get(k), v)}
        if not differing:
            self._record("keep", "sqs-queue", name)
        else:
            self._record("update", "sqs-queue", name, ", ".join(sorted(differing)))
            if not self.dry_run:
                # Every wanted attribute, not only the changed ones: moto (5.2.5) drops a
                # queue's Policy on a SetQueueAttributes that leaves it out; AWS keeps it.
                _call(sqs.set_queue_attributes, QueueUrl=url, Attributes=wanted)
        return current.get("QueueArn")

    def sns_subscription(
        self, subscription: Any, names: AwsNames, topic_arn: str, queue_arn: str
    ) -> None:
        sns = self.clients.sns
        if (
            subscription.status == SubscriptionStatus.DISABLED
            or subscription.filter_problem() is not None
        ):
            # A filter invalid in the table (written behind the guard, or before it) matches
            # no message, as the Database transport's fan-out decides. Parsed, it stopped the
            # whole provisioning run (FilterError), and one stored as JSON text was read as
            # the filter it spells, so SNS delivered what no other reader would.
            policy = DISABLED_FILTER_POLICY
        else:
            policy = filter_policy(parse_filter(subscription.filter))
        wanted = {
            "RawMessageDelivery": "true",
            "FilterPolicy": json.dumps(policy, sort_keys=True) if policy else "",
        }
        label = f"{names.topic} -> {names.queue}"
        existing = _subscription_arn(self.clients, topic_arn, queue_arn)
        if existing is None:
            self._record("create", "subscription", label, "filter policy" if policy else "")
            if not self.dry_run:
                attributes = {k: v for k, v in wanted.items() if v}
                _call(
                    sns.subscribe,
                    TopicArn=topic_arn,
                    Protocol="sqs",
                    Endpoint=queue_arn,
                    Attributes=attributes,
                    ReturnSubscriptionArn=True,
                )
            return
        current = _call(sns.get_subscription_attributes, SubscriptionArn=existing)["Attributes"]
        differing = {k: v for k, v in wanted.items() if not _same_attribute(current.get(k, ""), v)}
        if not differing:
            self._record("keep", "subscription", label)
            return
        self._record("update", "subscription", label, ", ".join(sorted(differing)))
        if self.dry_run:
            return
        for key, value in differing.items():
            _call(
                sns.set_subscription_attributes,
                SubscriptionArn=existing,
                AttributeName=key,
                # An empty policy removes the filter.
                AttributeValue=value or "{}",
            )


def _same_attribute(current: str | None, wanted: str) -> bool:
    if current == wanted:
        return True
    if current is None:
        return wanted == ""
    try:
        current_json, wanted_json = json.loads(current or "{}"), json.loads(wanted or "{}")
    except ValueError:
        return False
    return current_json == wanted_json


def _queue_policy(queue_arn: str, topic_arn: str) -> dict[str, Any]:
    """Allow the topic, and only the topic, to send to the queue."""
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Sid": "workqueue-sns",
                "Effect": "Allow",
                "Principal": {"Service": "sns.amazonaws.com"},
                "Action": "sqs:SendMessage",
                "Resource": queue_arn,
                "Condition": {"ArnEquals": {"aws:SourceArn": topic_arn}},
            }
        ],
    }


def _queue_arn_beside(topic_arn: str | None, queue_name: str) -> str:
    """The ARN of queue ``queue_name`` in the topic's region and account (the transport's one
    session makes both), or, on a dry run before the topic exists, a placeholder to show."""
    if topic_arn is None:
        return f"arn:aws:sqs:<region>:<account>:{queue_name}"
    _, partition, _, region, account, _ = topic_arn.split(":", 5)
    return f"arn:{partition}:sqs:{region}:{account}:{queue_name}"


def _queue_arn(clients: AwsClients, url: str) -> str:
    return _call(clients.sqs.get_queue_attributes, QueueUrl=url, AttributeNames=["QueueArn"])[
        "Attributes"
    ]["QueueArn"]


# -- operator helpers ----------------------------------------------------------------------


def _queue_counts(binding: QueueBinding, name: str) -> dict[str, int]:
    attributes = _call(
        binding.clients.sqs.get_queue_attributes,
        QueueUrl=binding.clients.queue_url(name),
        AttributeNames=[
            "ApproximateNumberOfMessages",
            "ApproximateNumberOfMessagesNotVisible",
            "ApproximateNumberOfMessagesDelayed",
        ],
    )["Attributes"]
    return {k: int(v) for k, v in attributes.items()}


class _dead_letter_scan:
    """Receive the DLQ's messages (up to DEAD_LETTER_SCAN_LIMIT), and on exit make those still
    listed visible again. Two scans at once each see only part of the DLQ."""

    def __init__(self, binding: QueueBinding, looking_for: str | None = None) -> None:
        """``looking_for``: a delivery id, once read, ends the scan (a replay or discard by id
        read the whole DLQ first, longer than it hides what it reads on a big one)."""
        self.binding = binding
        self.looking_for = looking_for
        self.found: list[dict[str, Any]] = []
        self.started = 0.0

    def holds_hidden(self) -> bool:
        """Whether the messages received are still hidden by this scan, with time to spare
        for a call: within half of DEAD_LETTER_SCAN_VISIBILITY from its first receive."""
        return time.monotonic() - self.started < DEAD_LETTER_SCAN_VISIBILITY / 2

    def __enter__(self) -> list[dict[str, Any]]:
        self.started = time.monotonic()
        seen: set[str] = set()
        while len(self.found) < DEAD_LETTER_SCAN_LIMIT:
            answer = _call(
                self.binding.clients.sqs.receive_message,
                QueueUrl=self.binding.dead_letter_queue_url,
                MaxNumberOfMessages=SQS_BATCH_MAX,
                WaitTimeSeconds=DEAD_LETTER_SCAN_WAIT_SECONDS,
                VisibilityTimeout=DEAD_LETTER_SCAN_VISIBILITY,
                MessageSystemAttributeNames=["SentTimestamp"],
                MessageAttributeNames=["All"],
            )
            fresh = [m for m in answer.get("Messages", []) if m["MessageId"] not in seen]
            if not fresh:
                break
            seen.update(m["MessageId"] for m in fresh)
            self.found.extend(fresh)
            if self.looking_for is not None and any(
                _dead_letter_id(m) == self.looking_for for m in fresh
            ):
                break
        return self.found

    def __exit__(self, *exc: object) -> None:
        for start in range(0, len(self.found), SQS_BATCH_MAX):
            chunk = self.found[start : start + SQS_BATCH_MAX]
            _call(
                self.binding.clients.sqs.change_message_visibility_batch,
                QueueUrl=self.binding.dead_letter_queue_url,
                Entries=[
                    {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"], "VisibilityTimeout": 0}
                    for i, m in enumerate(chunk)
                ],
            )


def _dead_letter_id(message: dict[str, Any]) -> str:
    """The delivery id of a DLQ message: the one it had in the subscription's queue. The
    receiver's own move names it in an attribute; a message SQS's redrive moved has none, and
    keeps its body (a replayed or released one names its delivery there) and its SQS id."""
    found = message.get("MessageAttributes", {}).get(DELIVERY_ID_ATTRIBUTE, {})
    # As text whatever the body says: one written by hand with a number there made the sort
    # of every operator read of the DLQ fail, and no dead letter could be listed or changed.
    return str(
        found.get("StringValue")
        or _envelope(message["Body"]).get("delivery_id")
        or message["MessageId"]
    )


#: How many scans a replay or discard by id makes before it gives up on one that still hides
#: its dead letter when it finds it.
BY_ID_SCANS = 3


def _resolve_dead_letter_by_id(binding: QueueBinding, action: str, delivery_id: str) -> bool:
    """Replay or discard (``action``) the dead letter of ``delivery_id``, found by a scan of
    its own; False when the DLQ does not hold it.

    Only while the scan still hides it (as the bulk path asks): a scan slower than its hiding
    let another operator's replay of the id find it visible, and both replayed it, the second
    with a lapsed receipt handle (review helper-168). A scan too slow looks again."""
    for _ in range(BY_ID_SCANS):
        scan = _dead_letter_scan(binding, looking_for=delivery_id)
        with scan as found:
            message = next((m for m in found if _dead_letter_id(m) == delivery_id), None)
            if message is None:
                return False
            if scan.holds_hidden():
                _resolve_dead_letter(binding, action, message)
                found.remove(message)
                return True
    raise TransientTransportError(
        f"Dead letter {delivery_id} was not changed: each of {BY_ID_SCANS} reads of its "
        "dead-letter queue took longer than it hides what it reads (a slow SQS, or a very "
        "full queue), so another reader could have taken it. Try again."
    )


def _resolve_dead_letter(binding: QueueBinding, action: str, message: dict[str, Any]) -> None:
    """Replay or discard (``action``, "Replay" or "Discard") a dead letter a scan holds."""
    if action == "Replay":
        _replay_dead_letter(binding, message)
    else:
        _delete_dead_letter(binding, message)


def _replay_dead_letter(binding: QueueBinding, message: dict[str, Any]) -> None:
    """Send a dead letter a scan holds back to the subscription's queue as a new SQS message
    (so its receive count, the attempt, starts again at 1), then delete it from the DLQ."""
    delivery_id = _dead_letter_id(message)
    envelope = {**_envelope(message["Body"]), "replayed": True, "delivery_id": delivery_id}
    # Attempts start again at 1 (a message SQS's redrive moved keeps the body a release wrote,
    # with the attempts spent before it).
    envelope.pop("attempts_before", None)
    params: dict[str, Any] = {
        "QueueUrl": binding.queue_url,
        "MessageBody": _sqs_json(envelope),
        "MessageAttributes": _string_attributes(envelope.get("attributes") or {}),
    }
    if binding.fifo:
        params["MessageGroupId"] = _group_id(
            envelope.get("partition_key"), envelope.get("message_id") or delivery_id
        )
        # Named by the dead letter's own SQS message: each dead-lettering of the delivery is
        # replayed anew (see _deduplication_id).
        params["MessageDeduplicationId"] = _deduplication_id(
            "replay", delivery_id, message["MessageId"]
        )
    # One attempt while it may have arrived: botocore's retries of a send whose answer was
    # lost put up to four copies in the queue (review helper-168), where the settles' sends
    # make one.
    _call_while_unsent(ONE_ATTEMPT_SAFE_TRIES, binding.clients.sqs_once.send_message, **params)
    _delete_dead_letter(binding, message)


def _delete_dead_letter(binding: QueueBinding, message: dict[str, Any]) -> None:
    _call(
        binding.clients.sqs.delete_message,
        QueueUrl=binding.dead_letter_queue_url,
        ReceiptHandle=message["ReceiptHandle"],
    )


def _dead_letter_item(
    binding: QueueBinding, message: dict[str, Any], with_payload: bool
) -> DeadLetterItem:
    envelope = _envelope(message["Body"])
    payload = envelope.get("payload") if with_payload else None
    attributes = {
        k: v.get("StringValue", "") for k, v in message.get("MessageAttributes", {}).items()
    }
    sent = message.get("Attributes", {}).get("SentTimestamp")
    return DeadLetterItem(
        delivery_id=_dead_letter_id(message),
        partition_key=envelope.get("partition_key") if binding.exclusive else None,
        attempts=_count(attributes.get(ATTEMPTS_ATTRIBUTE)),
        # A message SQS's redrive moved (the backstop) carries no reason of ours.
        reason=attributes.get(REASON_ATTRIBUTE, "MaxReceiveCountExceeded"),
        last_error=attributes.get(ERROR_ATTRIBUTE),
        dead_lettered_at=_parse_time(attributes.get(DEAD_LETTERED_AT_ATTRIBUTE))
        or (dt.datetime.fromtimestamp(int(sent) / 1000, dt.UTC) if sent else None),
        blocks_key=False,
        message_id=str(envelope.get("message_id") or message["MessageId"]),
        topic=binding.topic_name,
        message_partition_key=envelope.get("partition_key"),
        attributes=envelope.get("attributes") or {},
        payload_json=None if payload is None else canonical_json(payload),
        payload_ref=stored_payload_ref(envelope.get("payload_ref")) if with_payload else None,
        correlation_id=envelope.get("correlation_id"),
        published_at=_parse_time(envelope.get("published_at")),
    )


def _selected(item: DeadLetterItem, selection: dict[str, Any]) -> bool:
    """Whether a dead letter matches a bulk operation's filters (wq_resolve_dead_letters')."""
    if selection.get("reason") and item.reason != selection["reason"]:
        return False
    if selection.get("partition_key") and item.message_partition_key != selection["partition_key"]:
        return False
    start, end = selection.get("dead_lettered_from"), selection.get("dead_lettered_before")
    at = item.dead_lettered_at
    if start is not None and (at is None or at < start):
        return False
    if end is not None and (at is None or at >= end):
        return False
    needle = selection.get("error_contains")
    return not needle or needle.lower() in (item.last_error or "").lower()


__all__ = [
    "AWS_DRIVER",
    "AwsNames",
    "AwsReceiver",
    "AwsSettings",
    "AwsTransport",
    "filter_policy",
    "filter_policy_problem",
]
