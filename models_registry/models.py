"""Models, their immutable versions, and the per-region pools that serve them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.db.models import Q

from accounts.models import sha256_validator, slug_validator
from config.names import VERSION_PATTERN
from models_registry.domain.capacity import (
    CapacityRecord,
    replica_tokens_in_flight,
    replica_tokens_per_s,
)
from models_registry.domain.gates import GateKind, GateState, RegionState
from models_registry.domain.identity import (
    IDENTITY_FIELDS,
    MAX_GPUS_PER_REPLICA,
    SHA256_PATTERN,
    Precision,
    VersionStatus,
    canonical_json,
)
from models_registry.domain.scaling import (
    MAX_PANIC_FACTOR,
    MAX_REPLICAS,
    MAX_SCALE_DOWN_INTERVAL_S,
    MAX_WINDOW_S,
    MINUTES_PER_DAY,
    ScheduleWindow,
    problem_field,
    scaling_problems,
    schedule_rule_problems,
)

version_validator = RegexValidator(VERSION_PATTERN, "Versions are labelled v1, v2, ...")


class ModelKind(models.TextChoices):
    """What a model name serves: generation, or embeddings (fixed at registration)."""

    CHAT = "chat"
    EMBEDDING = "embedding"


_HEX64 = SHA256_PATTERN


class ImmutableVersionError(ValidationError):
    """Raised when code tries to change the identity of a registered version."""


class Model(models.Model):
    """A served model name (seed: models) and where its traffic goes.

    ``live_version`` is the alias target; ``canary_version`` takes ``canary_percent``
    of conversations, split by a stable hash of the conversation id.
    """

    model = models.CharField(
        primary_key=True, max_length=64, validators=[slug_validator]
    )
    description = models.CharField(max_length=300, blank=True)
    # On the name, not the version: every version behind one alias answers the
    # same API with vectors of the same size, or clients' stored vectors break.
    kind = models.CharField(
        max_length=16, choices=ModelKind.choices, default=ModelKind.CHAT
    )
    dimensions = models.PositiveIntegerField(
        null=True, blank=True, help_text="An embedding model's vector size."
    )
    max_input_tokens = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="An embedding model's longest input, in tokens.",
    )
    live_version = models.ForeignKey(
        "ModelVersion",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="+",
    )
    canary_version = models.ForeignKey(
        "ModelVersion",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="+",
    )
    canary_percent = models.FloatField(
        default=0.0, validators=[MinValueValidator(0.0), MaxValueValidator(100.0)]
    )
    gate_config = models.JSONField(
        default=dict,
        blank=True,
        help_text="The version gates' settings (models_registry.domain.gates."
        "GateConfig): eval_set_uri, judge_model, thresholds per category, "
        "min_kappa, min_labels, load_test steps. Empty: the defaults.",
    )
    rollout_plan = models.JSONField(
        default=dict,
        blank=True,
        help_text="The model's rollout plan (rollouts.domain.plan.RolloutPlan): "
        "steps with their minimums, retention_s, guard thresholds. Empty: the "
        "default plan (shadow 1%, canary 1-10-50%, 24 h retention).",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "models"
        ordering = ["model"]
        constraints = [
            models.CheckConstraint(
                condition=Q(canary_percent__gte=0.0) & Q(canary_percent__lte=100.0),
                name="model_canary_percent_range",
            ),
            # A canary share without a canary version would send traffic nowhere.
            models.CheckConstraint(
                condition=Q(canary_version__isnull=False) | Q(canary_percent=0.0),
                name="model_canary_needs_version",
            ),
            # An embedding model has both sizes; a chat model neither.
            models.CheckConstraint(
                condition=(
                    Q(
                        kind="embedding",
                        dimensions__gte=1,
                        max_input_tokens__gte=1,
                    )
                    | Q(
                        kind="chat",
                        dimensions__isnull=True,
                        max_input_tokens__isnull=True,
                    )
                ),
                name="model_kind_sizes",
            ),
        ]

    def __str__(self) -> str:
        return self.model

    def clean(self) -> None:
        """Refuse aliases that point at another model's versions."""
        for field in ("live_version", "canary_version"):
            target = getattr(self, field)
            if target is not None and target.model_id != self.model:
                raise ValidationError(
                    {field: f"{target} is not a version of {self.model}"}
                )


