"""Public surface: ``get_gateway``, ``build_gateway``, ``gateway_settings``,
``allowed_hosts``, ``reset_for_tests``.

The gateway of this process, built once from settings, in one pass: its snapshot
holder, live load, admission (over Redis or memory) with its pool view, usage
counter, rollout figures recorder, upstream session and chat service are each
built with what they need and handed to the ``Gateway``. With Redis, the limits and the usage counter fall back to
this process's memory while Redis is unreachable (``routing.failover``). Mutable
routing state (rings, cursors, retry budgets, queues) lives in those objects, never
in module globals of the domain code.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from channels.db import database_sync_to_async
from django.conf import settings
from django.utils import timezone

from accounts.services import touch_api_keys
from metering.domain.cost import TokenWeights
from metering.figures import FigureRecorder
from routing.admission import LiveAdmission, LivePoolView
from routing.budgets import (
    BudgetGuard,
    BudgetStore,
    FailoverBudgetStore,
    MemoryBudgetStore,
)
from routing.chat import BackgroundTasks, ChatService, UsageCounter
from routing.domain.admission_control import AdmissionControl, AdmissionOptions
from routing.domain.hosts import HostPolicy
from routing.domain.policies import PolicyOptions
from routing.domain.snapshot import ConfigSnapshot
from routing.domain.snapshot_file import file_key
from routing.domain.tiers import Tier
from routing.failover import FailoverLimits, RedisFailover
from routing.gateway import Gateway
from routing.key_uses import KeyUses
from routing.limiter_redis import RedisBucketStore, RedisConcurrency
from routing.limiter_store import LimitStore, MemoryBucketStore, MemoryConcurrency
from routing.live import LiveLoad
from routing.plan import GatewaySettings
from routing.prompt_tokens import VersionCounters
from routing.region_limits import RegionLimits
from routing.services import build_snapshot
from routing.snapshots import SnapshotFile, SnapshotHolder
from routing.sticky import ConversationVersions
from routing.traces import Tracing, build_tracing
from routing.traffic import RedisTrafficStore, TrafficRecorder, traffic_salt
from routing.upstream import Upstream

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
        first_token_timeout_s=settings.PLATFORM_FIRST_TOKEN_TIMEOUT_S,
        inter_token_timeout_s=settings.PLATFORM_INTER_TOKEN_TIMEOUT_S,
        stall_after_s=settings.PLATFORM_GATEWAY_STALL_S,
        policy_options=PolicyOptions(
            min_bound_tokens=settings.PLATFORM_AFFINITY_MIN_BOUND_TOKENS,
            ring_choices=settings.PLATFORM_AFFINITY_RING_CHOICES,
            prefill_gap_tokens=settings.PLATFORM_CACHE_PREFILL_GAP_TOKENS,
            cache_load_factor=settings.PLATFORM_CACHE_LOAD_FACTOR,
        ),
        engine_api_key=settings.PLATFORM_ENGINE_API_KEY,
        figures_bucket_s=settings.PLATFORM_FIGURES_BUCKET_S,
        refusal_patterns=tuple(settings.PLATFORM_REFUSAL_PATTERNS),
        default_tiers=frozenset(Tier(name) for name in settings.PLATFORM_DEFAULT_TIERS),
    )


def admission_options() -> AdmissionOptions:
    """Return the admission queue's bounds from Django settings."""
    return AdmissionOptions(
        max_queue=settings.PLATFORM_ADMISSION_MAX_QUEUE,
        max_wait_s=settings.PLATFORM_ADMISSION_MAX_WAIT_S,
        batch_ceiling=settings.PLATFORM_BATCH_CEILING,
        batch_lane=settings.PLATFORM_BATCH_LANE,
    )


