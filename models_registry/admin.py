"""Console pages for models' immutable versions and pools (with their autoscaling).

The page of a model itself (its alias, canary and versions) is where its traffic
goes, so it lives in ``rollouts.admin``, beside the rollouts that move it.

A version is registered through ``models_registry.services.register_version``, so
the console applies the same rules as the REST API (storage roots, hash format,
duplicate identities). Once registered, its identity is read-only here, and so is
what its gates fill in (status, eval report, load-test figures, each region's copy
of the weights): the gates' progress shows on the page, and the list's action runs
them again (``services.start_gates``).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.db import transaction
from django.http import HttpRequest
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from audit.admin import AuditedAdmin
from config.api import admin_name
from config.errors import PlatformError
from models_registry import judge_labels, services
from models_registry.domain.identity import IDENTITY_FIELDS, VersionStatus, uri_errors
from models_registry.domain.scaling import problem_field
from models_registry.models import (
    SCALING_FIELDS,
    EvalSet,
    GateRun,
    JudgeItem,
    ModelVersion,
    Pool,
    PoolSchedule,
    VersionRegion,
    clock,
)

# The identity as form field names: the foreign key is "model", not "model_id".
IDENTITY_FORM_FIELDS: tuple[str, ...] = tuple(
    "model" if name == "model_id" else name for name in IDENTITY_FIELDS
)
GATE_FIELDS: tuple[str, ...] = (
    "status_label",
    "status_reason",
    "gate_progress",
    "precision_report",
    "region_copies",
    "eval_report",
    "load_test_tokens_per_s",
    "load_test_tokens_in_flight",
    "load_test_prefix_hit_rate",
)
# Schemes worth a link in the list; anything else is shown as text.
_LINK_SCHEMES = frozenset({"http", "https", "s3", "gs", "file"})
_STATUS_COLORS: dict[str, str] = {
    VersionStatus.REGISTERED.value: "#6c757d",
    VersionStatus.EVALUATING.value: "#b26a00",
    VersionStatus.LOAD_TESTING.value: "#b26a00",
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
    """Nothing of a registered version is edited by hand: its identity is fixed and
    its gates write the rest."""

    class Meta:
        model = ModelVersion
        fields: tuple[str, ...] = ()


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
class ModelVersionAdmin(AuditedAdmin):
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
    actions = ("run_gates_again",)

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
        return (*IDENTITY_FORM_FIELDS, *GATE_FIELDS, "created_at", "updated_at")

    @admin.action(description="Run the gates of the selected versions again")
    def run_gates_again(self, request: HttpRequest, queryset: Any) -> None:
        for version in queryset:
            try:
                attempt = services.start_gates(
                    version, requested_by=admin_name(request), now=timezone.now()
                )
            except PlatformError as exc:
                self.message_user(request, exc.message, messages.ERROR)
            else:
                self.message_user(
                    request, f"{version.ref}: gates queued (attempt {attempt})"
                )

    @admin.display(description="gates")
    def gate_progress(self, obj: ModelVersion) -> str:
        summary = services.gates_summary(obj)
        if summary is None:
            return "no gates have run"
        rows = [
            (
                gate["gate"],
                gate["state"],
                f"{gate['progress']['done']}/{gate['progress']['total']}"
                if gate["progress"]["total"]
                else "",
                gate["detail"],
            )
            for gate in summary["gates"]
        ]
        # The eval gate's judge as people see it now (models_registry.judge_labels).
        agreement = judge_labels.model_agreement(obj.model)
        return format_html(
            "<p>attempt {}</p><table><tr><th>gate</th><th>state</th><th>progress</th>"
            "<th>detail</th></tr>{}</table>{}",
            summary["attempt"],
            format_html_join(
                "", "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>", rows
            ),
            format_html('<p class="judge-agreement">{}</p>', agreement["reason"])
            if agreement is not None
            else "",
        )

    @admin.display(description="precisions side by side")
    def precision_report(self, obj: ModelVersion) -> str:
        """The eval gate's three-way table, when the version changed precision:
        each precision's score per category, its drop from live, the verdict."""
        summary = services.gates_summary(obj)
        tables = [
            table
            for gate in (summary["gates"] if summary else [])
            if gate["gate"] == "eval"
            for table in (gate["result"] or {}).get("precision") or []
        ]
        if not tables:
            return "the same precision as live (or no eval yet): nothing to compare"
        return format_html_join("", "{}", ((_precision_table(t),) for t in tables))

    @admin.display(description="weights per region")
    def region_copies(self, obj: ModelVersion) -> str:
        rows = [(r.region, r.state, r.detail) for r in obj.regions.all()]
        if not rows:
            return "not copied (served from the registered URI)"
        return format_html(
            "<table>{}</table>",
            format_html_join("", "<tr><td>{}</td><td>{}</td><td>{}</td></tr>", rows),
        )

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


