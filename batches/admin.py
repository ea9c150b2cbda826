"""Console pages for batches: viewable, with a cancel action (audited); the runners
own the lines and the counts, so nothing is edited by hand."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from audit.admin import AuditedAdmin
from batches import services
from batches.models import Batch, BatchFile
from models_registry.admin import ReadOnlyAdmin


@admin.register(Batch)
class BatchAdmin(AuditedAdmin, ReadOnlyAdmin):
    """Each job: progress, deadline and what the scheduler decided, and why; a
    cancel is recorded in the audit trail with the console user."""

    list_display = (
        "id",
        "team",
        "model",
        "status",
        "total",
        "completed",
        "failed",
        "priority",
        "at_risk",
        "deadline_at",
        "schedule_reason",
    )
    list_filter = ("status", "priority", "at_risk", "model")
    search_fields = ("id", "team__team")
    list_select_related = ("team", "model")
    date_hierarchy = "created_at"
    exclude = ("key",)
    actions = ["cancel"]

    def audit_scope(
        self, object_id: str | None, selected: list[str] | None = None
    ) -> list[QuerySet[Any]]:
        # Only what a cancel writes: the runners move the counts meanwhile.
        return [
            rows.only(*services.CANCEL_FIELDS)
            for rows in super().audit_scope(object_id, selected)
        ]

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        # Actions are hidden when nothing may change; cancel is the one kept.
        actions = super().get_actions(request)
        return {k: v for k, v in actions.items() if k == "cancel"}

    @admin.action(description="Cancel the selected batches")
    def cancel(self, request: HttpRequest, queryset: QuerySet[Batch]) -> None:
        cancelled = 0
        for batch in queryset.filter(status=Batch.Status.IN_PROGRESS):
            services.cancel_batch(team_id=batch.team_id, batch_id=batch.id)
            cancelled += 1
        self.message_user(
            request, f"{cancelled} batches are cancelling", messages.SUCCESS
        )


@admin.register(BatchFile)
class BatchFileAdmin(ReadOnlyAdmin):
    list_display = ("id", "team", "purpose", "filename", "bytes", "created_at")
    list_filter = ("purpose",)
    search_fields = ("id", "team__team", "filename")