def build_gateway() -> Gateway:
    """Build this process's gateway from settings (Redis when REDIS_URL is set)."""
    region = settings.PLATFORM_REGION
    redis_client = _redis_client()
    live = LiveLoad(
        gateway_id=f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}",
        region=region,
        redis=redis_client,
        prefix=settings.REDIS_KEY_PREFIX,
        # Redis beats every second; without Redis (or while it is unreachable),
        # liveness is the database beat.
        beat_s=settings.PLATFORM_HEARTBEAT_S,
        db_beat_s=settings.PLATFORM_HEARTBEAT_DB_S,
        missed_beats=settings.PLATFORM_MISSED_BEATS,
    )

    @database_sync_to_async
    def load() -> ConfigSnapshot:
        return build_snapshot(
            region=region, default_policy=settings.PLATFORM_ROUTING_POLICY
        )

    snapshots = SnapshotHolder(
        load,
        prompt_counters=VersionCounters(),
        file=_snapshot_file(region),
        persist_s=settings.PLATFORM_SNAPSHOT_PERSIST_S,
        max_file_age_s=settings.PLATFORM_SNAPSHOT_MAX_FILE_AGE_S,
    )
    limits, counter, figures, flush, failover = _stores(redis_client, live)
    region_limits = RegionLimits(
        redis=redis_client,
        prefix=settings.REDIS_KEY_PREFIX,
        slot_s=settings.PLATFORM_LIMIT_SHARES_SLOT_S,
        # A slot is read until it leaves the window, then expires.
        slot_ttl_s=settings.PLATFORM_LIMIT_SHARES_WINDOW_S
        + 2 * settings.PLATFORM_LIMIT_SHARES_SLOT_S,
        clock=time.time,
    )
    admission = LiveAdmission(
        control=AdmissionControl(
            LivePoolView(
                snapshot=lambda: snapshots.current,
                live=live,
                default_replica_tokens_in_flight=(
                    settings.PLATFORM_DEFAULT_REPLICA_TOKENS_IN_FLIGHT
                ),
            ),
            admission_options(),
        ),
        limits=limits,
        live=live,
        region_limits=region_limits,
    )
    config = gateway_settings()
    upstream = Upstream(
        connect_timeout_s=config.connect_timeout_s,
        first_token_timeout_s=config.first_token_timeout_s,
        inter_token_timeout_s=config.inter_token_timeout_s,
        engine_api_key=config.engine_api_key,
        stall_after_s=config.stall_after_s,
    )
    background = BackgroundTasks()
    chat = ChatService(
        traffic=_traffic_recorder(redis_client, background),
        settings=config,
        live=live,
        admission=admission,
        upstream=upstream,
        usage_counter=counter,
        background=background,
        rng=random.Random(),
        figures=figures,
        conversations=_conversation_versions(redis_client),
        budgets=BudgetGuard(
            store=_budget_store(redis_client),
            weights=TokenWeights(**settings.PLATFORM_COST_WEIGHTS),
        ),
    )
    return Gateway(
        settings=config,
        snapshots=snapshots,
        live=live,
        chat=chat,
        upstream=upstream,
        background=background,
        snapshot_refresh_s=settings.PLATFORM_SNAPSHOT_REFRESH_S,
        flush_usage=flush,
        flush_usage_s=settings.PLATFORM_USAGE_FLUSH_S,
        failover=failover,
        hosts=allowed_hosts(),
        key_uses=KeyUses(_write_key_uses),
        key_uses_flush_s=settings.PLATFORM_KEY_LAST_USED_FLUSH_S,
        region_limits=region_limits,
        tracing=tracing(),
    )


def tracing() -> Tracing:
    """Return the gateway's tracing from settings (off unless enabled)."""
    return build_tracing(
        is_enabled=settings.PLATFORM_TRACES_ENABLED,
        endpoint=settings.PLATFORM_TRACES_ENDPOINT,
        sample_ratio=settings.PLATFORM_TRACES_SAMPLE_RATIO,
        service_name="gateway",
        resource_attributes={
            "platform.region": settings.PLATFORM_REGION,
            "service.namespace": "platform",
        },
    )


def _snapshot_file(region: str) -> SnapshotFile | None:
    """The region's snapshot file, or None when disabled: by an empty
    PLATFORM_SNAPSHOT_PATH, or because SECRET_KEY is drawn per process (no other
    process could verify the file)."""
    if not settings.PLATFORM_SNAPSHOT_PATH:
        return None
    if settings.SECRET_KEY_IS_EPHEMERAL:
        logger.info("snapshot file disabled: SECRET_KEY is not set")
        return None
    path = Path(settings.PLATFORM_SNAPSHOT_PATH)
    if not path.is_absolute():
        path = Path(settings.BASE_DIR) / path
    return SnapshotFile(path, key=file_key(settings.SECRET_KEY), region=region)


def allowed_hosts() -> HostPolicy:
    """Return the hosts /v1 serves: ALLOWED_HOSTS, with Django's DEBUG defaults."""
    patterns = settings.ALLOWED_HOSTS
    if settings.DEBUG and not patterns:
        patterns = [".localhost", "127.0.0.1", "[::1]"]
    return HostPolicy.from_patterns(patterns)


@database_sync_to_async
def _write_key_uses(key_ids: frozenset[int]) -> int:
    return touch_api_keys(key_ids=key_ids, now=timezone.now())


def _redis_client() -> Any | None:
    if not settings.REDIS_URL:
        return None
    import redis.asyncio as redis_asyncio

    from metering.counters import redis_pool

    return redis_asyncio.Redis(
        connection_pool=redis_pool(
            settings.REDIS_URL, max_connections=64, wait_s=2.0, socket_timeout_s=1.0
        )
    )