class ModelVersionQuerySet(models.QuerySet):
    """Bulk writes that would bypass ``ModelVersion.save`` may not touch identity."""

    def update(self, **kwargs: Any) -> int:
        touched = sorted(set(kwargs) & _IDENTITY_ATTRS)
        if touched:
            raise ImmutableVersionError(
                f"a registered version is immutable; cannot update {', '.join(touched)}"
            )
        return super().update(**kwargs)

    def bulk_update(self, objs: Any, fields: Any, batch_size: int | None = None) -> int:
        touched = sorted(set(fields) & _IDENTITY_ATTRS)
        if touched:
            raise ImmutableVersionError(
                f"a registered version is immutable; cannot update {', '.join(touched)}"
            )
        return super().bulk_update(objs, fields, batch_size=batch_size)


class ModelVersion(models.Model):
    """One registered, immutable version of a model (seed: model_versions).

    Weights, tokenizer, chat template, precision, GPUs per replica and engine config
    are its identity: ``save()`` and the queryset refuse to change them once the row
    exists. Status, capacity figures and the eval report are filled in by the gates.
    """

    model = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="versions")
    version = models.CharField(max_length=16, validators=[version_validator])
    weights_uri = models.CharField(max_length=1024)
    weights_hash = models.CharField(max_length=64, validators=[sha256_validator])
    tokenizer_hash = models.CharField(max_length=64, validators=[sha256_validator])
    chat_template = models.TextField()
    chat_template_hash = models.CharField(
        max_length=64, validators=[sha256_validator], editable=False
    )
    precision = models.CharField(
        max_length=8, choices=[(p.value, p.value) for p in Precision]
    )
    gpus_per_replica = models.PositiveSmallIntegerField(
        validators=[MinValueValidator(1), MaxValueValidator(MAX_GPUS_PER_REPLICA)]
    )
    engine_config = models.JSONField(default=dict, blank=True)
    eval_report_uri = models.CharField(max_length=1024, blank=True)
    load_test_tokens_per_s = models.FloatField(null=True, blank=True)
    load_test_tokens_in_flight = models.PositiveIntegerField(null=True, blank=True)
    status = models.CharField(
        max_length=16,
        choices=[(s.value, s.value) for s in VersionStatus],
        default=VersionStatus.REGISTERED.value,
        db_index=True,
    )
    status_reason = models.CharField(
        max_length=2000,
        blank=True,
        help_text="Why the version has its status: the failing gate's reason, or "
        "the admin override that set it.",
    )
    load_test_prefix_hit_rate = models.FloatField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = ModelVersionQuerySet.as_manager()

    class Meta:
        db_table = "model_versions"
        ordering = ["model_id", "-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["model", "version"], name="model_version_unique"
            ),
            models.CheckConstraint(
                condition=Q(weights_hash__regex=_HEX64), name="version_weights_hash_hex"
            ),
            models.CheckConstraint(
                condition=Q(tokenizer_hash__regex=_HEX64),
                name="version_tokenizer_hash_hex",
            ),
            models.CheckConstraint(
                condition=Q(chat_template_hash__regex=_HEX64),
                name="version_chat_template_hash_hex",
            ),
            models.CheckConstraint(
                condition=Q(precision__in=[p.value for p in Precision]),
                name="version_precision_known",
            ),
            models.CheckConstraint(
                condition=Q(gpus_per_replica__gte=1)
                & Q(gpus_per_replica__lte=MAX_GPUS_PER_REPLICA),
                name="version_gpus_range",
            ),
            models.CheckConstraint(
                condition=Q(status__in=[s.value for s in VersionStatus]),
                name="version_status_known",
            ),
            models.CheckConstraint(
                condition=Q(load_test_tokens_per_s__isnull=True)
                | Q(load_test_tokens_per_s__gt=0),
                name="version_load_test_positive",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.model_id}@{self.version}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Save, refusing any change to identity fields of an existing version."""
        if not self._state.adding:
            stored = (
                type(self).objects.filter(pk=self.pk).values(*IDENTITY_FIELDS).first()
            )
            if stored is not None:
                changed = [
                    name
                    for name in IDENTITY_FIELDS
                    if _comparable(stored[name]) != _comparable(getattr(self, name))
                ]
                if changed:
                    raise ImmutableVersionError(
                        f"{self} is immutable; cannot change {', '.join(changed)}"
                    )
        super().save(*args, **kwargs)

    @property
    def ref(self) -> str:
        """The pinned name a client may send: ``chat-7b@v13``."""
        return f"{self.model_id}@{self.version}"


_IDENTITY_ATTRS = set(IDENTITY_FIELDS) | {"model"}


def _comparable(value: Any) -> Any:
    # JSON columns round-trip dicts with any key order; compare them canonically.
    return canonical_json(value) if isinstance(value, dict | list) else value


# The autoscaler's settings of a pool, as its columns (and the API's fields) name them.
SCALING_FIELDS: tuple[str, ...] = (
    "min_replicas",
    "max_replicas",
    "warm_floor",
    "target_utilisation",
    "scale_down_utilisation",
    "stable_window_s",
    "panic_window_s",
    "panic_factor",
    "scale_down_interval_s",
    "warm_nodes_min",
    "warm_nodes_max",
    "warm_horizon_s",
)


def _replicas(**kwargs: Any) -> models.PositiveIntegerField:
    return models.PositiveIntegerField(
        validators=[MaxValueValidator(MAX_REPLICAS)], **kwargs
    )


def _problems_by_field(problems: list[str], *, fallback: str) -> dict[str, list[str]]:
    """Group ``"field: why"`` lines by the field they name (else ``fallback``)."""
    errors: dict[str, list[str]] = {}
    for problem in problems:
        field = problem_field(problem) or fallback
        errors.setdefault(field, []).append(problem.partition(": ")[2] or problem)
    return errors


class GateRun(models.Model):
    """One gate of one attempt at a version's gates (its progress and its result).

    Every run of the gates (on registration, and each ``POST .../gates``) is a new
    ``attempt`` with one row per gate in ``GATE_ORDER``, so the table is the
    version's gate history.
    """

    version = models.ForeignKey(
        ModelVersion, on_delete=models.CASCADE, related_name="gate_runs"
    )
    attempt = models.PositiveIntegerField()
    kind = models.CharField(
        max_length=16, choices=[(k.value, k.value) for k in GateKind]
    )
    state = models.CharField(
        max_length=16,
        choices=[(s.value, s.value) for s in GateState],
        default=GateState.PENDING.value,
    )
    detail = models.CharField(
        max_length=2000, blank=True, help_text="Progress while it runs; why, after."
    )
    done = models.PositiveIntegerField(default=0)
    total = models.PositiveIntegerField(default=0)
    result = models.JSONField(default=dict, blank=True)
    requested_by = models.CharField(max_length=200, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "version_gates"
        ordering = ["version_id", "-attempt", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["version", "attempt", "kind"], name="gate_run_unique"
            ),
            models.CheckConstraint(
                condition=Q(kind__in=[k.value for k in GateKind]),
                name="gate_run_kind_known",
            ),
            models.CheckConstraint(
                condition=Q(state__in=[s.value for s in GateState]),
                name="gate_run_state_known",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.version} {self.kind} #{self.attempt}: {self.state}"


class VersionRegion(models.Model):
    """A region's copy of a version's weights and whether it can serve from it.

    Written by the weights gate: ``uri`` is the copy under the region's storage
    root, ``ready`` once its hash matched ``weights_hash``. Node agents prefetch and
    start the version only from a ready copy of their region.
    """

    version = models.ForeignKey(
        ModelVersion, on_delete=models.CASCADE, related_name="regions"
    )
    region = models.CharField(max_length=64, validators=[slug_validator])
    uri = models.CharField(max_length=1024)
    state = models.CharField(
        max_length=16,
        choices=[(s.value, s.value) for s in RegionState],
        default=RegionState.COPYING.value,
    )
    detail = models.CharField(max_length=2000, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "version_regions"
        ordering = ["version_id", "region"]
        constraints = [
            models.UniqueConstraint(
                fields=["version", "region"], name="version_region_unique"
            ),
            models.CheckConstraint(
                condition=Q(state__in=[s.value for s in RegionState]),
                name="version_region_state_known",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.version} in {self.region}: {self.state}"


class EvalSet(models.Model):
    """An eval set the eval gate runs for a model's versions, besides its default.

    ``team`` empty: the platform's own; else the team's (seed: "Ship INT8 only if
    the team's own eval set shows no real drop"). Every registered set must pass.
    """

    model = models.ForeignKey(Model, on_delete=models.CASCADE, related_name="eval_sets")
    team = models.ForeignKey(
        "accounts.Team",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="eval_sets",
    )
    uri = models.CharField(max_length=1024)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "eval_sets"
        ordering = ["model_id", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["model", "uri"], name="eval_set_model_uri_unique"
            ),
        ]

    def __str__(self) -> str:
        owner = self.team_id or "platform"
        return f"{self.model_id}: {self.uri} ({owner})"


class Pool(models.Model):
    """The replicas of one version in one region, with the autoscaler's settings.

    The settings are the autoscaler's (``models_registry.domain.autoscaler``
    ``ScalingSettings``), with its defaults; what makes no sense is refused by the
    rules of ``models_registry.domain.scaling``, here (``clean``), in the API and by
    the policy. ``desired_replicas`` is written by the autoscaler (compare-and-set)
    and ``autoscaler_state`` is what it remembers between ticks (its windows, its
    last decision), so a worker restart resumes where it left.
    """

    model = models.ForeignKey(Model, on_delete=models.CASCADE, related_name="pools")
    version = models.ForeignKey(
        ModelVersion, on_delete=models.CASCADE, related_name="pools"
    )
    region = models.CharField(max_length=64, validators=[slug_validator])
    min_replicas = _replicas(default=1)
    max_replicas = _replicas(default=1)
    desired_replicas = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Replicas the autoscaler wants; unset means min_replicas. "
        "Always held within [min_replicas, max_replicas].",
    )
    warm_floor = _replicas(
        default=0,
        help_text="Replicas kept however quiet the pool is (the warm pool).",
    )
    target_utilisation = models.FloatField(
        default=0.7,
        help_text="Scale up when tokens in flight (and queued) pass this fraction "
        "of the pool's capacity.",
    )
    scale_down_utilisation = models.FloatField(
        default=0.5,
        help_text="Scale down only while utilisation, at one replica fewer, stayed "
        "under this fraction for the whole stable window.",
    )
    stable_window_s = models.FloatField(
        default=60.0,
        validators=[MaxValueValidator(MAX_WINDOW_S)],
        help_text="Seconds of quiet a scale-down needs; also how long a panic holds.",
    )
    panic_window_s = models.FloatField(
        default=6.0,
        validators=[MaxValueValidator(MAX_WINDOW_S)],
        help_text="The short window: its average demand scales up, and a queue "
        "that lasts through it adds a replica.",
    )
    panic_factor = models.FloatField(
        default=2.0,
        validators=[MaxValueValidator(MAX_PANIC_FACTOR)],
        help_text="Panic (no scale-down for a stable window) when the short window "
        "asks for this many times the serving replicas.",
    )
    scale_down_interval_s = models.FloatField(
        default=600.0,
        validators=[MaxValueValidator(MAX_SCALE_DOWN_INTERVAL_S)],
        help_text="At most one replica removed per this many seconds.",
    )
    warm_nodes_min = _replicas(
        default=0,
        help_text="Idle nodes with the weights on disk kept however flat the "
        "demand (the warm minimum against a spike no trend foretells).",
    )
    warm_nodes_max = _replicas(
        default=0,
        help_text="The most idle warm nodes the demand's trend may ask for; "
        "0 turns the warm pool off.",
    )
    warm_horizon_s = models.FloatField(
        default=360.0,
        validators=[MaxValueValidator(MAX_WINDOW_S)],
        help_text="How far ahead the warm pool covers the demand's trend: a "
        "cold start (the seed's 6 minutes).",
    )
    staging = models.BooleanField(
        default=False,
        editable=False,
        help_text="Started by the version gates for their eval and load test: "
        "fixed at one replica, it serves only requests pinned to its version "
        "(which is not ready, so no alias or canary reaches it), and is removed "
        "when the gates end.",
    )
    autoscaler_state = models.JSONField(
        default=dict,
        blank=True,
        editable=False,
        help_text="What the autoscaler remembers between ticks, and its last decision.",
    )
    record_traffic_share = models.FloatField(
        default=0.0,
        validators=[MinValueValidator(0.0), MaxValueValidator(1.0)],
        help_text="The share of the pool's conversations the gateway records for "
        "the traffic twin (sizes, timings and salted prefix hashes, never text); "
        "0 records nothing.",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "pools"
        ordering = ["model_id", "region", "version_id"]
        constraints = [
            models.UniqueConstraint(
                fields=["version", "region"], name="pool_version_region"
            ),
            models.CheckConstraint(
                condition=Q(min_replicas__lte=models.F("max_replicas")),
                name="pool_min_le_max",
            ),
            models.CheckConstraint(
                condition=Q(max_replicas__gte=1), name="pool_max_positive"
            ),
            models.CheckConstraint(
                condition=Q(warm_floor__lte=models.F("max_replicas")),
                name="pool_warm_floor_le_max",
            ),
            models.CheckConstraint(
                condition=Q(warm_nodes_min__lte=models.F("warm_nodes_max")),
                name="pool_warm_nodes_min_le_max",
            ),
            models.CheckConstraint(
                condition=Q(warm_horizon_s__gt=0.0),
                name="pool_warm_horizon_positive",
            ),
            models.CheckConstraint(
                condition=Q(record_traffic_share__gte=0.0)
                & Q(record_traffic_share__lte=1.0),
                name="pool_record_traffic_share_fraction",
            ),
            models.CheckConstraint(
                condition=Q(target_utilisation__gt=0.0) & Q(target_utilisation__lt=1.0),
                name="pool_target_utilisation_fraction",
            ),
            models.CheckConstraint(
                condition=Q(scale_down_utilisation__gt=0.0)
                & Q(scale_down_utilisation__lt=models.F("target_utilisation")),
                name="pool_scale_down_below_target",
            ),
            models.CheckConstraint(
                condition=Q(panic_window_s__gt=0.0)
                & Q(panic_window_s__lte=models.F("stable_window_s")),
                name="pool_panic_window_within_stable",
            ),
            models.CheckConstraint(
                condition=Q(panic_factor__gt=1.0), name="pool_panic_factor_above_1"
            ),
            models.CheckConstraint(
                condition=Q(scale_down_interval_s__gte=0.0),
                name="pool_scale_down_interval_non_negative",
            ),
        ]
        indexes = [models.Index(fields=["model", "region"], name="pool_model_region")]

    def __str__(self) -> str:
        return f"{self.version} in {self.region}"

    @property
    def target_replicas(self) -> int:
        """How many replicas node agents keep running for this pool."""
        wanted = (
            self.min_replicas
            if self.desired_replicas is None
            else self.desired_replicas
        )
        return max(self.min_replicas, min(self.max_replicas, wanted))

    def replica_capacity(self, default_tokens_in_flight: int) -> tuple[int, bool]:
        """Return the tokens in flight one replica carries, and whether that is
        ``default_tokens_in_flight`` (assumed: no load test has measured it).

        A measured 0 counts as no measurement, as admission reads it.
        """
        capacity = CapacityRecord(
            tokens_per_s=self.version.load_test_tokens_per_s,
            tokens_in_flight=self.version.load_test_tokens_in_flight,
        )
        return replica_tokens_in_flight(capacity, default_tokens_in_flight)

    def replica_tokens_per_s(self, default_tokens_per_s: float) -> tuple[float, bool]:
        """Return the input tokens/s one replica of an embedding pool sustains at
        its latency target (the version's load test), and whether that is
        ``default_tokens_per_s`` (not measured; 0 counts as not measured)."""
        capacity = CapacityRecord(
            tokens_per_s=self.version.load_test_tokens_per_s,
            tokens_in_flight=self.version.load_test_tokens_in_flight,
        )
        return replica_tokens_per_s(capacity, default_tokens_per_s)

    def stored_state(self) -> dict[str, Any]:
        """Return ``autoscaler_state`` as a dict ({} when it holds anything else)."""
        return self.autoscaler_state if isinstance(self.autoscaler_state, dict) else {}

    def last_tick(self) -> dict[str, Any]:
        """Return what the autoscaler's last tick saw and decided ({} before one)."""
        last = self.stored_state().get("last")
        return last if isinstance(last, dict) else {}

    def warm_target(self) -> int:
        """Return the warm nodes the autoscaler's last tick asked for (0 before
        one, or when the pool keeps none)."""
        try:
            return max(0, int(self.last_tick().get("warm_nodes") or 0))
        except (TypeError, ValueError):
            return 0

    def scaling_problems(self, schedule: Sequence[ScheduleWindow] = ()) -> list[str]:
        """Return what is wrong with these settings and ``schedule`` (``"field: why"``)."""
        return scaling_problems(
            min_replicas=self.min_replicas,
            max_replicas=self.max_replicas,
            warm_floor=self.warm_floor,
            target_utilisation=self.target_utilisation,
            scale_down_utilisation=self.scale_down_utilisation,
            stable_window_s=self.stable_window_s,
            panic_window_s=self.panic_window_s,
            panic_factor=self.panic_factor,
            scale_down_interval_s=self.scale_down_interval_s,
            schedule=schedule,
            warm_nodes_min=self.warm_nodes_min,
            warm_nodes_max=self.warm_nodes_max,
            warm_horizon_s=self.warm_horizon_s,
        )

    def clean(self) -> None:
        """Keep the version and the model in agreement, and the settings sensible.

        The schedule rows are judged with the settings where both are edited
        together: the console's schedule inline and the API's PUT (a row change
        and a ``max_replicas`` change in one save must be judged as one).
        """
        if self.version_id and self.model_id and self.version.model_id != self.model_id:
            raise ValidationError(
                {"version": f"{self.version} is not a version of {self.model_id}"}
            )
        if any(getattr(self, name) is None for name in SCALING_FIELDS):
            return  # a field left empty or malformed has its own error already
        problems = self.scaling_problems()
        if problems:
            raise ValidationError(_problems_by_field(problems, fallback="__all__"))


class PoolSchedule(models.Model):
    """A scheduled floor of a pool: at least ``min_replicas`` on ``weekdays``
    (0 Monday .. 6 Sunday) from ``start_minute`` to ``end_minute`` (UTC minutes of
    the day, end excluded), raised before known peaks.

    Overlapping rows of a pool must agree on the floor
    (``models_registry.domain.scaling``).
    """

    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="schedule")
    weekdays = models.JSONField(
        default=list, help_text="Days of the week, 0 (Monday) to 6 (Sunday)."
    )
    start_minute = models.PositiveSmallIntegerField(
        validators=[MaxValueValidator(MINUTES_PER_DAY - 1)],
        help_text="UTC minute of the day the rule starts (08:30 is 510).",
    )
    end_minute = models.PositiveSmallIntegerField(
        validators=[MinValueValidator(1), MaxValueValidator(MINUTES_PER_DAY)],
        help_text="UTC minute of the day the rule ends, excluded (10:00 is 600).",
    )
    min_replicas = _replicas(help_text="The pool's floor while the rule applies.")

    class Meta:
        db_table = "pool_schedules"
        ordering = ["pool_id", "start_minute", "id"]
        constraints = [
            models.CheckConstraint(
                condition=Q(start_minute__lt=models.F("end_minute"))
                & Q(end_minute__lte=MINUTES_PER_DAY),
                name="pool_schedule_within_a_day",
            ),
        ]

    def __str__(self) -> str:
        days = ",".join(str(d) for d in self.weekdays) if self.weekdays else "-"
        return f"days {days} {clock(self.start_minute)}-{clock(self.end_minute)} UTC: {self.min_replicas}"

    def clean(self) -> None:
        """Refuse a rule that is not one (no weekday, an empty or wrapped window)."""
        weekdays = self.weekdays
        if None in (self.start_minute, self.end_minute, self.min_replicas):
            return  # a field left empty has its own error already
        if not isinstance(weekdays, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in weekdays
        ):
            raise ValidationError({"weekdays": "must be a list of 0 (Monday) to 6"})
        problems = schedule_rule_problems(
            weekdays=weekdays,
            start_minute=self.start_minute,
            end_minute=self.end_minute,
            min_replicas=self.min_replicas,
        )
        if problems:
            raise ValidationError(_problems_by_field(problems, fallback="__all__"))
        self.weekdays = sorted(set(weekdays))


