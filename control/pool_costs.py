"""The pools' GPUs, what they cost an hour, and their silent replicas, for /metrics.

Public surface: ``pool_cost_figures``.

Read at scrape time (``metering.metrics.PoolCostCollector``, registered in
``engine_nodes.apps``), two queries per scrape, never on the gateway's request path.
The prices and the cost arithmetic are the cost model's (``metering.domain.cost``),
so the live figures and the finance reports agree. An embedding version's
load-tested rate is in input tokens per second, so its pool's cost per million
at full is per million input tokens, as the reports price it.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime

from django.conf import settings
from django.db.models import Count
from django.utils import timezone

from engine_nodes.domain.liveness import silence_cutoff
from engine_nodes.models import Replica, is_silent_since
from metering.domain.cost import (
    gpu_hour_usd_for,
    gpu_usd_per_hour,
    replica_tokens_per_s,
    usd_per_million_at_full,
)
from metering.metrics import PoolCostFigures
from models_registry.models import ModelKind, Pool

__all__ = ["pool_cost_figures"]


def pool_cost_figures(
    *, region: str | None = None, now: datetime | None = None
) -> list[PoolCostFigures]:
    """Return each pool's GPUs, cost per hour, cost per million at full, and silent
    replicas, for the pools of ``region`` (this process's ``PLATFORM_REGION``).

    Every replica not gone holds its GPUs, whatever its state: the cost model counts
    the same states. A replica is silent as the reaper judges it (its last beat, or
    its creation when it never beat, older than the missed-beat window); the
    reaper marks such replicas gone within ``PLATFORM_REAPER_INTERVAL_S``, so a
    count that stays above 0 means the reaper is not running.
    """
    region = settings.PLATFORM_REGION if region is None else region
    now = now or timezone.now()
    price = gpu_hour_usd_for(
        region,
        default=settings.PLATFORM_GPU_HOUR_USD,
        by_region=settings.PLATFORM_GPU_HOUR_USD_BY_REGION,
    )
    cutoff = silence_cutoff(
        now, settings.PLATFORM_HEARTBEAT_DB_S, settings.PLATFORM_MISSED_BEATS
    )
    pools = list(Pool.objects.filter(region=region).select_related("model", "version"))
    counts = (
        Replica.objects.live()
        .filter(region=region, version_id__in=[p.version_id for p in pools])
        .values("version_id")
        .annotate(held=Count("pk"), silent=Count("pk", filter=is_silent_since(cutoff)))
        .order_by()
    )
    held: dict[int, int] = defaultdict(int)
    silent: dict[int, int] = defaultdict(int)
    for row in counts:
        held[row["version_id"]] = row["held"]
        silent[row["version_id"]] = row["silent"]
    figures = []
    for pool in pools:
        version = pool.version
        gpus = held[pool.version_id] * version.gpus_per_replica
        # Until a load test measures the version, the cost model's assumed rate,
        # as the finance reports price it (platform_pool_capacity_assumed says so).
        # An embedding pool's tokens are input tokens: its own default.
        tokens_per_s, _ = replica_tokens_per_s(
            version.load_test_tokens_per_s,
            assumed=(
                settings.PLATFORM_DEFAULT_EMBEDDING_REPLICA_TOKENS_PER_S
                if pool.model.kind == ModelKind.EMBEDDING
                else settings.PLATFORM_ASSUMED_TOKENS_PER_S
            ),
        )
        figures.append(
            PoolCostFigures(
                model=pool.model_id,
                version=version.version,
                region=pool.region,
                gpus=gpus,
                gpu_usd_per_hour=gpu_usd_per_hour(gpus=gpus, gpu_hour_usd=price),
                usd_per_million_tokens_at_full=usd_per_million_at_full(
                    gpus_per_replica=version.gpus_per_replica,
                    gpu_hour_usd=price,
                    tokens_per_s=tokens_per_s,
                ),
                silent_replicas=silent[pool.version_id],
            )
        )
    return figures
