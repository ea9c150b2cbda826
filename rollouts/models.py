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
