"""Console pages for engine replicas as the control plane last heard of them."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from engine_nodes.models import Replica


@admin.register(Replica)
class ReplicaAdmin(admin.ModelAdmin):
    """Replicas with their last reported load; heartbeats keep these rows current."""

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

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        # The id is the primary key: editing it would save a second replica.
        return ("replica_id", "created_at") if obj is not None else ("created_at",)
