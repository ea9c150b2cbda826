"""Console pages for teams, their limits, API keys and admin tokens.

Secrets are created only through ``accounts.services`` and shown once, on a page of
their own (``console/secret_created.html``) rendered straight from the add request:
they never pass through messages, the session, cookies or the admin log. After
that only the display prefix and the SHA-256 are left to show.

A key's purpose (a person's, or a batch job's) is shown, never edited: keys are
issued here for people only, and a batch job's key is view-only (its batch
revokes it), left out of the revoke action too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, TypedDict

from django import forms
from django.contrib import admin
from django.db.models import Count, Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.cache import add_never_cache_headers
from django.utils.text import capfirst

from accounts import services
from accounts.domain.entitlements import TIERS, budget_errors, normal_tiers
from accounts.domain.limits import share_overflow
from accounts.login_throttle import ConsoleLoginForm
from accounts.models import (
    AdminToken,
    ApiKey,
    RegionDemand,
    SecretRecord,
    Team,
    TeamBudget,
    TeamEntitlement,
    TeamLimit,
)
from audit.admin import AuditedAdmin

if TYPE_CHECKING:
    from django_stubs_ext import WithAnnotations


class _TeamCounts(TypedDict):
    """What ``TeamAdmin.get_queryset`` annotates on each team."""

    active_keys: int
    limit_rows: int


admin.site.site_header = "Serving platform console"
admin.site.site_title = "Serving platform console"
admin.site.index_title = "The fleet at a glance"
# Wrong passwords lock a login out for a while (accounts.login_throttle).
admin.site.login_form = ConsoleLoginForm

# The plaintext secret rides on the saved instance from save_model to response_add
# (the same object, within one request) and is popped when the page is rendered.
_SECRET_ATTR = "_plaintext_secret_shown_once"


class TeamLimitForm(forms.ModelForm):
    """Refuse a guaranteed share that would promise more than a whole pool."""

    class Meta:
        model = TeamLimit
        fields = (
            "team",
            "model",
            "tokens_per_minute",
            "max_concurrency",
            "guaranteed_share",
        )

    def clean(self) -> dict[str, Any]:
        """Check the guaranteed shares of all teams on the model, as the API does.

        The service locks the model row for this check; the console's check is
        best-effort against a concurrent API call, which re-checks under the lock.
        """
        super().clean()
        cleaned = self.cleaned_data
        model = cleaned.get("model")
        share = cleaned.get("guaranteed_share")
        if model is None or share is None:
            return cleaned
        others = TeamLimit.objects.filter(model=model)
        if self.instance.pk is not None:
            others = others.exclude(pk=self.instance.pk)
        overflow = share_overflow(
            [*others.values_list("guaranteed_share", flat=True), share]
        )
        if overflow:
            self.add_error(
                "guaranteed_share",
                f"guaranteed shares on {model.pk} would total {1 + overflow:.3f}; "
                "the shares of all teams on a model must not exceed 1",
            )
        return cleaned


class TeamLimitInline(admin.TabularInline):
    """A team's limits, one row per model."""

    model = TeamLimit
    form = TeamLimitForm
    extra = 0
    fields = ("model", "tokens_per_minute", "max_concurrency", "guaranteed_share")


class ApiKeyInline(admin.TabularInline):
    """A team's keys, read-only: the prefix identifies a key, the hash is never shown."""

    model = ApiKey
    extra = 0
    fields = ("prefix", "name", "purpose", "created_at", "last_used_at", "revoked_at")
    readonly_fields = fields
    show_change_link = True
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Keys are issued from the API key page, which shows the secret once.
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Team)
class TeamAdmin(AuditedAdmin):
    """Teams with their limits and keys on one page."""

    list_display = ("team", "name", "active_key_count", "limit_count", "created_at")
    search_fields = ("team", "name")
    date_hierarchy = "created_at"
    inlines = (TeamLimitInline, ApiKeyInline)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Team]:
        return (
            super()
            .get_queryset(request)
            .annotate(
                active_keys=Count(
                    "api_keys",
                    filter=Q(api_keys__revoked_at__isnull=True),
                    distinct=True,
                ),
                limit_rows=Count("limits", distinct=True),
            )
        )

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        # The slug is the primary key: editing it would save a second team.
        return ("team", "created_at") if obj is not None else ("created_at",)

    @admin.display(description="active keys", ordering="active_keys")
    def active_key_count(self, obj: WithAnnotations[Team, _TeamCounts]) -> int:
        return obj.active_keys

    @admin.display(description="limits", ordering="limit_rows")
    def limit_count(self, obj: WithAnnotations[Team, _TeamCounts]) -> int:
        return obj.limit_rows


