"""Console pages for models' immutable versions and pools.

The page of a model itself (its alias, canary and versions) is where its traffic
goes, so it lives in ``rollouts.admin``, beside the rollouts that move it.

A version is registered through ``models_registry.services.register_version``, so
the console applies the same rules as the REST API (storage roots, hash format,
duplicate identities). Once registered, its identity is read-only here; only the
fields the gates fill in (status, eval report, load-test figures) stay editable.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from django import forms
from django.conf import settings
from django.contrib import admin
from django.db import transaction
from django.http import HttpRequest
from django.utils.html import format_html

from config.errors import PlatformError
from models_registry import services
from models_registry.domain.identity import IDENTITY_FIELDS, VersionStatus, uri_errors
from models_registry.models import ModelVersion, Pool

# The identity as form field names: the foreign key is "model", not "model_id".
IDENTITY_FORM_FIELDS: tuple[str, ...] = tuple(
    "model" if name == "model_id" else name for name in IDENTITY_FIELDS
)
GATE_FIELDS: tuple[str, ...] = (
    "status",
    "eval_report_uri",
    "load_test_tokens_per_s",
    "load_test_tokens_in_flight",
)
# Schemes worth a link in the list; anything else is shown as text.
_LINK_SCHEMES = frozenset({"http", "https", "s3", "gs", "file"})
_STATUS_COLORS: dict[str, str] = {
    VersionStatus.REGISTERED.value: "#6c757d",
    VersionStatus.GATING.value: "#b26a00",
    VersionStatus.READY.value: "#1f6feb",
    VersionStatus.LIVE.value: "#1a7f37",
    VersionStatus.REJECTED.value: "#cf222e",
    VersionStatus.RETIRED.value: "#57606a",
}


def add_platform_error(form: forms.BaseForm, exc: PlatformError) -> None:
    """Show a service's error on the form field it names, else above the form."""
    field = exc.param if exc.param in form.fields else None
    form.add_error(field, exc.message)


class ServiceAddForm(forms.ModelForm):
    """An add form whose row is created by a service once everything else is valid.

    The admin's ``save_model`` cannot report errors to the form, so the service runs
    as the last step of validation, after the field, form and model checks, inside
    a savepoint: a refusal becomes a form error and leaves nothing behind, and
    nothing that could still fail runs after the row exists. ``form.instance``
    becomes the service's row, which the admin then logs and redirects to. The
    admin wraps the whole add request in one transaction, so a later failure rolls
    the row back as well.
    """

    def create(self, cleaned_data: dict[str, Any]) -> Any:
        """Create the row through the service; raise PlatformError to refuse."""
        raise NotImplementedError

    def full_clean(self) -> None:
        super().full_clean()
        if not self.is_bound or self.errors:
            return
        try:
            with transaction.atomic():
                created = self.create(self.cleaned_data)
        except PlatformError as exc:
            add_platform_error(self, exc)
            return
        self.instance = created


class ModelVersionAddForm(ServiceAddForm):
    """Register a version: its identity, an optional label and eval report."""

    version = forms.CharField(
        required=False,
        max_length=16,
        help_text="Leave blank for the next free label (v1, v2, ...).",
    )

    class Meta:
        model = ModelVersion
        fields = (
            "model",
            "version",
            "weights_uri",
            "weights_hash",
            "tokenizer_hash",
            "chat_template",
            "precision",
            "gpus_per_replica",
            "engine_config",
            "eval_report_uri",
        )

    def clean_weights_hash(self) -> str:
        # The API accepts either case and stores lowercase; so does the console.
        return str(self.cleaned_data["weights_hash"]).lower()

    def clean_tokenizer_hash(self) -> str:
        return str(self.cleaned_data["tokenizer_hash"]).lower()

    def create(self, cleaned_data: dict[str, Any]) -> ModelVersion:
        engine_config = cleaned_data.get("engine_config")
        return services.register_version(
            model_id=cleaned_data["model"].pk,
            version=cleaned_data.get("version") or None,
            weights_uri=cleaned_data["weights_uri"],
            weights_hash=cleaned_data["weights_hash"],
            tokenizer_hash=cleaned_data["tokenizer_hash"],
            chat_template=cleaned_data["chat_template"],
            precision=cleaned_data["precision"],
            gpus_per_replica=cleaned_data["gpus_per_replica"],
            # An emptied box means "no flags", as the model's default does.
            engine_config={} if engine_config in (None, "") else engine_config,
            eval_report_uri=cleaned_data.get("eval_report_uri") or "",
        )


