"""The console's home page is the admin's index with the fleet above the tables
(``console.views.home`` fills it in); and Django's own users and groups pages,
audited: who changed a console account or role, and which fields (a new
password is named, never recorded)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin.utils import unquote
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group, User
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse

from audit.admin import AuditedAdmin

admin.site.index_template = "console/home.html"
# Single sign-on beside (or instead of) the password form (console.sso).
admin.site.login_template = "console/login.html"


def _rows_of(
    rows: QuerySet[Any], field: str, object_id: str | None, selected: list[str] | None
) -> QuerySet[Any]:
    """Narrow a many-to-many table to the rows of the object (or those selected)."""
    if object_id is not None:
        return rows.filter(**{field: unquote(object_id)})
    if selected is not None:
        return rows.filter(**{f"{field}__in": selected})
    return rows


class AuditedUserAdmin(AuditedAdmin, UserAdmin):
    """Console users, with their groups and permissions: many-to-many tables that
    a snapshot of the user's row does not show, so they are in its scope."""

    def audit_scope(
        self, object_id: str | None, selected: list[str] | None = None
    ) -> list[QuerySet[Any]]:
        return [
            *super().audit_scope(object_id, selected),
            _rows_of(User.groups.through.objects.all(), "user_id", object_id, selected),
            _rows_of(
                User.user_permissions.through.objects.all(),
                "user_id",
                object_id,
                selected,
            ),
        ]

    def user_change_password(
        self, request: HttpRequest, id: str, form_url: str = ""
    ) -> HttpResponse:
        with self._audited(request, id):
            return super().user_change_password(request, id, form_url)


class AuditedGroupAdmin(AuditedAdmin, GroupAdmin):
    """Console roles, with their permissions and (for a deletion) their members."""

    def audit_scope(
        self, object_id: str | None, selected: list[str] | None = None
    ) -> list[QuerySet[Any]]:
        return [
            *super().audit_scope(object_id, selected),
            _rows_of(
                Group.permissions.through.objects.all(), "group_id", object_id, selected
            ),
            _rows_of(
                User.groups.through.objects.all(), "group_id", object_id, selected
            ),
        ]


admin.site.unregister(User)
admin.site.unregister(Group)
admin.site.register(User, AuditedUserAdmin)
admin.site.register(Group, AuditedGroupAdmin)
