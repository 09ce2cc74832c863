"""The work queue's admin: editable topology, view-only queue tables with guarded operator
actions, API keys and a dashboard.

Django's admin autodiscovery imports this package; importing the modules registers their
admins on ``django.contrib.admin.site``.
"""

from __future__ import annotations

from django.contrib import admin

from workqueue.admin import apikeys, queue, topology
from workqueue.admin.dashboard import link_dashboard_from_index

__all__ = ["apikeys", "queue", "topology"]

link_dashboard_from_index(admin.site)
