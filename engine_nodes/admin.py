"""Console pages for engine replicas and GPU nodes as the control plane last heard
of them, and the autoscaler's decisions: all read-only, because the node agents
and the autoscaler own these rows (a hand edit would be overwritten by the next
beat or tick, and a deleted replica would still run)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from engine_nodes.models import Node, Replica, ScalingDecision
from models_registry.admin import ReadOnlyAdmin


@admin.register(Replica)
class ReplicaAdmin(ReadOnlyAdmin):
    """Replicas with their last reported load; heartbeats keep these rows current.
    Read-only: the node agents start and stop replicas (reconcile_pools), never
    the console."""

    list_display = (
        "replica_id",
        "model",
        "version",
        "region",
        "node",
        "state",
        "queue_depth",
        "tokens_in_flight",
        "kv_cache_usage_perc",
        "last_heartbeat",
    )
    list_filter = ("state", "region", "model")
    search_fields = ("replica_id", "node", "url", "model__model", "version__version")
    list_select_related = ("model", "version")
    date_hierarchy = "last_heartbeat"


@admin.register(ScalingDecision)
class ScalingDecisionAdmin(ReadOnlyAdmin):
    """The autoscaler's size changes and why: written by it, read here only."""

    list_display = (
        "decided_at",
        "pool",
        "region",
        "from_replicas",
        "to_replicas",
        "reason",
        "utilisation",
        "is_panicking",
        "is_capacity_exhausted",
        "capacity_is_assumed",
    )
    list_filter = ("reason", "region", "is_capacity_exhausted", "capacity_is_assumed")
    search_fields = ("pool__model__model", "pool__version__version", "region")
    list_select_related = ("pool__version", "pool__model")
    date_hierarchy = "decided_at"


@admin.register(Node)
class NodeAdmin(ReadOnlyAdmin):
    """GPU nodes as their agents report them: GPUs, last beat, warm versions.

    Written by the node agents every beat (and deleted when one shuts down); read
    here only. A warm version starts on that node with only load and warm-up.
    """

    list_display = ("name", "region", "gpus", "last_beat", "warm")
    list_filter = ("region",)
    search_fields = ("name", "region")
    date_hierarchy = "last_beat"

    def get_queryset(self, request: HttpRequest) -> Any:
        return super().get_queryset(request).prefetch_related("warm_versions")

    @admin.display(description="warm versions")
    def warm(self, obj: Node) -> str:
        return ", ".join(sorted(v.ref for v in obj.warm_versions.all())) or "-"