def _score(value: Any, spec: str = ".3f") -> str:
    return "n/a" if not isinstance(value, int | float) else format(value, spec)


def _precision_table(table: dict[str, Any]) -> str:
    columns = table.get("columns") or []
    head = format_html_join(
        "",
        "<th>{} ({})<br><small>{}</small></th>",
        (
            (c["precision"], c["role"], c.get("version") or c.get("note") or "")
            for c in columns
        ),
    )
    rows = []
    for row in table.get("categories") or []:
        cells = format_html_join(
            "",
            "<td>{} (drop {})</td>",
            (
                (
                    _score(row["scores"].get(c["precision"])),
                    _score(row["drops"].get(c["precision"]), "+.3f"),
                )
                for c in columns
            ),
        )
        low, high = row.get("interval") or [None, None]
        rows.append(
            format_html(
                "<tr><td>{}</td>{}<td>{} to {}</td><td>{}</td><td>{}</td></tr>",
                row["category"],
                cells,
                _score(low, "+.3f"),
                _score(high, "+.3f"),
                _score(row.get("margin")),
                "pass" if row.get("passed") else "FAIL",
            )
        )
    return format_html(
        "<p>{}: {}</p><table><tr><th>category</th>{}<th>candidate minus live</th>"
        "<th>margin</th><th>result</th></tr>{}</table><p><small>{}</small></p>",
        table.get("eval_set", ""),
        table.get("reason", ""),
        head,
        format_html_join("", "{}", ((r,) for r in rows)),
        table.get("statistic", ""),
    )


class ReadOnlyAdmin(admin.ModelAdmin):
    """Rows written by the platform itself; the console reads them only (no add,
    change or delete: each is a record of what happened)."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(GateRun)
class GateRunAdmin(ReadOnlyAdmin):
    """Every gate of every attempt, with its progress and why it passed or failed."""

    list_display = (
        "version",
        "attempt",
        "kind",
        "state",
        "done",
        "total",
        "detail",
        "started_at",
        "finished_at",
    )
    list_filter = ("kind", "state", "version__model")
    search_fields = ("version__model__model", "version__version", "detail")
    list_select_related = ("version",)
    date_hierarchy = "created_at"


@admin.register(JudgeItem)
class JudgeItemAdmin(ReadOnlyAdmin):
    """The judge's verdicts kept for people, and their labels (a list to export;
    reviewers label them on the console's Judge labels page)."""

    list_display = (
        "judge",
        "item_id",
        "eval_set",
        "candidate",
        "live",
        "judge_verdict",
        "candidate_side",
        "label",
        "labelled_by",
        "labelled_at",
    )
    list_filter = ("judge", "label")
    search_fields = ("judge", "item_id", "candidate", "labelled_by")
    date_hierarchy = "created_at"


@admin.register(VersionRegion)
class VersionRegionAdmin(ReadOnlyAdmin):
    """Each region's copy of each version's weights, written by the weights gate."""

    list_display = ("version", "region", "state", "uri", "detail", "updated_at")
    list_filter = ("state", "region")
    search_fields = ("version__model__model", "version__version", "region")
    list_select_related = ("version",)


class EvalSetForm(forms.ModelForm):
    """An eval set's URI must lie under a storage root, as every URI must."""

    class Meta:
        model = EvalSet
        fields = ("model", "team", "uri")

    def clean_uri(self) -> str:
        uri: str = self.cleaned_data["uri"]
        problems = uri_errors(uri, settings.PLATFORM_STORAGE_ROOTS)
        if problems:
            raise forms.ValidationError(f"uri {problems[0]}")
        return uri


@admin.register(EvalSet)
class EvalSetAdmin(AuditedAdmin):
    """Eval sets every version of a model must pass besides its default one; a
    team's own set (seed: "the team's own eval set")."""

    form = EvalSetForm
    list_display = ("model", "team", "uri", "created_at")
    list_filter = ("model", "team")
    search_fields = ("uri",)


