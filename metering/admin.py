"""Console pages for usage and the rollout guards' figures: read-only, because the
gateway's flush owns every count."""

from __future__ import annotations

from django.contrib import admin

from metering.models import ReplicaSpan, Usage, VersionFigure
from models_registry.admin import ReadOnlyAdmin


@admin.register(Usage)
class UsageAdmin(ReadOnlyAdmin):
    """Per-minute usage by team, model and version; viewable, never edited here.

    Counts are added with F() expressions by the flush; a hand edit or a deletion
    would silently change what teams are billed for. The batch columns are the part
    of requests, prompt and output tokens that was batch work.
    """

    list_display = (
        "minute",
        "team",
        "model",
        "version",
        "region",
        "requests",
        "prompt_tokens",
        "cached_tokens",
        "output_tokens",
        "shed",
        "rate_limited",
        "batch_requests",
        "batch_prompt_tokens",
        "batch_output_tokens",
    )
    list_filter = ("model", "team", "region")
    search_fields = ("team__team", "model__model", "version__version")
    list_select_related = ("team", "model", "version")
    date_hierarchy = "minute"


@admin.register(VersionFigure)
class VersionFigureAdmin(ReadOnlyAdmin):
    """Per-bucket figures of each version and role (live, canary, shadow), as the
    rollout guards read them; written by the flush, viewable only."""

    list_display = (
        "bucket_start",
        "model",
        "version",
        "role",
        "region",
        "requests",
        "answered",
        "refusals",
        "output_tokens",
        "conversations",
        "errors",
    )
    list_filter = ("model", "role", "region")
    search_fields = ("model__model", "version")
    date_hierarchy = "bucket_start"


@admin.register(ReplicaSpan)
class ReplicaSpanAdmin(ReadOnlyAdmin):
    """The replicas' state history the cost reports bill GPU-hours from; written
    by ``engine_nodes.models.Replica`` as replicas move, viewable only."""

    list_display = (
        "replica_id",
        "model",
        "version",
        "region",
        "gpus",
        "state",
        "started_at",
        "ended_at",
    )
    list_filter = ("state", "region", "model")
    search_fields = ("replica_id", "model", "version", "region")
    date_hierarchy = "started_at"
