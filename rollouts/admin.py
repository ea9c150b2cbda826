"""Console pages for where traffic goes: a model's alias, and its rollouts.

A model's page moves its alias through ``set_alias``, like the API. A rollout row is
history: stages advance, and rollouts end, through the services (``set_rollout``,
``set_alias``), which also move the model's canary. Editing a row by hand would
leave the model's traffic split behind, so rows are view-only.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.contrib.admin.utils import unquote
from django.db.models import ForeignKey
from django.http import HttpRequest
from django.utils import timezone

from audit.admin import AuditedAdmin
from config.errors import InvalidRequest, PlatformError
from models_registry.admin import ReadOnlyAdmin, ServiceAddForm, VersionInline
from models_registry.domain.gates import TRAFFIC_STATUSES
from models_registry.models import Model, ModelVersion
from rollouts import plans, services
from rollouts.models import GuardEvaluation, Rollout, VersionOverride


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


class GuardEvaluationInline(admin.TabularInline):
    """The guards' evaluations of a rollout, newest first: why it moved or held."""

    model = GuardEvaluation
    fields = ("at", "step", "stage", "percent", "action", "reason")
    readonly_fields = fields
    extra = 0
    max_num = 0
    can_delete = False
    ordering = ("-at", "-id")
    show_change_link = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


def _control(action: plans.Controls) -> Any:
    def run(modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: Any) -> None:
        done = 0
        for rollout in queryset.filter(decision="pending"):
            try:
                plans.control(
                    rollout.model_id,
                    action,
                    by=f"console:{request.user}",
                    now=timezone.now(),
                )
                done += 1
            except PlatformError as exc:
                modeladmin.message_user(request, exc.message, level="error")
        modeladmin.message_user(request, f"{action.value}: {done} rollout(s)")

    run.__name__ = f"rollout_{action.value}"
    run.short_description = f"{action.value.capitalize()} the selected running rollouts"  # type: ignore[attr-defined]
    return run


@admin.register(Rollout)
class RolloutAdmin(AuditedAdmin):
    """Rollouts, newest first: stage, share, guard readings and decision."""

    # Its controls move the model's alias and its versions' status; the guard
    # readings (its inline) are the guard task's, never the admin's.
    audit_related = (Model, ModelVersion, VersionOverride)
    audit_inlines = False

    form = RolloutAddForm
    inlines = (GuardEvaluationInline,)
    actions = [_control(c) for c in plans.Controls]
    list_display = (
        "model",
        "version",
        "stage",
        "percent",
        "step",
        "paused",
        "decision",
        "reason",
        "started_at",
        "decided_at",
    )
    list_filter = ("decision", "stage", "model")
    search_fields = ("model__model", "version__version")
    list_select_related = ("model", "version")
    date_hierarchy = "started_at"

    def get_inlines(self, request: HttpRequest, obj: Any = None) -> Any:
        # A rollout being added has no evaluations yet.
        return self.inlines if obj is not None else ()

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
            "reason",
            "plan",
            "step",
            "step_started_at",
            "paused",
            "approved_step",
            "previous_version",
            "retire_after",
            "retired_at",
            "guard_metrics",
        )

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # A row is history; deleting a running one would strand the model's canary.
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


class ServedModelForm(forms.ModelForm):
    """A model's page; it remembers where the alias pointed when it was loaded.

    The rollout guards move the alias by themselves (a promotion): a page loaded
    before must not move it back by saving a stale choice.
    """

    loaded_live_version = forms.CharField(required=False, widget=forms.HiddenInput)

    class Meta:
        model = Model
        fields = ("model", "description", "live_version")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk is not None:
            self.fields["loaded_live_version"].initial = str(
                self.instance.live_version_id or ""
            )

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        if self.instance.pk is None or "live_version" not in self.changed_data:
            return cleaned
        stored = (
            Model.objects.filter(pk=self.instance.pk)
            .values_list("live_version_id", flat=True)
            .first()
        )
        if cleaned.get("loaded_live_version", "") != str(stored or ""):
            raise forms.ValidationError(
                "The alias moved since this page was loaded (a rollout promoted "
                "or an admin changed it): reload the page before you change it."
            )
        return cleaned


@admin.register(Model)
class ServedModelAdmin(AuditedAdmin):
    """Model names, where their traffic goes, and their versions."""

    audit_related = (Rollout, VersionOverride)

    form = ServedModelForm

    list_display = (
        "model",
        "description",
        "live_version",
        "canary_version",
        "canary_percent",
        "updated_at",
    )
    search_fields = ("model", "description")
    list_select_related = ("live_version", "canary_version")
    inlines = (VersionInline,)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        # The name is the primary key: editing it would save a second model. The
        # canary moves only through rollouts (PUT .../rollout or the Rollout page).
        # The gate settings and the rollout plan are checked by the API (PUT
        # .../gate_config, PUT .../rollout_plan) only.
        if obj is None:
            return (
                "live_version",
                "canary_version",
                "canary_percent",
                "gate_config",
                "rollout_plan",
            )
        return (
            "model",
            "canary_version",
            "canary_percent",
            "gate_config",
            "rollout_plan",
        )

    def save_model(
        self,
        request: HttpRequest,
        obj: Model,
        form: Any,
        change: bool,  # noqa: FBT001
    ) -> None:
        """Save the description; move the alias through ``set_alias`` like the API."""
        if not change or "live_version" not in form.changed_data:
            super().save_model(request, obj, form, change)
            return
        target = obj.live_version
        obj.live_version_id = form.initial.get("live_version")
        super().save_model(request, obj, form, change)
        if target is not None:
            services.set_alias(model_id=obj.model, version=target.version)
            obj.refresh_from_db()

    def formfield_for_foreignkey(
        self, db_field: ForeignKey, request: HttpRequest, **kwargs: Any
    ) -> forms.ModelChoiceField | None:
        if db_field.name in ("live_version", "canary_version"):
            kwargs["queryset"] = _versions_of_edited_model(request)
        return super().formfield_for_foreignkey(db_field, request, **kwargs)


def _versions_of_edited_model(request: HttpRequest) -> Any:
    # On the add page the model has no versions yet, so nothing can be chosen. Only
    # versions whose gates passed may take the alias here; an override past the
    # gates, recorded with its reason, is the API's (PUT .../alias).
    match = request.resolver_match
    object_id = match.kwargs.get("object_id") if match is not None else None
    if object_id is None:
        return ModelVersion.objects.none()
    return ModelVersion.objects.filter(
        model_id=unquote(object_id), status__in=sorted(TRAFFIC_STATUSES)
    )


@admin.register(VersionOverride)
class VersionOverrideAdmin(ReadOnlyAdmin):
    """Traffic changes an admin made past the version gates: who, why, and what the
    gates said. Written by ``rollouts.services``; read here only."""

    list_display = ("at", "version", "action", "stage", "percent", "by", "reason")
    list_filter = ("action", "model")
    search_fields = ("model__model", "version__version", "by", "reason")
    list_select_related = ("version",)
    date_hierarchy = "at"


@admin.register(GuardEvaluation)
class GuardEvaluationAdmin(ReadOnlyAdmin):
    """Every tick of the rollout guards: the comparison and what it decided, and
    why. Written by the guard task (``control.rollout_guard``)."""

    list_display = ("at", "rollout", "stage", "percent", "action", "reason")
    list_filter = ("action", "stage", "rollout__model")
    search_fields = ("rollout__model__model", "rollout__version__version", "reason")
    list_select_related = ("rollout__version",)
    date_hierarchy = "at"
