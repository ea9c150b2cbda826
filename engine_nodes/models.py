"""Engine replicas as the control plane last heard of them."""

from __future__ import annotations

from django.db import models
from django.db.models import Q

from engine_nodes.domain.liveness import ReplicaState


class ReplicaQuerySet(models.QuerySet):
    """Queries over replicas."""

    def live(self) -> ReplicaQuerySet:
        """Return replicas that have not been marked gone."""
        return self.exclude(state=ReplicaState.GONE.value)


class Replica(models.Model):
    """One engine server of a version on a node (seed: replicas).

    ``queue_depth``, ``tokens_in_flight`` and ``kv_cache_usage_perc`` are what the
    replica reported in its last heartbeat; the gateway's live load travels through
    Redis, not this table.
    """

    replica_id = models.CharField(primary_key=True, max_length=128)
    model = models.ForeignKey(
        "models_registry.Model", on_delete=models.CASCADE, related_name="replicas"
    )
    version = models.ForeignKey(
        "models_registry.ModelVersion",
        on_delete=models.CASCADE,
        related_name="replicas",
    )
    region = models.CharField(max_length=64)
    node = models.CharField(max_length=255)
    url = models.CharField(
        max_length=255, blank=True, help_text="Base URL of the engine's OpenAI server."
    )
    state = models.CharField(
        max_length=16,
        choices=[(s.value, s.value) for s in ReplicaState],
        default=ReplicaState.STARTING.value,
    )
    queue_depth = models.PositiveIntegerField(default=0)
    tokens_in_flight = models.PositiveBigIntegerField(default=0)
    kv_cache_usage_perc = models.FloatField(default=0.0)
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = ReplicaQuerySet.as_manager()

    class Meta:
        db_table = "replicas"
        ordering = ["model_id", "region", "replica_id"]
        constraints = [
            models.CheckConstraint(
                condition=Q(state__in=[s.value for s in ReplicaState]),
                name="replica_state_known",
            ),
            models.CheckConstraint(
                condition=Q(kv_cache_usage_perc__gte=0.0)
                & Q(kv_cache_usage_perc__lte=1.0),
                name="replica_kv_usage_fraction",
            ),
        ]
        indexes = [
            models.Index(
                fields=["model", "region", "state"], name="replica_pool_state"
            ),
            models.Index(fields=["state", "last_heartbeat"], name="replica_liveness"),
        ]

    def __str__(self) -> str:
        return self.replica_id