def clock(minute: int | None) -> str:
    """Return a minute of the day as ``HH:MM`` (1440 is ``24:00``)."""
    if minute is None:
        return "--:--"
    return f"{minute // 60:02d}:{minute % 60:02d}"


class JudgeLabel(models.TextChoices):
    """What a reviewer said of a pair, as shown to them (``""`` not yet)."""

    NONE = "", "not labelled"
    A = "a", "A is better"
    B = "b", "B is better"
    TIE = "tie", "tie"


class JudgeItem(models.Model):
    """One judge verdict from an eval gate, kept for a person to grade blind.

    The prompt and answers come from the platform's own eval sets, never from
    users' traffic. ``answer_a``/``answer_b`` are the two answers in the order the
    reviewer sees them (drawn at random, independently of the judge's order);
    ``candidate_side`` says which one the candidate wrote, ``judge_verdict`` what
    the judge said in the pair's own terms (candidate, live, tie). Neither is
    shown to the reviewer. ``label`` is set once (compare-and-set on ``""``).
    """

    gate_run = models.ForeignKey(
        GateRun,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,  # the labels outlive the version's history
        related_name="judge_items",
    )
    judge = models.CharField(max_length=200, help_text="The judge's model@version.")
    judge_prompt = models.CharField(max_length=64)
    candidate = models.CharField(max_length=200)
    live = models.CharField(max_length=200)
    eval_set = models.CharField(max_length=1024)
    item_id = models.CharField(max_length=200)
    question = models.JSONField(help_text="The item's chat messages.")
    answer_a = models.TextField()
    answer_b = models.TextField()
    candidate_side = models.CharField(max_length=1, choices=[("a", "a"), ("b", "b")])
    judge_verdict = models.CharField(
        max_length=16,
        choices=[("candidate", "candidate"), ("live", "live"), ("tie", "tie")],
    )
    label = models.CharField(
        max_length=8, choices=JudgeLabel.choices, default="", blank=True
    )
    labelled_by = models.CharField(max_length=150, blank=True)
    labelled_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "judge_items"
        ordering = ["id"]
        constraints = [
            models.UniqueConstraint(
                fields=["gate_run", "eval_set", "item_id"],
                name="judge_item_unique",
            ),
            models.CheckConstraint(
                condition=Q(label__in=[c.value for c in JudgeLabel]),
                name="judge_item_label_known",
            ),
        ]
        indexes = [models.Index(fields=["judge", "label"], name="judge_item_label")]

    def __str__(self) -> str:
        return f"{self.judge} on {self.item_id} ({self.label or 'unlabelled'})"
