"""Rollouts: a candidate version's stage, share, guard readings and decision."""

from __future__ import annotations

from django.db import models
from django.db.models import Q

from rollouts.domain.plan import Decision, Stage


class Rollout(models.Model):
    """One stage of putting a version in front of traffic (seed: rollouts).

    At most one rollout per model is pending; moving to a new stage or version
    supersedes the previous row, so the table is the rollout's history.
    """

    model = models.ForeignKey(
        "models_registry.Model", on_delete=models.CASCADE, related_name="rollouts"
    )
    version = models.ForeignKey(
        "models_registry.ModelVersion",
        on_delete=models.CASCADE,
        related_name="rollouts",
    )
    stage = models.CharField(max_length=16, choices=[(s.value, s.value) for s in Stage])
    percent = models.FloatField()
    started_at = models.DateTimeField()
    guard_metrics = models.JSONField(default=dict, blank=True)
    decision = models.CharField(
        max_length=16,
        choices=[(d.value, d.value) for d in Decision],
        default=Decision.PENDING.value,
    )
    decided_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "rollouts"
        ordering = ["-started_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["model"],
                condition=Q(decision=Decision.PENDING.value),
                name="rollout_one_pending_per_model",
            ),
            models.CheckConstraint(
                condition=Q(percent__gt=0.0) & Q(percent__lte=100.0),
                name="rollout_percent_range",
            ),
            models.CheckConstraint(
                condition=Q(stage__in=[s.value for s in Stage]),
                name="rollout_stage_known",
            ),
            models.CheckConstraint(
                condition=Q(decision__in=[d.value for d in Decision]),
                name="rollout_decision_known",
            ),
        ]
        indexes = [
            models.Index(fields=["model", "started_at"], name="rollout_model_started")
        ]

    def __str__(self) -> str:
        return f"{self.version} {self.stage} {self.percent:g}% ({self.decision})"


class VersionOverride(models.Model):
    """An admin's override of the version gates for one traffic change.

    A version that is not ready may take traffic only with an explicit override;
    each one is recorded with who made it, why, and the version's status then.
    """

    model = models.ForeignKey(
        "models_registry.Model", on_delete=models.CASCADE, related_name="overrides"
    )
    version = models.ForeignKey(
        "models_registry.ModelVersion",
        on_delete=models.CASCADE,
        related_name="overrides",
    )
    action = models.CharField(max_length=32, help_text="rollout or alias")
    stage = models.CharField(max_length=16, blank=True)
    percent = models.FloatField(null=True, blank=True)
    version_status = models.CharField(max_length=16)
    refusal = models.CharField(
        max_length=2000, help_text="What the gates would have said without it."
    )
    by = models.CharField(max_length=200)
    reason = models.CharField(max_length=2000)
    at = models.DateTimeField()

    class Meta:
        db_table = "version_overrides"
        ordering = ["-at", "-id"]

    def __str__(self) -> str:
        return f"{self.version} {self.action} by {self.by}"
