"""Console pages for rollouts: start one through the service, then read its history.

A rollout row is history: stages advance, and rollouts end, through the services
(``set_rollout``, ``set_alias``), which also move the model's canary. Editing a
row by hand would leave the model's traffic split behind, so rows are view-only.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.http import HttpRequest
from django.utils import timezone

from config.errors import InvalidRequest
from models_registry.admin import ServiceAddForm
from rollouts import services
from rollouts.models import Rollout


class RolloutAddForm(ServiceAddForm):
    """Put a version in shadow or canary for a share of traffic."""

    class Meta:
        model = Rollout
        fields = ("model", "version", "stage", "percent")

    def create(self, cleaned_data: dict[str, Any]) -> Rollout:
        model = cleaned_data["model"]
        version = cleaned_data["version"]
        # The service takes a label; a label of another model could name a
        # different version of this one.
        if version.model_id != model.pk:
            raise InvalidRequest(
                f"{version.ref} is not a version of {model.pk}", param="version"
            )
        return services.set_rollout(
            model_id=model.pk,
            version=version.version,
            stage=cleaned_data["stage"],
            percent=cleaned_data["percent"],
            now=timezone.now(),
        )


@admin.register(Rollout)
class RolloutAdmin(admin.ModelAdmin):
    """Rollouts, newest first: stage, share, guard readings and decision."""

    form = RolloutAddForm
    list_display = (
        "model",
        "version",
        "stage",
        "percent",
        "decision",
        "started_at",
        "decided_at",
    )
    list_filter = ("decision", "stage", "model")
    search_fields = ("model__model", "version__version")
    list_select_related = ("model", "version")
    date_hierarchy = "started_at"

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        if obj is None:
            return RolloutAddForm.Meta.fields
        return (
            "model",
            "version",
            "stage",
            "percent",
            "started_at",
            "decision",
            "decided_at",
            "guard_metrics",
        )

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def save_model(
        self,
        request: HttpRequest,
        obj: Any,
        form: forms.ModelForm,
        change: bool,  # noqa: FBT001 (Django's signature)
    ) -> None:
        # On add, the form already started the rollout while validating.
        return