@admin.register(TeamLimit)
class TeamLimitAdmin(AuditedAdmin):
    """Every team's limits on every model."""

    form = TeamLimitForm
    list_display = (
        "team",
        "model",
        "tokens_per_minute",
        "max_concurrency",
        "guaranteed_share",
        "updated_at",
    )
    list_filter = ("model", "team")
    search_fields = ("team__team", "team__name", "model__model")
    list_select_related = ("team", "model")


class TeamEntitlementForm(forms.ModelForm):
    """The tiers as boxes to tick, kept in the tiers' order."""

    tiers = forms.MultipleChoiceField(
        choices=[(tier, tier) for tier in TIERS],
        required=False,
        widget=forms.CheckboxSelectMultiple,
        help_text="None ticked: the team may use no tier on the model.",
    )

    class Meta:
        model = TeamEntitlement
        fields = ("team", "model", "tiers")

    def clean_tiers(self) -> list[str]:
        return list(normal_tiers(self.cleaned_data["tiers"]))


@admin.register(TeamEntitlement)
class TeamEntitlementAdmin(AuditedAdmin):
    """The tiers each team may use on a model (without a row: the default tiers)."""

    form = TeamEntitlementForm
    list_display = ("team", "model", "tier_list", "updated_at")
    list_filter = ("model",)
    search_fields = ("team__team", "team__name", "model__model")
    list_select_related = ("team", "model")

    @admin.display(description="tiers")
    def tier_list(self, obj: TeamEntitlement) -> str:
        return ", ".join(obj.tiers) or "none"


class TeamBudgetForm(forms.ModelForm):
    """Check a budget's thresholds together, as the API does."""

    class Meta:
        model = TeamBudget
        fields = ("team", "model", "monthly_usd", "soft_fraction", "hard_fraction")

    def clean(self) -> dict[str, Any]:
        super().clean()
        cleaned = self.cleaned_data
        usd = cleaned.get("monthly_usd")
        soft = cleaned.get("soft_fraction")
        hard = cleaned.get("hard_fraction")
        if usd is None or soft is None or hard is None:
            return cleaned
        for param, message in budget_errors(
            monthly_usd=float(usd), soft_fraction=soft, hard_fraction=hard
        ):
            self.add_error(param, message)
        return cleaned


@admin.register(TeamBudget)
class TeamBudgetAdmin(AuditedAdmin):
    """Each team's monthly USD budgets (docs/finance.md#usd-budgets)."""

    form = TeamBudgetForm
    list_display = (
        "team",
        "model",
        "monthly_usd",
        "soft_fraction",
        "hard_fraction",
        "updated_at",
    )
    list_filter = ("model",)
    search_fields = ("team__team", "team__name", "model__model")
    list_select_related = ("team", "model")


class RevokedFilter(admin.SimpleListFilter):
    """Split secrets into active and revoked ones."""

    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("active", "active"), ("revoked", "revoked")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "active":
            return queryset.filter(revoked_at__isnull=True)
        if self.value() == "revoked":
            return queryset.filter(revoked_at__isnull=False)
        return queryset


