"""Public surface: ``get_gateway``, ``build_gateway``, ``reset_for_tests``.

The gateway of this process, built once from settings: its snapshot loader, live
load, usage counter and admission. Mutable routing state (rings, cursors, retry
budgets) lives in that object, never in module globals of the domain code.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from typing import Any

from channels.db import database_sync_to_async
from django.conf import settings

from models_registry.domain.capacity import CapacityRecord, pool_capacity_tokens
from routing.admission import Admission
from routing.domain.snapshot import ConfigSnapshot
from routing.gateway import Gateway, GatewaySettings
from routing.limiter_store import (
    MemoryBucketStore,
    MemoryConcurrency,
    RedisBucketStore,
    RedisConcurrency,
)
from routing.limits import TieredAdmission
from routing.live import LiveLoad
from routing.services import build_snapshot

logger = logging.getLogger(__name__)

_gateway: Gateway | None = None


def gateway_settings() -> GatewaySettings:
    """Return the gateway's settings from Django settings."""
    return GatewaySettings(
        region=settings.PLATFORM_REGION,
        max_body_bytes=settings.PLATFORM_MAX_BODY_BYTES,
        default_max_tokens=settings.PLATFORM_DEFAULT_MAX_TOKENS,
        default_tokens_per_minute=settings.PLATFORM_DEFAULT_TOKENS_PER_MINUTE,
        default_max_concurrency=settings.PLATFORM_DEFAULT_MAX_CONCURRENCY,
        retry_ratio=settings.PLATFORM_RETRY_RATIO,
        connect_timeout_s=settings.PLATFORM_UPSTREAM_CONNECT_TIMEOUT_S,
        affinity_min_bound_tokens=settings.PLATFORM_AFFINITY_MIN_BOUND_TOKENS,
        engine_api_key=settings.PLATFORM_ENGINE_API_KEY,
    )


def build_gateway(*, admission: Admission | None = None) -> Gateway:
    """Build this process's gateway from settings (Redis when REDIS_URL is set)."""
    region = settings.PLATFORM_REGION
    redis_client: Any | None = None
    if settings.REDIS_URL:
        import redis.asyncio as redis_asyncio

        # A blocking pool: a burst of requests ending together waits for a
        # connection instead of failing with "too many connections".
        redis_client = redis_asyncio.Redis(
            connection_pool=redis_asyncio.BlockingConnectionPool.from_url(
                settings.REDIS_URL,
                max_connections=64,
                timeout=2.0,
                socket_timeout=1.0,
                socket_connect_timeout=1.0,
            )
        )
    live = LiveLoad(
        gateway_id=f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}",
        region=region,
        redis=redis_client,
        prefix=settings.REDIS_KEY_PREFIX,
        # Redis beats every second; without Redis, liveness is the database beat.
        beat_s=(
            settings.PLATFORM_HEARTBEAT_S
            if redis_client
            else settings.PLATFORM_HEARTBEAT_DB_S
        ),
        missed_beats=settings.PLATFORM_MISSED_BEATS,
    )

    @database_sync_to_async
    def load() -> ConfigSnapshot:
        return build_snapshot(
            region=region, default_policy=settings.PLATFORM_ROUTING_POLICY
        )

    flush = None
    if redis_client is not None:
        from metering.counters import RedisUsageCounter

        counter: Any = RedisUsageCounter(redis_client, settings.REDIS_KEY_PREFIX)
    else:
        from metering.counters import MemoryUsageCounter
        from metering.services import flush_memory_usage

        counter = MemoryUsageCounter()
        write = database_sync_to_async(flush_memory_usage)

        async def flush() -> None:
            entries = counter.drain()
            if not entries:
                return
            try:
                await write(entries=entries)
            except Exception:
                # Keep the counts for the next flush rather than lose them.
                for key, counts in entries.items():
                    await counter.add(key, counts)
                raise

    gateway = Gateway(
        settings=gateway_settings(),
        load_snapshot=load,
        live=live,
        usage_counter=counter,
        admission=admission,
        snapshot_refresh_s=settings.PLATFORM_SNAPSHOT_REFRESH_S,
        flush_usage=flush,
        flush_usage_s=settings.PLATFORM_USAGE_FLUSH_S,
    )
    if admission is None:
        gateway.admission = tiered_admission(gateway, redis_client)
    return gateway


def tiered_admission(gateway: Gateway, redis_client: Any | None) -> TieredAdmission:
    """Return team limits and tiers over Redis (shared by gateways) or memory."""
    if redis_client is not None:
        buckets: Any = RedisBucketStore(redis_client, settings.REDIS_KEY_PREFIX)
        concurrency: Any = RedisConcurrency(redis_client, settings.REDIS_KEY_PREFIX)
    else:
        buckets, concurrency = MemoryBucketStore(), MemoryConcurrency()
    default_per_replica = settings.PLATFORM_DEFAULT_REPLICA_TOKENS_IN_FLIGHT

    def capacity_of(model: str, version: str) -> int:
        snapshot = gateway.snapshot
        if snapshot is None:
            return 0
        record = snapshot.versions.get((model, version))
        measured = record.load_test_tokens_in_flight if record is not None else None
        serving = len(gateway.live.nodes(snapshot, model, version, time.monotonic()))
        # A figure of 0 is no measurement: keep the pool usable on the default.
        capacity = CapacityRecord(tokens_per_s=None, tokens_in_flight=measured or None)
        return pool_capacity_tokens(serving, capacity, default_per_replica)

    return TieredAdmission(
        live=gateway.live,
        buckets=buckets,
        concurrency=concurrency,
        capacity_of=capacity_of,
        max_queue=settings.PLATFORM_ADMISSION_MAX_QUEUE,
        max_wait_s=settings.PLATFORM_ADMISSION_MAX_WAIT_S,
        batch_ceiling=settings.PLATFORM_BATCH_CEILING,
    )


def get_gateway() -> Gateway:
    """Return this process's gateway, building it on first use."""
    global _gateway
    if _gateway is None:
        _gateway = build_gateway()
    return _gateway


def reset_for_tests() -> None:
    """Forget the process's gateway (tests build their own)."""
    global _gateway
    _gateway = None