_WEEKDAYS = [
    (0, "Mon"),
    (1, "Tue"),
    (2, "Wed"),
    (3, "Thu"),
    (4, "Fri"),
    (5, "Sat"),
    (6, "Sun"),
]
# The pool's settings a console save may write: never desired_replicas or the
# autoscaler's state, which the autoscaler writes (compare-and-set) meanwhile.
_POOL_FORM_FIELDS = (
    "model",
    "version",
    "region",
    *SCALING_FIELDS,
    "record_traffic_share",
)
_LAST_DECISIONS = 5


class PoolScheduleForm(forms.ModelForm):
    """A schedule row, with the weekdays as boxes to tick."""

    weekdays = forms.TypedMultipleChoiceField(
        choices=_WEEKDAYS, coerce=int, widget=forms.CheckboxSelectMultiple
    )

    class Meta:
        model = PoolSchedule
        fields = ("weekdays", "start_minute", "end_minute", "min_replicas")


class PoolScheduleFormSet(forms.BaseInlineFormSet):
    """Judge the rows together with the pool's settings as this save leaves them.

    One row is checked by ``PoolSchedule.clean``; rows that overlap and disagree,
    or a floor above ``max_replicas``, only show with all rows and the pool's new
    values (``models_registry.domain.scaling``).
    """

    def clean(self) -> None:
        super().clean()
        pool = self.instance
        if pool is None or any(self.errors) or pool.max_replicas is None:
            return
        rows = [
            form.instance
            for form in self.forms
            if form.cleaned_data
            and not form.cleaned_data.get("DELETE")
            and form.instance.start_minute is not None
        ]
        problems = [
            problem
            for problem in pool.scaling_problems(rows)
            if problem_field(problem) == "schedule"
        ]
        if problems:
            raise forms.ValidationError(problems)


class PoolScheduleInline(admin.TabularInline):
    """A pool's scheduled floors (UTC), edited with the pool."""

    model = PoolSchedule
    form = PoolScheduleForm
    formset = PoolScheduleFormSet
    extra = 0


@admin.register(PoolSchedule)
class PoolScheduleAdmin(AuditedAdmin):
    """Every pool's scheduled floors at a glance; they are edited on the pool's page,
    where overlapping rows are judged together."""

    list_display = ("pool", "days", "window", "min_replicas")
    list_select_related = ("pool__version", "pool__model")
    list_filter = ("pool__region",)
    search_fields = ("pool__model__model", "pool__version__version", "pool__region")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="days")
    def days(self, obj: PoolSchedule) -> str:
        names = dict(_WEEKDAYS)
        return ", ".join(names.get(d, str(d)) for d in obj.weekdays)

    @admin.display(description="window (UTC)")
    def window(self, obj: PoolSchedule) -> str:
        return f"{clock(obj.start_minute)}-{clock(obj.end_minute)}"


