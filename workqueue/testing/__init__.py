"""Helpers for testing the work queue and the transports it runs on.

``workqueue.testing.conformance`` holds the transport conformance suite (cases C01-C32), which
pytest runs per driver and ``manage.py workqueue conformance`` runs against any configured
database. Nothing here imports pytest.
"""

from __future__ import annotations
