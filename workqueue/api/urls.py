"""URLs of the REST API, for ``path("work-queue/", include("workqueue.api.urls"))``.

The URL namespace is ``workqueue`` (e.g. ``reverse("workqueue:openapi-json")``).
"""

from __future__ import annotations

from django.urls import path

from workqueue.api import api

urlpatterns = [
    path("", api.urls),
]
