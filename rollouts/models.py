"""Rollouts: a candidate version's stage, share, guard readings and decision."""

from __future__ import annotations

from django.db import models
from django.db.models import Q

from rollouts.domain.plan import Decision, GuardAction, Stage


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
    # The plan it follows (rollouts.domain.plan.RolloutPlan as JSON); null for a
    # stage set by hand, which the guards watch (and roll back) but never advance.
    plan = models.JSONField(null=True, blank=True)
    step = models.PositiveIntegerField(default=0)
    # When the current step began taking traffic; null while the candidate's pool
    # has no serving replica yet (no traffic is sent to a version that cannot
    # answer it).
    step_started_at = models.DateTimeField(null=True, blank=True)
    paused = models.BooleanField(default=False)
    approved_step = models.PositiveIntegerField(null=True, blank=True)
    reason = models.CharField(
        max_length=2000, blank=True, help_text="The last decision's why."
    )
    previous_version = models.ForeignKey(
        "models_registry.ModelVersion",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
        help_text="The live version when the rollout started: what a rollback keeps "
        "and what is retired after the retention once promoted.",
    )
    retire_after = models.DateTimeField(null=True, blank=True)
    retired_at = models.DateTimeField(null=True, blank=True)

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


class GuardEvaluation(models.Model):
    """One tick of the guards on a rollout: the figures, the comparison, the action.

    Seed: ``rollouts.guard_metrics``. Written by the guard task every period, so a
    rollout's page shows why each step advanced, held or rolled back.
    """

    rollout = models.ForeignKey(
        Rollout, on_delete=models.CASCADE, related_name="evaluations"
    )
    at = models.DateTimeField()
    step = models.PositiveIntegerField()
    stage = models.CharField(max_length=16)
    percent = models.FloatField()
    action = models.CharField(
        max_length=16, choices=[(a.value, a.value) for a in GuardAction]
    )
    reason = models.CharField(max_length=2000)
    report = models.JSONField(default=dict)
    candidate = models.JSONField(default=dict)
    live = models.JSONField(default=dict)

    class Meta:
        db_table = "guard_metrics"
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["rollout", "at"], name="guard_rollout_at")]

    def __str__(self) -> str:
        return f"{self.rollout_id} {self.stage} {self.percent:g}%: {self.action}"
