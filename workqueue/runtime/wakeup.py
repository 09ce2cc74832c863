"""Wake consumers within milliseconds of a publish or a cancel, through the database's
notifications.

Where the driver supports LISTEN/NOTIFY, one thread holds a dedicated connection listening on
the channels of the running subscriptions' topics (a publish kicks the consumers of its topic,
or, when its notification names the subscriptions that got deliveries, only theirs) and
on the cancel channel (the running delivery's holder checks its lease at once instead of at its
next heartbeat). Polling and heartbeats stay the fallback: a lost connection is re-opened with
back-off, and every consumer is kicked after a reconnect in case a publish was missed meanwhile.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from workqueue.driver.base import BaseDriver
from workqueue.exceptions import one_line
from workqueue.ids import is_uuid

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.5
MAX_RECONNECT_DELAY = 10.0

Kick = Callable[[], None]
#: Called with the cancelled delivery's id, or with None when cancels may have been missed (the
#: listener was reconnecting): every running delivery is then worth a look.
CancelCallback = Callable[[str | None], None]


class Wakeup:
    def __init__(self, driver: BaseDriver) -> None:
        self._driver = driver
        # channel -> kick -> the consumer's subscription id. Keyed by the kick itself: a
        # consumer's bound method is made anew at each read, and two such equal one another
        # (keyed by id(), unsubscribe found nothing, and every consumer a re-plan stopped stayed
        # registered, kicked and listened for, for the host's life).
        self._kicks: dict[str, dict[Kick, str]] = {}
        self._on_cancel: CancelCallback | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listened = False  # whether the current connection has listened (see _run)
        self._outage_reported = False  # whether the current outage has been logged
        self._thread = threading.Thread(target=self._run, name="wq-wakeup", daemon=True)
        self.connected = threading.Event()

    @property
    def supported(self) -> bool:
        return self._driver.features.supports_listen_notify

    def start(self) -> None:
        if self.supported:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def subscribe(self, topic_id: str, kick: Kick, subscription_id: str) -> None:
        """Call ``kick`` when something is published to the topic for ``subscription_id``."""
        channel = self._driver.topic_channel(topic_id)
        with self._lock:
            self._kicks.setdefault(channel, {})[kick] = str(subscription_id).lower()

    def unsubscribe(self, topic_id: str, kick: Kick) -> None:
        channel = self._driver.topic_channel(topic_id)
        with self._lock:
            self._kicks.get(channel, {}).pop(kick, None)
            if not self._kicks.get(channel):
                self._kicks.pop(channel, None)

    def on_cancel(self, callback: CancelCallback) -> None:
        """Call ``callback(delivery_id)`` when an operator cancels a running delivery, and
        ``callback(None)`` after (re)connecting, for the cancels announced meanwhile."""
        self._on_cancel = callback

    def _wanted(self) -> set[str]:
        with self._lock:
            channels = set(self._kicks)
        if self._on_cancel is not None:
            channels.add(self._driver.cancel_channel)
        return channels

    def _dispatch(self, channel: str, payload: str | None) -> None:
        if channel == self._driver.cancel_channel:
            # None is this listener's own catch-up after (re)connecting. A notification names
            # the delivery cancelled (wq_cancel); any role that may connect can NOTIFY, and one
            # naming none would have every delivery this host holds renewed at once.
            if self._on_cancel is not None and (payload is None or is_uuid(payload)):
                self._on_cancel(payload)
            return
        with self._lock:
            kicks = list(self._kicks.get(channel, {}).items())
        # A payload names the subscriptions that got deliveries (wq_announce); none (a catch-up,
        # or a publish that named none) means any consumer of the topic may have work.
        named = set(payload.split(",")) if payload else None
        for kick, subscription_id in kicks:
            if named is None or subscription_id in named:
                kick()

    def _run(self) -> None:
        delay = 0.2
        while not self._stop.is_set():
            self._listened = False
            try:
                self._listen_until_stopped()
            except Exception as exc:
                if self._listened:
                    # It listened since the last failure: this cut is a new outage, whose
                    # first retry waits the shortest delay again, not what the last outage had
                    # grown it to (up to 10 s). A connection that opens but cannot LISTEN (a
                    # standby during a failover) keeps backing off.
                    delay = 0.2
                if self._outage_reported:
                    # Once an outage: each failed reconnect said the same again (seven
                    # warnings in a 15 s restart).
                    logger.debug("Notifications still lost (%s)", one_line(exc))
                else:
                    logger.warning(
                        "Notifications lost (%s); polling until reconnected",
                        one_line(exc),
                    )
                    self._outage_reported = True
                self.connected.clear()
                self._stop.wait(delay)
                delay = min(delay * 2, MAX_RECONNECT_DELAY)

    def _listen_until_stopped(self) -> None:
        listening: set[str] = set()
        listener: Any = self._driver.open_listener()
        try:
            self.connected.set()
            # Anything published while we were not listening must not wait for a poll. (Cancels
            # are caught up once, after their LISTEN below: each costs a renewal per delivery.)
            for channel in self._wanted() - {self._driver.cancel_channel}:
                self._dispatch(channel, None)
            while not self._stop.is_set():
                wanted = self._wanted()
                for channel in wanted - listening:
                    listener.listen(channel)
                    # A publish may have landed before this LISTEN took effect.
                    self._dispatch(channel, None)
                for channel in listening - wanted:
                    listener.unlisten(channel)
                listening = wanted
                if self._outage_reported:
                    logger.info("Notifications back: listening again")
                    self._outage_reported = False
                self._listened = True
                for channel, payload in listener.notifications(timeout=POLL_SECONDS):
                    self._dispatch(channel, payload)
        finally:
            self.connected.clear()
            listener.close()
