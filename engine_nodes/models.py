"""Engine replicas and the nodes that run them, as the control plane last heard of them."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import models, transaction
from django.db.models import Q
from django.db.models.signals import post_delete
from django.dispatch import receiver
from django.utils import timezone

from engine_nodes.domain.liveness import ReplicaState
from metering.spans import SpanStart, close_spans, record_moves
from models_registry.domain.autoscaler import Reason


def is_silent_since(cutoff: datetime) -> Q:
    """The condition of a replica whose last heartbeat is before ``cutoff``; one
    that never beat is judged by when it was created (the reaper's rule, and the
    silent replicas Prometheus counts)."""
    return Q(last_heartbeat__lt=cutoff) | Q(
        last_heartbeat__isnull=True, created_at__lt=cutoff
    )


class ReplicaQuerySet(models.QuerySet["Replica"]):
    """Queries over replicas; a state change is written to the state history
    (``metering.models.ReplicaSpan``) in the same transaction, and a deletion ends
    the replica's span (``_close_span_of_deleted``).

    Create replicas with ``create``/``save`` (which open their first span), not
    ``bulk_create``, which writes no history.
    """

    def live(self) -> ReplicaQuerySet:
        """Return replicas that have not been marked gone."""
        return self.exclude(state=ReplicaState.GONE.value)

    def silent(self, cutoff: datetime) -> ReplicaQuerySet:
        """Return replicas silent since ``cutoff`` (``is_silent_since``)."""
        return self.filter(is_silent_since(cutoff))

    def update(self, **kwargs: Any) -> int:
        if "state" not in kwargs:
            return super().update(**kwargs)
        state = str(kwargs["state"])
        with transaction.atomic(using=self.db):
            # Locked, so the states read are the states the update replaces.
            before = list(
                self.select_for_update().values_list(
                    "replica_id", "state", "version_id", "region"
                )
            )
            updated = super().update(**kwargs)
            moved = [
                (pk, vid, region) for pk, old, vid, region in before if old != state
            ]
            if moved:
                record_moves(_moves(moved, state), at=timezone.now())
        return updated


def _start_of(replica: Replica) -> SpanStart:
    version = replica.version
    return SpanStart(
        replica_id=replica.replica_id,
        model=replica.model_id,
        version=version.version,
        region=replica.region,
        gpus=version.gpus_per_replica,
        state=replica.state,
    )


def _moves(moved: list[tuple[str, int, str]], state: str) -> list[SpanStart]:
    """Return the spans that replicas ``(id, version id, region)`` now begin."""
    from models_registry.models import ModelVersion

    versions = {
        v.pk: v
        for v in ModelVersion.objects.filter(pk__in={vid for _, vid, _ in moved}).only(
            "model_id", "version", "gpus_per_replica"
        )
    }
    return [
        SpanStart(
            replica_id=pk,
            model=versions[vid].model_id,
            version=versions[vid].version,
            region=region,
            gpus=versions[vid].gpus_per_replica,
            state=state,
        )
        for pk, vid, region in moved
    ]


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
    kv_events_url = models.CharField(
        max_length=255,
        blank=True,
        default="",
        help_text="ZMQ endpoint of the engine's KV-cache events (tcp://host:port); "
        "empty when the version does not turn kv_events on.",
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

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Save, writing a new row's first span or a changed state to the history."""
        with transaction.atomic():
            if self._state.adding:
                previous = None
            else:
                previous = (
                    Replica.objects.filter(pk=self.pk)
                    .select_for_update()
                    .values_list("state", flat=True)
                    .first()
                )
            super().save(*args, **kwargs)
            if previous != self.state:
                record_moves([_start_of(self)], at=timezone.now())


class NodeQuerySet(models.QuerySet):
    """Queries over node agents."""

    def heard_since(self, cutoff: datetime) -> NodeQuerySet:
        """Return nodes whose agent beat at or after ``cutoff``."""
        return self.filter(last_beat__gte=cutoff)


class Node(models.Model):
    """A GPU node as its agent last reported it: its GPUs and the weights it holds.

    The agent writes its row every database beat (``engine_nodes.services.
    record_node_beat``) and deletes it when it shuts down; a node silent for the
    missed-beat window counts for nothing (``free_gpus``). ``warm_versions`` are the
    versions whose weights lie verified on the node's local disk (the warm pool): a
    replica of one of them starts there with only load and warm-up.
    """

    name = models.CharField(max_length=255, help_text="As in Replica.node.")
    region = models.CharField(max_length=64)
    gpus = models.PositiveIntegerField(help_text="GPUs the agent may fill.")
    warm_versions = models.ManyToManyField(
        "models_registry.ModelVersion",
        blank=True,
        related_name="warm_nodes",
        help_text="Versions whose verified weights are on the node's local disk.",
    )
    last_beat = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)

    objects = NodeQuerySet.as_manager()

    class Meta:
        db_table = "nodes"
        ordering = ["region", "name"]
        constraints = [
            models.UniqueConstraint(fields=["region", "name"], name="node_region_name")
        ]

    def __str__(self) -> str:
        return f"{self.name} in {self.region}"


class ScalingDecision(models.Model):
    """One change of a pool's desired size by the autoscaler, and why (a row per
    change, not per tick).

    ``signals`` are the figures it decided on (replicas serving and starting, tokens
    in flight and queued, queue depth, capacity per replica, the windows' demand);
    ``capacity_is_assumed`` says the capacity per replica was the platform's default
    because the version had no load test. Old rows are pruned as new ones come
    (``PLATFORM_AUTOSCALE_DECISIONS_KEPT`` per pool, ``control.autoscaling``).
    """

    pool = models.ForeignKey(
        "models_registry.Pool",
        on_delete=models.CASCADE,
        related_name="scaling_decisions",
    )
    region = models.CharField(max_length=64)
    decided_at = models.DateTimeField()
    from_replicas = models.PositiveIntegerField()
    to_replicas = models.PositiveIntegerField()
    reason = models.CharField(
        max_length=24, choices=[(r.value, r.value) for r in Reason]
    )
    utilisation = models.FloatField(
        null=True,
        blank=True,
        help_text="The short window's demand over the capacity of the replicas "
        "the pool had (serving and starting).",
    )
    is_panicking = models.BooleanField(default=False)
    is_capacity_exhausted = models.BooleanField(default=False)
    capacity_is_assumed = models.BooleanField(default=False)
    signals = models.JSONField(default=dict, blank=True)

    class Meta:
        db_table = "scaling_decisions"
        ordering = ["-decided_at", "-id"]
        constraints = [
            models.CheckConstraint(
                condition=Q(reason__in=[r.value for r in Reason]),
                name="scaling_decision_reason_known",
            ),
        ]
        indexes = [
            models.Index(
                fields=["pool", "-decided_at", "-id"], name="scaling_decision_pool_at"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.pool_id}: {self.from_replicas} -> {self.to_replicas} ({self.reason})"


@receiver(post_delete, sender=Replica, dispatch_uid="replica_span_closes")
def _close_span_of_deleted(
    sender: type[Replica], instance: Replica, **kwargs: Any
) -> None:
    """End a deleted replica's open span, however it was deleted: one row, a
    queryset, or a cascade from its model or version (Django's collector sends this
    for each row, inside the deleting transaction)."""
    close_spans([instance.replica_id], at=timezone.now())
