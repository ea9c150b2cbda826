"""The audit trail in the console, read-only, and the mixin that audits the
console's own changes.

Public surface: ``AuditedAdmin``, ``AuditEntryAdmin``.
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar

from django.contrib import admin
from django.contrib.admin import helpers
from django.contrib.admin.utils import unquote
from django.db.models import Model, QuerySet
from django.forms.models import _get_foreign_key
from django.http import HttpRequest
from django.utils.html import format_html

from audit import services
from audit.models import AuditEntry, Source

__all__ = ["AuditEntryAdmin", "AuditedAdmin"]

_SAFE = frozenset({"GET", "HEAD", "OPTIONS"})


class AuditedAdmin(admin.ModelAdmin):
    """A console table whose changes are recorded in the audit trail.

    Every POST to its add, change, delete and list pages (the list's actions) is
    captured over the object (or the whole table where no object is named), the
    rows of its inlines, and ``audit_related``: the tables an action may change
    besides its own (a rollout's controls move the model's alias).
    """

    audit_related: ClassVar[tuple[type[Model], ...]] = ()
    # False where the inlines are rows a control loop writes (a rollout's readings).
    audit_inlines: ClassVar[bool] = True

    def audit_scope(
        self, object_id: str | None, selected: list[str] | None = None
    ) -> list[QuerySet[Any]]:
        """Return the querysets of the rows a POST to one of its pages may change:
        the object, or the rows a list action selected, or else the whole table."""
        own = self.model._default_manager.all()
        if object_id is not None:
            own = own.filter(pk=unquote(object_id))
        elif selected is not None:
            own = own.filter(pk__in=selected)
        scope = [own]
        for inline in self.inlines if self.audit_inlines else ():
            rows = inline.model._default_manager.all()
            if object_id is not None:
                fk = _get_foreign_key(self.model, inline.model, inline.fk_name)
                rows = rows.filter(**{fk.name: unquote(object_id)})
            scope.append(rows)
        scope.extend(model._default_manager.all() for model in self.audit_related)
        return scope

    def _audited(
        self,
        request: HttpRequest,
        object_id: str | None,
        selected: list[str] | None = None,
    ) -> AbstractContextManager[None]:
        if request.method in _SAFE:
            return nullcontext()
        return services.audited(
            request, source=Source.CONSOLE, scope=self.audit_scope(object_id, selected)
        )

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> Any:
        with self._audited(request, object_id):
            return super().changeform_view(request, object_id, form_url, extra_context)

    def delete_view(
        self,
        request: HttpRequest,
        object_id: str,
        extra_context: dict[str, Any] | None = None,
    ) -> Any:
        with self._audited(request, object_id):
            return super().delete_view(request, object_id, extra_context)

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> Any:
        selected = None
        # A list action on the rows ticked (not "select all"): only those.
        if request.method == "POST" and request.POST.get("select_across") != "1":
            selected = request.POST.getlist(helpers.ACTION_CHECKBOX_NAME) or None
        with self._audited(request, None, selected):
            return super().changelist_view(request, extra_context)


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)


@admin.register(AuditEntry)
class AuditEntryAdmin(admin.ModelAdmin):
    """The audit trail: read-only, filterable by actor, object type, action,
    source and time; ``/admin/audit?format=jsonl`` and ``manage.py audit_export``
    export it."""

    list_display = (
        "at",
        "actor_name",
        "remote_addr",
        "source",
        "action",
        "object_type",
        "object_id",
        "changed",
    )
    list_filter = ("actor_name", "source", "action", "object_type", "at")
    search_fields = ("actor_name", "object_id", "path", "x_request_id")
    date_hierarchy = "at"
    list_per_page = 100
    fields = (
        "at",
        "actor_kind",
        "actor_id",
        "actor_name",
        "remote_addr",
        "source",
        "method",
        "path",
        "request_id",
        "x_request_id",
        "object_type",
        "object_id",
        "action",
        "changed_fields",
        "before_json",
        "after_json",
    )
    readonly_fields = fields

    @admin.display(description="changed")
    def changed(self, entry: AuditEntry) -> str:
        return ", ".join(entry.changed_fields)

    @admin.display(description="before")
    def before_json(self, entry: AuditEntry) -> str:
        return format_html("<pre>{}</pre>", _pretty(entry.before))

    @admin.display(description="after")
    def after_json(self, entry: AuditEntry) -> str:
        return format_html("<pre>{}</pre>", _pretty(entry.after))

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        return {}  # not even "delete selected": the trail is append-only

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(
        self, request: HttpRequest, obj: AuditEntry | None = None
    ) -> bool:
        return False

    def has_delete_permission(
        self, request: HttpRequest, obj: AuditEntry | None = None
    ) -> bool:
        return False
