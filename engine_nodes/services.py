"""Use-cases for replicas: heartbeats, the reaper, and a pool's live state."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q

from engine_nodes.domain.beats import ReplicaBeat
from engine_nodes.domain.liveness import ReplicaState, is_silent, silence_cutoff
from engine_nodes.models import Replica
from metering.services import prefix_hit_rate_since
from models_registry.domain.capacity import CapacityRecord, pool_capacity_tokens
from models_registry.models import Pool
from models_registry.services import get_model

logger = logging.getLogger(__name__)

# The window over which the pool state reports its prefix hit rate.
HIT_RATE_WINDOW = timedelta(minutes=15)


def reap_silent_replicas(*, now: datetime) -> list[str]:
    """Mark replicas gone that missed ``PLATFORM_MISSED_BEATS`` heartbeats; return their ids.

    A replica that never beat is judged by its creation time, so one that dies while
    starting is reaped too. The update is a compare-and-set on the same condition:
    a replica whose heartbeat lands between the read and the write is left alone.
    """
    cutoff = silence_cutoff(
        now, settings.PLATFORM_HEARTBEAT_DB_S, settings.PLATFORM_MISSED_BEATS
    )
    silent = Replica.objects.live().filter(
        Q(last_heartbeat__lt=cutoff)
        | Q(last_heartbeat__isnull=True, created_at__lt=cutoff)
    )
    reaped = []
    for replica_id in list(silent.values_list("replica_id", flat=True)):
        updated = silent.filter(replica_id=replica_id).update(state=ReplicaState.GONE)
        if updated == 1:
            reaped.append(replica_id)
    if reaped:
        logger.info("reaped %d silent replicas: %s", len(reaped), ", ".join(reaped))
    return reaped


def replica_url(host: str, port: int) -> str:
    """Return the base URL of a replica's OpenAI server."""
    return f"http://{host}:{port}"


def reconcile_pools(
    *,
    region: str,
    node: str,
    gpus_free: int,
    allocate_port: Callable[[], int],
    host: str,
) -> tuple[list[Replica], list[str]]:
    """Bring each pool of ``region`` to its target replica count; return the changes.

    Short pools get new replicas on ``node`` (state ``starting``) while its free GPUs
    last; pools above target get their newest non-draining replicas marked
    ``draining``, whichever node holds them (that node's agent drains them). Runs
    under a lock on the pool rows, so agents on several nodes do not both fill the
    same gap. Returns (created replicas, ids marked draining).
    """
    created: list[Replica] = []
    drained: list[str] = []
    with transaction.atomic():
        pools = list(
            Pool.objects.select_for_update()
            .filter(region=region)
            .select_related("version")
            .order_by("model_id", "version_id")
        )
        for pool in pools:
            active = list(
                Replica.objects.filter(version=pool.version, region=region)
                .exclude(state__in=[ReplicaState.GONE, ReplicaState.DRAINING])
                .order_by("-created_at", "-replica_id")
            )
            surplus = len(active) - pool.target_replicas
            for replica in active[: max(0, surplus)]:
                updated = Replica.objects.filter(
                    pk=replica.pk, state=replica.state
                ).update(state=ReplicaState.DRAINING)
                if updated:
                    drained.append(replica.replica_id)
            for _ in range(max(0, -surplus)):
                gpus = pool.version.gpus_per_replica
                if gpus > gpus_free:
                    break
                port = allocate_port()
                replica = Replica.objects.create(
                    # A port is reused once its replica is gone, and gone rows stay
                    # for the record: the suffix keeps ids unique.
                    replica_id=f"{pool.model_id}-{pool.version.version}-{region}-"
                    f"{node}-{port}-{secrets.token_hex(3)}",
                    model_id=pool.model_id,
                    version=pool.version,
                    region=region,
                    node=node,
                    url=replica_url(host, port),
                    state=ReplicaState.STARTING,
                )
                gpus_free -= gpus
                created.append(replica)
    return created, drained


