"""Admin for REST API keys: list, create (the raw key is shown once), edit limits, revoke.

Only the key's display prefix is ever shown; the hash is never displayed. A key acts as its
owner, so only superusers may create, see or change keys of other users: anyone else creating a
key for a more privileged owner would receive that owner's powers, and editing or revoking one
would widen or cut off what someone else relies on.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.auth import get_user_model
from django.db.models import Model, Q, QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.cache import patch_cache_control

from workqueue.admin.display import stored_text, visible_text
from workqueue.admin.lookups import DeclaredFiltersAdmin
from workqueue.models import ApiKey
from workqueue.models.apikeys import KEY_PREFIX, MAX_EXPIRES_DAYS, shown_prefix
from workqueue.operators.permissions import SCOPES, uncovered_scope_problem


class NameListField(forms.CharField):
    """Comma-separated names edited as text and stored as a sorted list of lower-case names."""

    def prepare_value(self, value: Any) -> Any:
        if isinstance(value, list | tuple):
            return ", ".join(value)
        return value

    def to_python(self, value: Any) -> list[str]:
        text = super().to_python(value)
        return sorted({name.strip().lower() for name in text.split(",") if name.strip()})


class _KeyLimitsForm(forms.ModelForm):
    scopes = forms.MultipleChoiceField(
        choices=[(scope, scope) for scope in SCOPES],
        widget=forms.CheckboxSelectMultiple,
        help_text="The key needs the scope AND its owner the matching Django permission.",
    )
    topics = NameListField(
        required=False,
        help_text="Comma-separated topic names (what it may publish to); empty allows any topic.",
    )
    subscriptions = NameListField(
        required=False,
        help_text=(
            "Comma-separated subscription names (what it may read and operate); empty allows "
            "any subscription."
        ),
    )

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        problem = uncovered_scope_problem(
            cleaned.get("scopes") or [],
            cleaned.get("topics") or [],
            cleaned.get("subscriptions") or [],
        )
        if problem:
            raise forms.ValidationError(problem)
        return cleaned


class ApiKeyCreateForm(_KeyLimitsForm):
    expires_days = forms.IntegerField(
        required=False,
        min_value=1,
        max_value=MAX_EXPIRES_DAYS,
        help_text="Days until the key expires; empty for no expiry.",
    )

    class Meta:
        model = ApiKey
        fields = ["owner", "name", "scopes", "topics", "subscriptions"]


class ApiKeyChangeForm(_KeyLimitsForm):
    #: Whether the editor may move an expiry later or remove it (ApiKeyAdmin.get_form sets it:
    #: superusers, who may issue any key anyway).
    may_extend_expiry = False

    class Meta:
        model = ApiKey
        fields = ["name", "scopes", "topics", "subscriptions", "expires_at"]

    def clean_expires_at(self) -> Any:
        # Any date was taken: an owner allowed to edit their keys but not to add one revived
        # their expired key, or set an expiry of 2999, past what issuing a key allows.
        expires_at = self.cleaned_data.get("expires_at")
        issued = self.instance.expires_at  # the stored one: the form is not applied yet
        latest = timezone.now() + dt.timedelta(days=MAX_EXPIRES_DAYS)
        # A stored expiry past the limit (set before it was checked) is left as it is: the
        # key's other fields can still be edited.
        if expires_at is not None and expires_at != issued and expires_at > latest:
            raise forms.ValidationError(f"An expiry is at most {MAX_EXPIRES_DAYS:,} days away.")
        if (
            not self.may_extend_expiry
            and issued is not None
            and (expires_at is None or expires_at > issued)
        ):
            raise forms.ValidationError(
                "An expiry can be brought forward, not moved later or removed (a superuser "
                "can): to keep using the API past it, ask for a new key."
            )
        return expires_at


class KeyStateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("active", "Active"),
            ("revoked", "Revoked"),
            ("expired", "Expired"),
            ("owner inactive", "Owner inactive"),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        now = timezone.now()
        unexpired = Q(revoked_at__isnull=True) & (
            Q(expires_at__isnull=True) | Q(expires_at__gt=now)
        )
        if self.value() == "active":
            return queryset.filter(unexpired, owner__is_active=True)
        if self.value() == "owner inactive":  # every call 401, though neither of the others
            return queryset.filter(unexpired, owner__is_active=False)
        if self.value() == "revoked":
            return queryset.filter(revoked_at__isnull=False)
        if self.value() == "expired":
            return queryset.filter(revoked_at__isnull=True, expires_at__lte=now)
        return queryset


ADD_FIELDS = ["owner", "name", "scopes", "topics", "subscriptions", "expires_days"]
CHANGE_FIELDS = [
    "display_key",
    "owner",
    "name",
    "scopes",
    "topics",
    "subscriptions",
    "expires_at",
    "created_at",
    "last_used_at",
    "revoked_at",
]


@admin.register(ApiKey)
class ApiKeyAdmin(DeclaredFiltersAdmin):
    # Declared filters only: ``?key_hash__startswith=`` would probe the hash never shown.
    form = ApiKeyChangeForm
    add_form = ApiKeyCreateForm
    list_display = (
        "display_key",
        "key_name",
        "owner",
        "scope_list",
        "created_at",
        "expires_at",
        "last_used_at",
        "state",
    )
    list_filter = (KeyStateFilter,)
    list_select_related = ("owner",)
    search_fields = ("name", "prefix", "owner__username")
    search_help_text = "Name, prefix (wq_<prefix> as the list shows it) or owner's username."
    readonly_fields = ("display_key", "owner", "created_at", "last_used_at", "revoked_at")
    actions = ["revoke_keys"]

    @admin.display(description="key")
    def display_key(self, obj: ApiKey) -> str:
        return f"{KEY_PREFIX}_{obj.prefix}_…"

    @admin.display(description="name", ordering="name")
    def key_name(self, obj: ApiKey) -> str | None:
        # Named by its owner, and every key is listed to a superuser: "\u202etob-yolped" read
        # "deploy-bot" there, beside the real one.
        return visible_text(obj.name)

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet, search_term: str
    ) -> tuple[QuerySet, bool]:
        found, may_have_duplicates = super().get_search_results(request, queryset, search_term)
        term = search_term.strip()
        if (stored := stored_text(term)) != term:
            # A name copied from the list, where its invisible characters show as escapes.
            found |= queryset.filter(name__icontains=stored)
        if (prefix := shown_prefix(term)) is not None:
            # As the list and the audit trail show a key (wq_<prefix>, wq_<prefix>_…).
            found |= queryset.filter(prefix=prefix)
        return found, may_have_duplicates

    @admin.display(description="scopes")
    def scope_list(self, obj: ApiKey) -> str:
        return ", ".join(obj.scopes or [])

    @admin.display(description="state")
    def state(self, obj: ApiKey) -> str:
        return obj.state

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        # Every view, search and action starts here: a non-superuser's admin holds only their
        # own keys, so another user's key is "not found" rather than refused.
        keys = super().get_queryset(request)
        if request.user.is_superuser:
            return keys
        return keys.filter(owner=request.user)

    def _may_manage(self, request: HttpRequest, obj: Any) -> bool:
        # The same rule per object, for any path that reaches a key without get_queryset().
        return obj is None or request.user.is_superuser or obj.owner_id == request.user.pk

    def has_view_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return super().has_view_permission(request, obj) and self._may_manage(request, obj)

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return super().has_change_permission(request, obj) and self._may_manage(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return super().has_delete_permission(request, obj) and self._may_manage(request, obj)

    def get_fields(self, request: HttpRequest, obj: Model | None = None) -> list[str]:
        return list(ADD_FIELDS if obj is None else CHANGE_FIELDS)

    def get_readonly_fields(self, request: HttpRequest, obj: Model | None = None) -> Any:
        return () if obj is None else self.readonly_fields

    def get_form(
        self, request: HttpRequest, obj: Model | None = None, change: bool = False, **kwargs: Any
    ) -> Any:
        if obj is None:
            kwargs["form"] = self.add_form
            return super().get_form(request, obj, change=change, **kwargs)
        form = super().get_form(request, obj, change=change, **kwargs)
        return type(form.__name__, (form,), {"may_extend_expiry": request.user.is_superuser})

    def get_changeform_initial_data(self, request: HttpRequest) -> dict[str, Any]:
        return {"owner": request.user.pk, **super().get_changeform_initial_data(request)}

    def formfield_for_foreignkey(self, db_field: Any, request: HttpRequest, **kwargs: Any) -> Any:
        if db_field.name == "owner" and not request.user.is_superuser:
            kwargs["queryset"] = get_user_model().objects.filter(pk=request.user.pk)
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def save_model(self, request: HttpRequest, obj: ApiKey, form: Any, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        key, raw_key = ApiKey.objects.issue(
            obj.owner,
            obj.scopes,
            name=obj.name,
            topics=obj.topics,
            subscriptions=obj.subscriptions,
            expires_days=form.cleaned_data.get("expires_days"),
        )
        # The admin goes on with the form's instance (log entry, redirect): make it the key.
        for field in ApiKey._meta.concrete_fields:
            setattr(obj, field.attname, getattr(key, field.attname))
        obj._state.adding = False
        obj._state.db = key._state.db
        # Kept on this request only: a message would park the secret in the messages cookie
        # (signed, not encrypted) or the session table until the next page is drawn.
        request._workqueue_new_api_key = raw_key  # type: ignore[attr-defined]

    def response_add(self, request: HttpRequest, obj: ApiKey, post_url_continue: Any = None) -> Any:
        raw_key = getattr(request, "_workqueue_new_api_key", None)
        if raw_key is None:
            return super().response_add(request, obj, post_url_continue)
        response = TemplateResponse(
            request,
            "workqueue/admin/apikey_created.html",
            {
                **self.admin_site.each_context(request),
                "opts": self.opts,
                "title": "API key created",
                "key": obj,
                "raw_key": raw_key,
            },
        )
        patch_cache_control(response, no_store=True, private=True)
        return response

    @admin.action(description="Revoke selected API keys", permissions=["change"])
    def revoke_keys(self, request: HttpRequest, queryset: QuerySet) -> None:
        revoked = 0
        for key in queryset.filter(revoked_at__isnull=True):
            key.revoke()
            self.log_change(request, key, "Revoked.")
            revoked += 1
        self.message_user(request, f"Revoked {revoked} API key(s).", messages.SUCCESS)