class SecretRecordAdmin(AuditedAdmin):
    """Shared pages for API keys and admin tokens: create shows once, then revoke.

    Subclasses name the fields of the add form and implement ``issue_secret``.
    """

    add_fields: ClassVar[tuple[str, ...]] = ("name",)
    record_fields: ClassVar[tuple[str, ...]] = (
        "prefix",
        "key_hash",
        "created_at",
        "last_used_at",
        "revoked_at",
    )
    # Fields of the add form that become read-only once the record exists.
    change_readonly_fields: ClassVar[tuple[str, ...]] = ()
    secret_noun: ClassVar[str] = "secret"
    actions = ("revoke_selected",)
    search_fields: ClassVar[tuple[str, ...]] = ("prefix", "name")
    date_hierarchy = "created_at"

    def issue_secret(self, form: forms.ModelForm) -> tuple[SecretRecord, str]:
        """Create the record through the service; return it and the plaintext."""
        raise NotImplementedError

    def revocable(self, queryset: QuerySet[Any]) -> QuerySet[Any]:
        """Return the part of ``queryset`` the revoke action may revoke (all)."""
        return queryset

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        if obj is None:
            return self.add_fields
        return (*self.add_fields, *self.record_fields)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        if obj is None:
            return ()
        # revoked_at is set by the revoke action only, so a revoked secret cannot be
        # brought back to life by clearing a date.
        return (*self.record_fields, *self.change_readonly_fields)

    @admin.display(boolean=True, description="active")
    def active(self, obj: SecretRecord) -> bool:
        return obj.is_active

    def save_model(
        self,
        request: HttpRequest,
        obj: Any,
        form: forms.ModelForm,
        change: bool,  # noqa: FBT001 (Django's signature)
    ) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        record, secret = self.issue_secret(form)
        # Adopt the service's row so the admin log and redirects see the saved key.
        for field in record._meta.concrete_fields:
            setattr(obj, field.attname, getattr(record, field.attname))
        obj._state.adding = False
        obj._state.db = record._state.db
        setattr(obj, _SECRET_ATTR, secret)

    def response_add(
        self, request: HttpRequest, obj: Any, post_url_continue: str | None = None
    ) -> HttpResponse:
        secret = obj.__dict__.pop(_SECRET_ATTR, None)
        if secret is None:
            return super().response_add(request, obj, post_url_continue)
        opts = self.opts
        name = f"admin:{opts.app_label}_{opts.model_name}"
        context = {
            **self.admin_site.each_context(request),
            "title": f"{capfirst(self.secret_noun)} created",
            "opts": opts,
            "record": obj,
            "secret": secret,
            "secret_noun": self.secret_noun,
            "changelist_url": reverse(
                f"{name}_changelist", current_app=self.admin_site.name
            ),
            "change_url": reverse(
                f"{name}_change", args=[obj.pk], current_app=self.admin_site.name
            ),
            "add_url": reverse(f"{name}_add", current_app=self.admin_site.name),
        }
        response = TemplateResponse(request, "console/secret_created.html", context)
        add_never_cache_headers(response)
        return response

    @admin.action(
        description="Revoke selected %(verbose_name_plural)s", permissions=["change"]
    )
    def revoke_selected(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        """Set revoked_at on the selected secrets that are still active."""
        now = timezone.now()
        ids = list(
            self.revocable(queryset)
            .filter(revoked_at__isnull=True)
            .values_list("pk", flat=True)
        )
        # Compare-and-set: a secret revoked meanwhile keeps its first revocation time.
        count = self.model.objects.filter(pk__in=ids, revoked_at__isnull=True).update(
            revoked_at=now
        )
        for record in self.model.objects.filter(pk__in=ids, revoked_at=now):
            self.log_change(request, record, [{"changed": {"fields": ["revoked_at"]}}])
        noun = self.opts.verbose_name if count == 1 else self.opts.verbose_name_plural
        self.message_user(request, f"Revoked {count} {noun}.")


@admin.register(ApiKey)
class ApiKeyAdmin(SecretRecordAdmin):
    """Team API keys: issued here or by the API, identified by their prefix.

    Keys issued here are a person's (purpose ``team``); a batch job's key
    (purpose ``batch``, minted by the platform) is listed but view-only.
    """

    add_fields = ("team", "name")
    record_fields = ("purpose", *SecretRecordAdmin.record_fields)
    change_readonly_fields = ("team",)
    secret_noun = "API key"
    list_display = (
        "prefix",
        "name",
        "team",
        "purpose",
        "active",
        "created_at",
        "last_used_at",
        "revoked_at",
    )
    list_filter = (RevokedFilter, "purpose", "team")
    search_fields = ("prefix", "name", "team__team")
    list_select_related = ("team",)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # A batch job's key is the batch's: its page is view-only.
        if obj is not None and obj.purpose == ApiKey.Purpose.BATCH:
            return False
        return super().has_change_permission(request, obj)

    def revocable(self, queryset: QuerySet[Any]) -> QuerySet[Any]:
        """Leave batch jobs' keys out: the batch revokes its own key."""
        return queryset.filter(purpose=ApiKey.Purpose.TEAM)

    def issue_secret(self, form: forms.ModelForm) -> tuple[SecretRecord, str]:
        return services.issue_key(
            team_id=form.cleaned_data["team"].pk, name=form.cleaned_data["name"]
        )


@admin.register(AdminToken)
class AdminTokenAdmin(SecretRecordAdmin):
    """Bearer tokens for the control-plane REST API at /admin/."""

    secret_noun = "admin token"
    add_fields = ("name", "scope")
    change_readonly_fields = ("scope",)
    list_display = (
        "prefix",
        "name",
        "scope",
        "active",
        "created_at",
        "last_used_at",
        "revoked_at",
    )
    list_filter = (RevokedFilter,)

    def issue_secret(self, form: forms.ModelForm) -> tuple[SecretRecord, str]:
        return services.create_admin_token(
            name=form.cleaned_data["name"], scope=form.cleaned_data["scope"]
        )


@admin.register(RegionDemand)
class RegionDemandAdmin(admin.ModelAdmin):
    """Each region's recent demand on a team's limit, by which the regions share it
    (``control.region_limits``): written by the regions' control loops, read here.
    The row with no key is the region's beat; a region whose rows stop moving is
    lost, and the others take its share."""

    list_display = ("region", "limit_key", "demand_tokens", "window_s", "heard_at")
    list_filter = ("region",)
    search_fields = ("limit_key", "region")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