@admin.register(Pool)
class PoolAdmin(AuditedAdmin):
    """The replicas of a version in a region: the autoscaler's settings, its
    schedule, and a read-only panel of what it last saw and decided."""

    list_display = (
        "model",
        "version",
        "region",
        "min_replicas",
        "max_replicas",
        "desired",
        "utilisation",
        "warnings",
        "created_at",
    )
    list_filter = ("region", "model")
    search_fields = ("model__model", "version__version", "region")
    list_select_related = ("model", "version")
    inlines = (PoolScheduleInline,)
    readonly_fields = ("desired", "autoscaler", "created_at")
    fieldsets = (
        (None, {"fields": ("model", "version", "region")}),
        (
            "Replicas",
            {"fields": ("min_replicas", "max_replicas", "warm_floor", "desired")},
        ),
        (
            "Autoscaling",
            {
                "fields": (
                    "target_utilisation",
                    "scale_down_utilisation",
                    "stable_window_s",
                    "panic_window_s",
                    "panic_factor",
                    "scale_down_interval_s",
                )
            },
        ),
        ("Traffic twin", {"fields": ("record_traffic_share",)}),
        ("Autoscaler (read-only)", {"fields": ("autoscaler", "created_at")}),
    )

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> Any:
        if request.method == "GET":
            pool = self.get_object(request, object_id)
            if pool is not None:
                for warning in _pool_warnings(pool):
                    messages.warning(request, warning)
        return super().change_view(request, object_id, form_url, extra_context)

    def save_model(
        self,
        request: HttpRequest,
        obj: Any,
        form: forms.ModelForm,
        change: bool,  # noqa: FBT001 (Django's signature)
    ) -> None:
        if not change:
            super().save_model(request, obj, form, change)
            return
        # Only what the operator changed: the autoscaler writes the size meanwhile.
        obj.save(update_fields=[f for f in form.changed_data if f in _POOL_FORM_FIELDS])

    @admin.display(description="desired replicas")
    def desired(self, obj: Pool) -> int:
        return obj.target_replicas

    @admin.display(description="utilisation")
    def utilisation(self, obj: Pool) -> str:
        value = obj.last_tick().get("utilisation")
        return "—" if value is None else f"{value:.0%}"

    @admin.display(description="warnings")
    def warnings(self, obj: Pool) -> str:
        flags = []
        if obj.last_tick().get("is_capacity_exhausted"):
            flags.append("capacity exhausted")
        if _capacity(obj)[1]:
            flags.append("capacity assumed")
        return ", ".join(flags) or "—"

    @admin.display(description="what the autoscaler sees")
    def autoscaler(self, obj: Pool) -> str:
        if obj.pk is None:
            return "—"
        last = obj.last_tick()
        signals = last.get("signals") or {}
        per_replica, is_assumed = _capacity(obj)
        rows: list[tuple[str, str]] = [
            ("desired replicas", str(obj.target_replicas)),
            (
                "capacity per replica",
                f"{per_replica} tokens in flight"
                + (" (assumed: no load test)" if is_assumed else " (load test)"),
            ),
        ]
        if last:
            rows += [
                ("last tick", f"{last.get('at')} ({last.get('reason')})"),
                (
                    "serving / starting",
                    f"{int(signals.get('serving', 0))} / "
                    f"{int(signals.get('starting', 0))}",
                ),
                (
                    "utilisation",
                    _percent(last.get("utilisation"))
                    + f" (stable window {_percent(last.get('stable_utilisation'))})",
                ),
                (
                    "tokens in flight / queued",
                    f"{int(signals.get('tokens_in_flight', 0))} / "
                    f"{int(signals.get('queued_tokens', 0))} "
                    f"({int(signals.get('queue_depth', 0))} requests waiting)",
                ),
                ("panic", "yes" if last.get("is_panicking") else "no"),
                (
                    "capacity exhausted",
                    "YES" if last.get("is_capacity_exhausted") else "no",
                ),
            ]
        else:
            rows.append(("last tick", "none yet"))
        decisions = list(
            obj.scaling_decisions.order_by("-decided_at", "-id")[:_LAST_DECISIONS]
        )
        table = format_html_join(
            "", "<tr><th>{}</th><td>{}</td></tr>", ((k, v) for k, v in rows)
        )
        history = format_html_join(
            "",
            "<tr><td>{}</td><td>{} &rarr; {}</td><td>{}</td><td>{}</td></tr>",
            (
                (
                    d.decided_at.isoformat(timespec="seconds"),
                    d.from_replicas,
                    d.to_replicas,
                    d.reason,
                    _percent(d.utilisation),
                )
                for d in decisions
            ),
        )
        return format_html(
            "{}<table>{}</table><p>Last decisions</p><table>{}</table>",
            format_html_join(
                "",
                '<p style="color:#cf222e;font-weight:bold">{}</p>',
                ((w,) for w in _pool_warnings(obj)),
            ),
            table,
            history or format_html("<tr><td>{}</td></tr>", "none yet"),
        )


def _capacity(pool: Pool) -> tuple[int, bool]:
    return pool.replica_capacity(settings.PLATFORM_DEFAULT_REPLICA_TOKENS_IN_FLIGHT)


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{value:.0%}"


def _pool_warnings(pool: Pool) -> list[str]:
    """Return what an operator of the pool should know: capacity exhausted or assumed."""
    found = []
    if pool.last_tick().get("is_capacity_exhausted"):
        found.append(
            f"{pool}: capacity exhausted. The autoscaler wants more replicas than "
            f"the nodes of {pool.region} have GPUs for."
        )
    per_replica, is_assumed = _capacity(pool)
    if is_assumed:
        found.append(
            f"{pool}: capacity assumed. {pool.version} has no load test, so each "
            f"replica is taken to carry {per_replica} tokens in flight "
            "(PLATFORM_DEFAULT_REPLICA_TOKENS_IN_FLIGHT)."
        )
    return found