def set_replica_state(replica_id: str, *, expected: Iterable[str], state: str) -> bool:
    """Move a replica to ``state`` if it is in one of ``expected``; True if it moved."""
    return bool(
        Replica.objects.filter(pk=replica_id, state__in=list(expected)).update(
            state=state
        )
    )


def record_heartbeats(beats: Iterable[ReplicaBeat], *, now: datetime) -> int:
    """Write the latest load and ``last_heartbeat`` of beating replicas; return rows.

    Replicas already marked gone stay gone: a late beat from a replica the reaper
    gave up on does not revive it (its agent removes it and starts a new one).
    """
    written = 0
    for beat in beats:
        written += (
            Replica.objects.live()
            .filter(pk=beat.replica_id)
            .update(
                queue_depth=beat.queue_depth,
                tokens_in_flight=beat.tokens_in_flight,
                kv_cache_usage_perc=min(1.0, max(0.0, beat.kv_cache_usage_perc)),
                last_heartbeat=now,
            )
        )
    return written


def remove_replica(replica_id: str) -> None:
    """Delete a replica row once its process has stopped (seed: draining -> removed)."""
    Replica.objects.filter(pk=replica_id).delete()


def pool_state(
    *, model_id: str, now: datetime, region: str | None = None
) -> dict[str, Any]:
    """Return the seed's pool state: replicas, queue depth, tokens in flight, hit rate.

    Sums cover replicas that are serving and heard from within the missed-beat
    window; every non-gone replica is listed with its state and silence.
    """
    model = get_model(model_id)
    beat_s = settings.PLATFORM_HEARTBEAT_DB_S
    missed = settings.PLATFORM_MISSED_BEATS
    replicas_qs = Replica.objects.live().filter(model=model).select_related("version")
    pools_qs = Pool.objects.filter(model=model).select_related("version")
    if region is not None:
        replicas_qs = replicas_qs.filter(region=region)
        pools_qs = pools_qs.filter(region=region)
    replicas = []
    serving_by_pool: dict[tuple[int, str], int] = {}
    queue_depth = 0
    tokens_in_flight = 0
    for replica in replicas_qs:
        silent = is_silent(replica.last_heartbeat, now, beat_s, missed)
        is_serving = replica.state == ReplicaState.SERVING and not silent
        if is_serving:
            queue_depth += replica.queue_depth
            tokens_in_flight += replica.tokens_in_flight
            key = (replica.version_id, replica.region)
            serving_by_pool[key] = serving_by_pool.get(key, 0) + 1
        replicas.append(
            {
                "replica_id": replica.replica_id,
                "version": replica.version.version,
                "region": replica.region,
                "node": replica.node,
                "state": replica.state,
                "is_silent": silent,
                "queue_depth": replica.queue_depth,
                "tokens_in_flight": replica.tokens_in_flight,
                "kv_cache_usage_perc": replica.kv_cache_usage_perc,
                "last_heartbeat": (
                    replica.last_heartbeat.isoformat()
                    if replica.last_heartbeat
                    else None
                ),
            }
        )
    pools = []
    for pool in pools_qs:
        serving = serving_by_pool.get((pool.version_id, pool.region), 0)
        capacity = CapacityRecord(
            tokens_per_s=pool.version.load_test_tokens_per_s,
            tokens_in_flight=pool.version.load_test_tokens_in_flight,
        )
        pools.append(
            {
                "version": pool.version.version,
                "region": pool.region,
                "min_replicas": pool.min_replicas,
                "max_replicas": pool.max_replicas,
                "serving_replicas": serving,
                "capacity_tokens_in_flight": pool_capacity_tokens(
                    serving,
                    capacity,
                    settings.PLATFORM_DEFAULT_REPLICA_TOKENS_IN_FLIGHT,
                ),
                "capacity_is_measured": capacity.is_measured,
            }
        )
    return {
        "model": model.model,
        "region": region,
        "replicas": replicas,
        "queue_depth": queue_depth,
        "tokens_in_flight": tokens_in_flight,
        "prefix_hit_rate": prefix_hit_rate_since(
            model_id=model.model, since=now - HIT_RATE_WINDOW
        ),
        "pools": pools,
    }
