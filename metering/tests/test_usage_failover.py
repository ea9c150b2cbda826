"""Usage counted while Redis is unreachable reaches Redis when it answers again.

The test runs its own redis-server (``tests.live.RedisServer``) and stops it; the
machine's shared Redis is never stopped.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
import redis
import redis.asyncio as redis_asyncio
from prometheus_client import REGISTRY

from metering.counters import (
    FailoverUsageCounter,
    RedisUsageCounter,
    redis_pool,
    usage_hash_key,
)
from metering.domain.usage import UsageCounts, UsageKey
from tests.live import RedisServer

MINUTE = 1_740_830_400  # 2025-03-01 12:00 UTC


def buffered_rows() -> float | None:
    return REGISTRY.get_sample_value("platform_usage_buffered_rows")


def test_usage_counted_during_an_outage_is_pushed_when_redis_answers(
    tmp_path: Path, redis_server_binary: str
) -> None:
    """GIVEN a failover counter over the test's own Redis
    WHEN requests are counted before, during and after Redis is stopped
    THEN the minutes' hashes hold every count once Redis is back, and nothing
    waits in memory any more.
    """
    server = RedisServer(tmp_path, binary=redis_server_binary)
    server.start()
    prefix = f"test-usage-failover-{uuid.uuid4().hex[:8]}"
    one = UsageKey("search", "chat-7b", "v1", MINUTE)
    two = UsageKey("search", "chat-7b", "v1", MINUTE + 60)
    request = UsageCounts(
        prompt_tokens=10, cached_tokens=4, output_tokens=7, requests=1
    )

    async def scenario() -> None:
        client = redis_asyncio.Redis.from_url(
            server.url, socket_timeout=1.0, socket_connect_timeout=1.0
        )
        counter = FailoverUsageCounter(RedisUsageCounter(client, prefix))
        try:
            await counter.add(one, request)
            server.stop()
            for key in (one, one, two):
                await counter.add(key, request)
            await counter.add(two, UsageCounts(rate_limited=1))
            assert counter.is_local and len(counter) == 2
            assert buffered_rows() == 2
            # A key no hash could hold is refused now, not kept to fail each push.
            with pytest.raises(ValueError, match="slugs"):
                await counter.add(UsageKey("a:b", "chat-7b", "v1", MINUTE), request)
            # Still down: nothing pushed, nothing dropped.
            assert not await counter.restore()
            assert counter.is_local and len(counter) == 2

            server.start()
            assert await counter.restore()
            assert not counter.is_local and len(counter) == 0
            assert buffered_rows() == 0
            await counter.add(two, request)  # straight to Redis again
            assert len(counter) == 0
        finally:
            await client.aclose()

    try:
        asyncio.run(scenario())
        with redis.Redis.from_url(server.url, decode_responses=True) as sync:
            assert sync.hgetall(usage_hash_key(prefix, one)) == {
                "prompt_tokens": "30",
                "cached_tokens": "12",
                "output_tokens": "21",
                "requests": "3",
            }
            assert sync.hgetall(usage_hash_key(prefix, two)) == {
                "prompt_tokens": "20",
                "cached_tokens": "8",
                "output_tokens": "14",
                "requests": "2",
                "rate_limited": "1",
            }
            assert sync.smembers(f"{prefix}:usage:index") == {
                usage_hash_key(prefix, one),
                usage_hash_key(prefix, two),
            }
    finally:
        server.stop()


def test_the_gateways_pool_survives_a_redis_restart(
    tmp_path: Path, redis_server_binary: str
) -> None:
    """GIVEN the gateway's pool holding connections opened before Redis restarted
    WHEN commands go out on them once Redis answers again
    THEN each succeeds (sent again on a new connection), so no stale connection
    switches a gateway back to its local limits; while Redis is down the first
    attempt still fails at once.
    """
    server = RedisServer(tmp_path, binary=redis_server_binary)
    server.start()

    async def scenario() -> None:
        pool = redis_pool(
            server.url, max_connections=8, wait_s=2.0, socket_timeout_s=1.0
        )
        client = redis_asyncio.Redis.from_pool(pool)
        try:
            # Eight connections open at once, all back in the pool.
            await asyncio.gather(*(client.blpop([f"none-{i}"], 0.05) for i in range(8)))
            server.stop()
            with pytest.raises(redis.ConnectionError):
                await client.ping()
            server.start()
            replies = await asyncio.gather(
                *(client.incr("after-restart") for _ in range(8))
            )
            assert sorted(replies) == list(range(1, 9))  # each ran exactly once
        finally:
            await client.aclose()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()