def _stores(
    redis_client: Any | None, live: LiveLoad
) -> tuple[
    LimitStore,
    UsageCounter,
    FigureRecorder,
    Callable[[], Awaitable[None]] | None,
    RedisFailover | None,
]:
    """Return the limits, the usage counter, the figures recorder, their flush and
    the Redis failover.

    With Redis: shared limits, counts and figures, limits and counts falling back
    to this process while Redis is unreachable (figures are dropped meanwhile);
    they are flushed by the Celery beat task. Without: memory, flushed by the
    gateway itself.
    """
    if redis_client is None:
        counter, figures, flush = _memory_usage_counter()
        return (
            MemoryBucketStore().pair(MemoryConcurrency()),
            counter,
            figures,
            flush,
            None,
        )
    from metering.counters import FailoverUsageCounter, RedisUsageCounter
    from metering.figures import RedisFigureRecorder

    prefix = settings.REDIS_KEY_PREFIX
    limits = FailoverLimits(
        RedisBucketStore(redis_client, prefix).pair(
            RedisConcurrency(redis_client, prefix)
        ),
        gateways=lambda: live.gateways_seen,
    )
    usage = FailoverUsageCounter(RedisUsageCounter(redis_client, prefix))
    figures = RedisFigureRecorder(redis_client, prefix)
    return limits, usage, figures, None, RedisFailover(limits=limits, usage=usage)


def _traffic_recorder(
    redis_client: Any | None, background: BackgroundTasks
) -> TrafficRecorder | None:
    """Return the traffic twin's recorder; None without Redis (nothing recorded)."""
    if redis_client is None:
        logger.info("traffic twin off: it records to Redis, and REDIS_URL is unset")
        return None
    if settings.SECRET_KEY_IS_EPHEMERAL and not settings.PLATFORM_TRAFFIC_SALT:
        logger.warning(
            "traffic twin: neither PLATFORM_TRAFFIC_SALT nor SECRET_KEY is set, so "
            "this process's prefix hashes match no other process's"
        )
    return TrafficRecorder(
        store=RedisTrafficStore(
            redis_client,
            settings.REDIS_KEY_PREFIX,
            retention_s=settings.PLATFORM_TRAFFIC_RECORD_RETENTION_S,
            max_records=settings.PLATFORM_TRAFFIC_RECORD_MAX,
        ),
        background=background,
        salt=traffic_salt(),
        block_size=settings.PLATFORM_TRAFFIC_BLOCK_TOKENS,
        flush_s=settings.PLATFORM_TRAFFIC_FLUSH_S,
        buffer_max=settings.PLATFORM_TRAFFIC_BUFFER,
    )


def _budget_store(redis_client: Any | None) -> BudgetStore:
    """The region's budget counters in Redis (this process's while it fails), or
    this process's without Redis."""
    if redis_client is None:
        return MemoryBudgetStore()
    from routing.budget_redis import RedisBudgetStore

    return FailoverBudgetStore(
        RedisBudgetStore(redis_client, settings.REDIS_KEY_PREFIX)
    )


def _conversation_versions(redis_client: Any | None) -> ConversationVersions:
    """Where conversations remember their version during a rollout: the region's
    Redis (shared by its gateways), or this process without it."""
    from routing.sticky import MemoryConversationVersions, RedisConversationVersions

    if redis_client is None:
        return MemoryConversationVersions()
    return RedisConversationVersions(redis_client, settings.REDIS_KEY_PREFIX)


def _memory_usage_counter() -> tuple[
    UsageCounter, FigureRecorder, Callable[[], Awaitable[None]]
]:
    """Return the embedded usage counter and figures recorder, and the flush the
    gateway runs (usage, then figures)."""
    from metering.counters import MemoryUsageCounter
    from metering.figures import MemoryFigureRecorder
    from metering.services import flush_memory_figures, flush_memory_usage

    counter = MemoryUsageCounter()
    figures = MemoryFigureRecorder()
    write = database_sync_to_async(flush_memory_usage)
    write_figures = database_sync_to_async(flush_memory_figures)
    region = settings.PLATFORM_REGION

    async def flush() -> None:
        entries = counter.drain()
        if entries:
            try:
                await write(entries=entries)
            except Exception:
                # Keep the counts for the next flush rather than lose them.
                for key, counts in entries.items():
                    await counter.add(key, counts)
                raise
        sums = figures.drain(time.time())
        if sums:
            try:
                await write_figures(entries=sums, region=region)
            except Exception:
                figures.restore(sums)
                raise

    return counter, figures, flush


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
