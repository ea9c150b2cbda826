"""The gateway's usage counters: Redis hashes per minute, and the embedded ledger."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Iterator

import pytest
import redis

from metering.counters import (
    USAGE_TTL_S,
    MemoryUsageCounter,
    RedisUsageCounter,
    parse_usage_hash_key,
    usage_hash_key,
    usage_index_key,
)
from metering.domain.usage import UsageCounts, UsageKey

MINUTE = 1_740_830_400  # 2025-03-01 12:00 UTC
KEY = UsageKey("search", "chat-7b", "v1", MINUTE)


@pytest.fixture
def prefix(redis_url: str) -> Iterator[str]:
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(f"{prefix}:*"):
        client.delete(key)
    client.close()


def run_with_counter(
    redis_url: str, prefix: str, work: Callable[[RedisUsageCounter], Awaitable[None]]
) -> None:
    async def main() -> None:
        # Sums, not speed, are under test: a loaded machine may take seconds to
        # open the pool's connections to the shared Redis.
        counter = RedisUsageCounter.from_url(redis_url, prefix=prefix, timeout_s=10.0)
        try:
            await work(counter)
        finally:
            await counter.aclose()

    asyncio.run(main())


def test_redis_counter_sums_exactly_across_concurrent_coroutines(
    redis_url: str, prefix: str
) -> None:
    async def work(counter: RedisUsageCounter) -> None:
        await asyncio.gather(
            *(
                counter.add(
                    KEY,
                    UsageCounts(
                        prompt_tokens=10,
                        cached_tokens=i % 3,
                        output_tokens=i,
                        requests=1,
                    ),
                )
                for i in range(300)
            )
        )

    run_with_counter(redis_url, prefix, work)

    stored = redis.Redis.from_url(redis_url).hgetall(usage_hash_key(prefix, KEY))
    assert stored == {
        b"prompt_tokens": b"3000",
        b"cached_tokens": str(sum(i % 3 for i in range(300))).encode(),
        b"output_tokens": str(sum(range(300))).encode(),
        b"requests": b"300",
    }


def test_redis_counter_indexes_the_hash_and_sets_a_ttl(
    redis_url: str, prefix: str
) -> None:
    other = UsageKey("ads", "chat-7b", "v1", MINUTE + 60)

    async def work(counter: RedisUsageCounter) -> None:
        await counter.add(KEY, UsageCounts(rate_limited=1))
        await counter.add(other, UsageCounts(shed=2))

    run_with_counter(redis_url, prefix, work)

    client = redis.Redis.from_url(redis_url)
    hash_key = f"{prefix}:usage:{MINUTE}:search:chat-7b:v1"
    assert usage_hash_key(prefix, KEY) == hash_key
    assert client.smembers(usage_index_key(prefix)) == {
        hash_key.encode(),
        f"{prefix}:usage:{MINUTE + 60}:ads:chat-7b:v1".encode(),
    }
    assert client.hgetall(hash_key) == {b"rate_limited": b"1"}
    assert USAGE_TTL_S - 60 < client.ttl(hash_key) <= USAGE_TTL_S
    assert parse_usage_hash_key(prefix, hash_key) == KEY


def test_redis_counter_writes_nothing_for_zero_counts(
    redis_url: str, prefix: str
) -> None:
    async def work(counter: RedisUsageCounter) -> None:
        await counter.add(KEY, UsageCounts())

    run_with_counter(redis_url, prefix, work)

    assert list(redis.Redis.from_url(redis_url).scan_iter(f"{prefix}:*")) == []


@pytest.mark.parametrize(
    "key",
    [
        UsageKey("search:x", "chat-7b", "v1", MINUTE),
        UsageKey("search", "chat:7b", "v1", MINUTE),
        UsageKey("search", "chat-7b", "v1:2", MINUTE),
        UsageKey("", "chat-7b", "v1", MINUTE),
    ],
)
def test_redis_counter_rejects_names_that_are_not_slugs(
    redis_url: str, prefix: str, key: UsageKey
) -> None:
    async def work(counter: RedisUsageCounter) -> None:
        with pytest.raises(ValueError, match="slugs"):
            await counter.add(key, UsageCounts(requests=1))

    run_with_counter(redis_url, prefix, work)

    assert list(redis.Redis.from_url(redis_url).scan_iter(f"{prefix}:*")) == []


@pytest.mark.parametrize(
    "counts",
    [
        UsageCounts(prompt_tokens=1, cached_tokens=2),
        UsageCounts(output_tokens=-1),
        UsageCounts(requests=1, batch_requests=2),
        UsageCounts(prompt_tokens=3, batch_prompt_tokens=4),
        UsageCounts(output_tokens=5, batch_output_tokens=6),
    ],
)
def test_counters_reject_counts_no_row_may_hold(
    redis_url: str, prefix: str, counts: UsageCounts
) -> None:
    async def work(counter: RedisUsageCounter) -> None:
        with pytest.raises(ValueError):
            await counter.add(KEY, counts)
        with pytest.raises(ValueError):
            await MemoryUsageCounter().add(KEY, counts)

    run_with_counter(redis_url, prefix, work)


def test_parse_usage_hash_key_refuses_foreign_and_malformed_names() -> None:
    assert parse_usage_hash_key("p", f"p:usage:{MINUTE}:a:b:v1") == UsageKey(
        "a", "b", "v1", MINUTE
    )
    assert parse_usage_hash_key("p", f"q:usage:{MINUTE}:a:b:v1") is None
    assert parse_usage_hash_key("p", f"p:usage:{MINUTE}:a:b") is None
    assert parse_usage_hash_key("p", f"p:usage:{MINUTE + 1}:a:b:v1") is None
    assert parse_usage_hash_key("p", f"p:usage:0{MINUTE}:a:b:v1") is None
    assert parse_usage_hash_key("p", "p:usage:index") is None


def test_memory_counter_sums_and_drains_closed_minutes() -> None:
    counter = MemoryUsageCounter()
    later = UsageKey("search", "chat-7b", "v1", MINUTE + 60)

    async def main() -> None:
        await asyncio.gather(
            *(counter.add(KEY, UsageCounts(output_tokens=1)) for _ in range(100)),
            counter.add(later, UsageCounts(requests=1)),
        )

    asyncio.run(main())

    assert counter.drain(before_minute_epoch=MINUTE + 60) == {
        KEY: UsageCounts(output_tokens=100)
    }
    assert len(counter) == 1
    counter.restore({later: UsageCounts(requests=2)})
    assert counter.drain() == {later: UsageCounts(requests=3)}