class ModelVersionChangeForm(forms.ModelForm):
    """Edit what the gates fill in; the identity is not part of the form at all."""

    class Meta:
        model = ModelVersion
        fields = GATE_FIELDS

    def clean_eval_report_uri(self) -> str:
        """Apply the storage-root rule the API applies at registration."""
        uri: str = self.cleaned_data["eval_report_uri"]
        if uri:
            problems = uri_errors(uri, settings.PLATFORM_STORAGE_ROOTS)
            if problems:
                raise forms.ValidationError(f"eval_report_uri {problems[0]}")
        return uri


class VersionInline(admin.TabularInline):
    """A model's versions at a glance; each links to its own page."""

    model = ModelVersion
    extra = 0
    fields = ("version", "status", "precision", "gpus_per_replica", "created_at")
    readonly_fields = fields
    show_change_link = True
    can_delete = False
    ordering = ("-created_at",)

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Versions are registered on their own page, through the service.
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(ModelVersion)
class ModelVersionAdmin(admin.ModelAdmin):
    """Registered versions: identity fixed at registration, gate results editable."""

    list_display = (
        "ref",
        "model",
        "version",
        "status_label",
        "precision",
        "gpus_per_replica",
        "load_test_tokens_per_s",
        "load_test_tokens_in_flight",
        "eval_report",
        "created_at",
    )
    list_display_links = ("ref",)
    list_filter = ("status", "precision", "model")
    search_fields = ("model__model", "version", "weights_hash")
    list_select_related = ("model",)
    date_hierarchy = "created_at"

    def get_form(
        self,
        request: HttpRequest,
        obj: Any = None,
        change: bool = False,  # noqa: FBT001, FBT002 (Django's signature)
        **kwargs: Any,
    ) -> type[forms.ModelForm[Any]]:
        kwargs["form"] = ModelVersionAddForm if obj is None else ModelVersionChangeForm
        return super().get_form(request, obj, change, **kwargs)

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        if obj is None:
            return [(None, {"fields": ModelVersionAddForm.Meta.fields})]
        return [
            ("Identity (immutable)", {"fields": IDENTITY_FORM_FIELDS}),
            ("Gates", {"fields": GATE_FIELDS}),
            ("Timestamps", {"fields": ("created_at", "updated_at")}),
        ]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        if obj is None:
            return ()
        return (*IDENTITY_FORM_FIELDS, "created_at", "updated_at")

    def save_model(
        self,
        request: HttpRequest,
        obj: Any,
        form: forms.ModelForm,
        change: bool,  # noqa: FBT001 (Django's signature)
    ) -> None:
        # On add, the form already registered the version while validating.
        if change:
            super().save_model(request, obj, form, change)

    @admin.display(description="ref", ordering="model_id")
    def ref(self, obj: ModelVersion) -> str:
        return obj.ref

    @admin.display(description="status", ordering="status")
    def status_label(self, obj: ModelVersion) -> str:
        color = _STATUS_COLORS.get(obj.status, "#6c757d")
        return format_html(
            '<span style="color:#fff;background:{};padding:1px 6px;'
            'border-radius:3px;font-weight:bold">{}</span>',
            color,
            obj.status,
        )

    @admin.display(description="eval report")
    def eval_report(self, obj: ModelVersion) -> str:
        uri = obj.eval_report_uri
        if not uri:
            return "—"
        if urlsplit(uri).scheme not in _LINK_SCHEMES:
            return uri
        return format_html('<a href="{}" rel="noopener noreferrer">report</a>', uri)


@admin.register(Pool)
class PoolAdmin(admin.ModelAdmin):
    """The replicas of a version in a region, with the autoscaler's bounds."""

    list_display = (
        "model",
        "version",
        "region",
        "min_replicas",
        "max_replicas",
        "created_at",
    )
    list_filter = ("region", "model")
    search_fields = ("model__model", "version__version", "region")
    list_select_related = ("model", "version")
