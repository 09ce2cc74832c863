"""Wake consumers within milliseconds of a publish, through the database's notifications.

Where the driver supports LISTEN/NOTIFY, one thread holds a dedicated connection listening on
the channels of the running subscriptions' topics and kicks the matching consumers. Polling
stays the fallback: a lost connection is re-opened with back-off, and every consumer is kicked
after a reconnect in case a notification was missed meanwhile.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from workqueue.driver.base import BaseDriver

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.5
MAX_RECONNECT_DELAY = 10.0


class Wakeup:
    def __init__(self, driver: BaseDriver) -> None:
        self._driver = driver
        self._callbacks: dict[str, dict[int, Callable[[], None]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
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

    def subscribe(self, topic_id: str, callback: Callable[[], None]) -> None:
        with self._lock:
            self._callbacks.setdefault(self._driver.topic_channel(topic_id), {})[id(callback)] = (
                callback
            )

    def unsubscribe(self, topic_id: str, callback: Callable[[], None]) -> None:
        with self._lock:
            channel = self._driver.topic_channel(topic_id)
            self._callbacks.get(channel, {}).pop(id(callback), None)
            if not self._callbacks.get(channel):
                self._callbacks.pop(channel, None)

    def _wanted(self) -> set[str]:
        with self._lock:
            return set(self._callbacks)

    def _dispatch(self, channel: str) -> None:
        with self._lock:
            callbacks = list(self._callbacks.get(channel, {}).values())
        for callback in callbacks:
            callback()

    def _run(self) -> None:
        delay = 0.2
        while not self._stop.is_set():
            try:
                self._listen_until_stopped_or_broken()
                delay = 0.2
            except Exception as exc:
                logger.warning("Publish notifications lost (%s); polling until reconnected", exc)
                self.connected.clear()
                self._stop.wait(delay)
                delay = min(delay * 2, MAX_RECONNECT_DELAY)

    def _listen_until_stopped_or_broken(self) -> None:
        listening: set[str] = set()
        listener: Any = self._driver.open_listener()
        try:
            self.connected.set()
            # Anything published while we were not listening must not wait for a poll.
            for channel in self._wanted():
                self._dispatch(channel)
            while not self._stop.is_set():
                wanted = self._wanted()
                for channel in wanted - listening:
                    listener.listen(channel)
                for channel in listening - wanted:
                    listener.unlisten(channel)
                listening = wanted
                for channel in listener.notifications(timeout=POLL_SECONDS):
                    self._dispatch(channel)
        finally:
            self.connected.clear()
            listener.close()
