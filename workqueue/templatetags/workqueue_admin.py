"""Template tags of the queue's admin pages."""

from __future__ import annotations

from typing import Any

import django
from django import template

register = template.Library()


@register.inclusion_tag("workqueue/admin/breadcrumb_trail.html")
def breadcrumb_trail(*labels_and_urls: str, current: str) -> dict[str, Any]:
    """The admin's breadcrumbs to ``current`` through each (label, URL) pair given, in the
    markup the running Django's admin stylesheet styles: a list from Django 6.1 on (its
    stylesheet has no rule for the line of links earlier versions draw)."""
    links = list(zip(labels_and_urls[::2], labels_and_urls[1::2], strict=True))
    return {"links": links, "current": current, "as_list": django.VERSION >= (6, 1)}
