"""Models, their immutable versions, and the per-region pools that serve them."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.db.models import Q

from accounts.models import sha256_validator, slug_validator
from models_registry.domain.identity import (
    IDENTITY_FIELDS,
    MAX_GPUS_PER_REPLICA,
    SHA256_PATTERN,
    VERSION_PATTERN,
    Precision,
    VersionStatus,
    canonical_json,
)

version_validator = RegexValidator(VERSION_PATTERN, "Versions are labelled v1, v2, ...")
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


class Pool(models.Model):
    """The replicas of one version in one region, with the autoscaler's bounds."""

    model = models.ForeignKey(Model, on_delete=models.CASCADE, related_name="pools")
    version = models.ForeignKey(
        ModelVersion, on_delete=models.CASCADE, related_name="pools"
    )
    region = models.CharField(max_length=64, validators=[slug_validator])
    min_replicas = models.PositiveIntegerField(default=1)
    max_replicas = models.PositiveIntegerField(default=1)
    desired_replicas = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Replicas the autoscaler wants; unset means min_replicas. "
        "Always held within [min_replicas, max_replicas].",
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

    def clean(self) -> None:
        """Keep the version and the model in agreement, and min <= max."""
        if self.version_id and self.model_id and self.version.model_id != self.model_id:
            raise ValidationError(
                {"version": f"{self.version} is not a version of {self.model_id}"}
            )
        if self.min_replicas > self.max_replicas:
            raise ValidationError({"min_replicas": "must not exceed max_replicas"})
