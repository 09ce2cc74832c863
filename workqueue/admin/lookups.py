"""Changelists that answer only the query-string lookups their declared filters use.

Django's default ``ModelAdmin.lookup_allowed`` accepts any lookup on a local field, so a list
becomes an oracle on columns its pages never show: ``?payload__card__startswith=4`` tells, by
which rows are listed, a message's card number digit by digit. Lists that hold such columns
(payloads, key hashes) accept only their filters' own parameters; anything else is refused the
way Django refuses a disallowed relation lookup (``DisallowedModelAdminLookup``, answered 400).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin import FieldListFilter
from django.contrib.admin.utils import get_fields_from_path
from django.http import HttpRequest


def holds_a_nul(value: Any) -> bool:
    """Whether a lookup's value (or values) holds a NUL, which no stored text holds: sent to
    the database as given, PostgreSQL's refusal was a 500 mailed to ADMINS (review
    helper-167). Such a lookup is refused, answered 400, as an undeclared one is."""
    values = value if isinstance(value, list | tuple) else [value]
    return any("\x00" in str(item) for item in values)


class RefusesNulLookups(admin.ModelAdmin):
    """A ``ModelAdmin`` (Django's lookups otherwise) whose changelist refuses a NUL in a
    lookup's value."""

    def lookup_allowed(self, lookup: str, value: Any, request: HttpRequest) -> bool:
        return not holds_a_nul(value) and super().lookup_allowed(lookup, value, request)


class DeclaredFiltersAdmin(admin.ModelAdmin):
    """A ``ModelAdmin`` whose changelist allows only the lookups its ``list_filter`` reads."""

    def lookup_allowed(self, lookup: str, value: Any, request: HttpRequest) -> bool:
        return not holds_a_nul(value) and lookup in self.filter_parameters(request)

    def filter_parameters(self, request: HttpRequest) -> set[str]:
        """The query-string parameters of this list's declared filters, asked of the filters
        themselves (built the way the changelist builds them, with no parameters given)."""
        names: set[str] = set()
        for item in self.get_list_filter(request):
            if callable(item):  # a ListFilter class
                spec = item(request, {}, self.model, self)
            else:
                path, filter_class = (
                    item if isinstance(item, list | tuple) else (item, FieldListFilter.create)
                )
                field = get_fields_from_path(self.model, path)[-1]
                spec = filter_class(field, request, {}, self.model, self, field_path=path)
            names.update(spec.expected_parameters())
        return names
