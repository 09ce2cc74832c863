"""A watcher of the single-flight guarantee from outside the queue: it reads the InFlight rows
from its own connection while claimers race, and records every moment at which one
(subscription, partition key) was InFlight twice."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from typing import Any

import psycopg


class InFlightSampler:
    """Samples the keyed InFlight deliveries of ``subscription_ids`` (of every subscription
    when None) every ``interval`` seconds (0: as fast as it can) between ``start`` and ``stop``
    (or as a context manager). One statement per sample, so each sample is one snapshot."""

    def __init__(
        self,
        params: dict[str, Any],
        subscription_ids: list[str] | None = None,
        interval: float = 0.0,
    ) -> None:
        self.params = params
        self.subscription_ids = (
            None if subscription_ids is None else [uuid.UUID(s) for s in subscription_ids]
        )
        self.interval = interval
        self.samples = 0
        self.violations: list[dict[tuple[Any, str], int]] = []  # (subscription, key) -> rows
        self.max_keys_in_flight = 0
        self.max_owners_in_flight = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inflight-sampler", daemon=True)

    def start(self) -> InFlightSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def __enter__(self) -> InFlightSampler:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            with psycopg.connect(autocommit=True, **self.params) as conn:
                while not self._stop.wait(self.interval):
                    rows = conn.execute(
                        "SELECT subscription_id, partition_key, lease_owner "
                        "FROM workqueue_delivery "
                        "WHERE status = 'InFlight' AND partition_key IS NOT NULL "
                        "AND (%(ids)s::uuid[] IS NULL OR subscription_id = ANY(%(ids)s))",
                        {"ids": self.subscription_ids},
                    ).fetchall()
                    self.samples += 1
                    per_key = Counter((sub, key) for sub, key, _ in rows)
                    doubled = {k: n for k, n in per_key.items() if n > 1}
                    if doubled:
                        self.violations.append(doubled)
                    self.max_keys_in_flight = max(self.max_keys_in_flight, len(per_key))
                    owners = {owner for _, _, owner in rows}
                    self.max_owners_in_flight = max(self.max_owners_in_flight, len(owners))
        except BaseException as exc:
            self.error = exc
