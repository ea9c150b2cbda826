"""Flushing usage to rows: closed minutes only, idempotent, crash-safe, late-safe."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Protocol

import pytest
import redis
from pytest_django import DjangoCaptureOnCommitCallbacks, Settings

from accounts.models import Team
from metering.counters import RedisUsageCounter, usage_hash_key, usage_index_key
from metering.domain.usage import COUNTER_FIELDS, UsageCounts, UsageKey
from metering.models import Usage
from metering.services import (
    flush_memory_usage,
    flush_redis_usage,
    forget_flushed,
    read_closed_usage,
    write_usage_rows,
)
from metering.tasks import flush_usage
from models_registry.models import ModelVersion

MINUTE = 1_740_830_400  # 2025-03-01 12:00 UTC
KEY = UsageKey("search", "chat-7b", "v1", MINUTE)
AFTER_CLOSE = datetime.fromtimestamp(MINUTE + 66, tz=UTC)

pytestmark = pytest.mark.django_db

# What the ``add`` and ``flush`` fixtures return.
AddUsage = Callable[[UsageKey, UsageCounts], None]


class Flush(Protocol):
    def __call__(self, now: datetime = ...) -> int: ...


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def prefix(client: redis.Redis) -> Iterator[str]:
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    yield prefix
    for key in client.scan_iter(f"{prefix}:*"):
        client.delete(key)


@pytest.fixture
def add(redis_url: str, prefix: str) -> AddUsage:
    """Return add(key, counts): record usage as a gateway does."""

    def add(key: UsageKey, counts: UsageCounts) -> None:
        async def main() -> None:
            counter = RedisUsageCounter.from_url(redis_url, prefix=prefix)
            try:
                await counter.add(key, counts)
            finally:
                await counter.aclose()

        asyncio.run(main())

    return add


@pytest.fixture
def flush(
    client: redis.Redis,
    prefix: str,
    django_capture_on_commit_callbacks: DjangoCaptureOnCommitCallbacks,
) -> Flush:
    """Return flush(now): a full flush whose on-commit cleanup runs."""

    def flush(now: datetime = AFTER_CLOSE) -> int:
        with django_capture_on_commit_callbacks(execute=True):
            return flush_redis_usage(client=client, prefix=prefix, now=now)

    return flush


def row(key: UsageKey = KEY) -> UsageCounts:
    usage = Usage.objects.get(
        team_id=key.team,
        model_id=key.model,
        version__version=key.version,
        minute=key.minute_at,
    )
    return UsageCounts(**{f: getattr(usage, f) for f in COUNTER_FIELDS})


def indexed(client: redis.Redis, prefix: str) -> set[str]:
    members = client.smembers(usage_index_key(prefix))
    return {m.decode() if isinstance(m, bytes) else m for m in members}


TEN = UsageCounts(prompt_tokens=10, cached_tokens=4, output_tokens=7, requests=1)


def test_flush_writes_closed_minutes_only(
    team: Team,
    chat_v1: ModelVersion,
    add: AddUsage,
    flush: Flush,
    client: redis.Redis,
    prefix: str,
) -> None:
    open_key = UsageKey("search", "chat-7b", "v1", MINUTE + 60)
    add(KEY, TEN)
    add(open_key, TEN)

    # 12:01:04 - the 12:00 minute closed 4 s ago, inside the 5 s grace.
    assert flush(datetime.fromtimestamp(MINUTE + 64, tz=UTC)) == 0
    assert flush(AFTER_CLOSE) == 1

    assert row() == TEN
    assert Usage.objects.count() == 1
    assert indexed(client, prefix) == {usage_hash_key(prefix, open_key)}


def test_flush_twice_never_double_counts(
    team: Team, chat_v1: ModelVersion, add: AddUsage, flush: Flush
) -> None:
    add(KEY, TEN)
    add(KEY, TEN)
    assert flush() == 1
    assert flush() == 0
    assert row() == TEN + TEN


def test_overlapping_flushes_never_double_count(
    team: Team, chat_v1: ModelVersion, add: AddUsage, client: redis.Redis, prefix: str
) -> None:
    """GIVEN two flushes that read the same minute before either cleaned up
    WHEN both write and clean up
    THEN the row holds the totals once.
    """
    add(KEY, TEN)
    first = read_closed_usage(client=client, prefix=prefix, now=AFTER_CLOSE)
    second = read_closed_usage(client=client, prefix=prefix, now=AFTER_CLOSE)
    for pending in (first, second):
        write_usage_rows(entries={p.key: p.counts for p in pending})
    for pending in (first, second):
        forget_flushed(client=client, prefix=prefix, flushed=pending)

    assert row() == TEN
    assert indexed(client, prefix) == set()


def test_crash_between_commit_and_cleanup_loses_and_doubles_nothing(
    team: Team,
    chat_v1: ModelVersion,
    add: AddUsage,
    flush: Flush,
    client: redis.Redis,
    prefix: str,
) -> None:
    """GIVEN a flush that committed its rows but died before the Redis cleanup
    WHEN the next flush runs
    THEN the rows hold the totals once, and Redis forgets the minute.
    """
    add(KEY, TEN)
    pending = read_closed_usage(client=client, prefix=prefix, now=AFTER_CLOSE)
    assert write_usage_rows(entries={p.key: p.counts for p in pending}) == [KEY]
    assert indexed(client, prefix) == {usage_hash_key(prefix, KEY)}

    assert flush() == 1

    assert row() == TEN
    assert indexed(client, prefix) == set()
    assert flush() == 0
    assert row() == TEN


def test_counts_added_between_read_and_cleanup_are_flushed_next(
    team: Team,
    chat_v1: ModelVersion,
    add: AddUsage,
    flush: Flush,
    client: redis.Redis,
    prefix: str,
) -> None:
    add(KEY, TEN)
    pending = read_closed_usage(client=client, prefix=prefix, now=AFTER_CLOSE)
    write_usage_rows(entries={p.key: p.counts for p in pending})
    add(KEY, TEN)  # lands after the read, before the cleanup

    assert forget_flushed(client=client, prefix=prefix, flushed=pending) == 0
    assert indexed(client, prefix) == {usage_hash_key(prefix, KEY)}
    assert row() == TEN

    assert flush() == 1
    assert row() == TEN + TEN


def test_late_counts_for_a_flushed_minute_are_written_next_flush(
    team: Team,
    chat_v1: ModelVersion,
    add: AddUsage,
    flush: Flush,
    client: redis.Redis,
    prefix: str,
) -> None:
    add(KEY, TEN)
    assert flush() == 1
    assert indexed(client, prefix) == set()
    # The flushed hash is kept a while, shorter than a week.
    assert 0 < client.ttl(usage_hash_key(prefix, KEY)) <= 3600

    add(KEY, UsageCounts(output_tokens=5, rate_limited=1))
    assert flush() == 1

    assert row() == TEN + UsageCounts(output_tokens=5, rate_limited=1)


def test_write_usage_rows_never_lowers_a_total(
    team: Team, chat_v1: ModelVersion
) -> None:
    """An overlapping flush that read older totals and commits last changes nothing."""
    newer = TEN + TEN
    write_usage_rows(entries={KEY: newer})
    write_usage_rows(entries={KEY: TEN})
    assert row() == newer


def test_two_regions_flushing_one_minute_both_count(
    team: Team, chat_v1: ModelVersion, settings: Settings
) -> None:
    """A failover: east and west served the team in the same minute, each region's
    flush writes its own Redis's totals; the rows hold both (issue 32's region
    drill lost the smaller region's)."""
    settings.PLATFORM_REGION = "east"
    write_usage_rows(entries={KEY: TEN + TEN})
    settings.PLATFORM_REGION = "west"
    write_usage_rows(entries={KEY: TEN})
    write_usage_rows(entries={KEY: TEN})  # a second flush of west: no double count

    rows = Usage.objects.filter(team_id=KEY.team, minute=KEY.minute_at)
    assert sorted(rows.values_list("region", "requests")) == [("east", 2), ("west", 1)]
    assert sum(r.prompt_tokens for r in rows) == 30


def test_two_regions_replaying_their_flushes_count_once_each(
    team: Team,
    chat_v1: ModelVersion,
    redis_url: str,
    client: redis.Redis,
    django_capture_on_commit_callbacks: DjangoCaptureOnCommitCallbacks,
) -> None:
    """GIVEN east and west counting the same minute, each in its own Redis
    WHEN east flushes twice, and west's flush dies after its commit, is rerun, and
    then a stale copy of its first read is written again
    THEN the minute holds east's totals plus west's, each once.
    """
    prefixes = {"east": f"test-{uuid.uuid4().hex[:8]}", "west": ""}
    prefixes["west"] = prefixes["east"] + "-west"

    def add(region: str, counts: UsageCounts) -> None:
        async def main() -> None:
            counter = RedisUsageCounter.from_url(redis_url, prefix=prefixes[region])
            try:
                await counter.add(KEY, counts)
            finally:
                await counter.aclose()

        asyncio.run(main())

    def flush(region: str) -> int:
        with django_capture_on_commit_callbacks(execute=True):
            return flush_redis_usage(
                client=client, prefix=prefixes[region], now=AFTER_CLOSE, region=region
            )

    west_counts = UsageCounts(prompt_tokens=3, output_tokens=800, requests=8)
    try:
        add("east", TEN)
        add("east", TEN)
        add("west", west_counts)

        assert flush("east") == 1
        assert flush("east") == 0  # retried: nothing left to write
        stale = read_closed_usage(
            client=client, prefix=prefixes["west"], now=AFTER_CLOSE
        )
        write_usage_rows(entries={p.key: p.counts for p in stale}, region="west")
        assert flush("west") == 1  # the rerun after the crash: same totals
        write_usage_rows(entries={p.key: p.counts for p in stale}, region="west")
        assert flush("west") == 0
    finally:
        for prefix in prefixes.values():
            for key in client.scan_iter(f"{prefix}:*"):
                client.delete(key)

    rows = Usage.objects.filter(team_id=KEY.team, minute=KEY.minute_at)
    assert sorted(rows.values_list("region", "requests", "output_tokens")) == [
        ("east", 2, 14),
        ("west", 8, 800),
    ]
    assert sum(r.output_tokens for r in rows) == 814
    assert sum(r.prompt_tokens for r in rows) == 23


def test_flush_skips_an_unknown_team_and_drops_its_hash(
    team: Team,
    chat_v1: ModelVersion,
    add: AddUsage,
    flush: Flush,
    client: redis.Redis,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ghost = UsageKey("ghost", "chat-7b", "v1", MINUTE)
    old_version = UsageKey("search", "chat-7b", "v9", MINUTE)
    add(KEY, TEN)
    add(ghost, TEN)
    add(old_version, TEN)

    with caplog.at_level(logging.WARNING, logger="metering.services"):
        assert flush() == 1

    assert row() == TEN
    assert Usage.objects.count() == 1
    assert "ghost" in caplog.text and "v9" in caplog.text
    assert indexed(client, prefix) == set()
    assert not client.exists(usage_hash_key(prefix, ghost))
    assert not client.exists(usage_hash_key(prefix, old_version))


def test_flush_drops_malformed_index_members(
    team: Team, chat_v1: ModelVersion, flush: Flush, client: redis.Redis, prefix: str
) -> None:
    bad = f"{prefix}:usage:{MINUTE}:search:chat-7b"
    impossible = usage_hash_key(prefix, KEY)
    client.hset(impossible, mapping={"prompt_tokens": 1, "cached_tokens": 2})
    client.sadd(usage_index_key(prefix), bad, impossible)

    assert flush() == 0

    assert Usage.objects.count() == 0
    assert indexed(client, prefix) == set()
    assert not client.exists(impossible)


def test_flush_carries_the_batch_parts(
    team: Team,
    chat_v1: ModelVersion,
    add: AddUsage,
    flush: Flush,
    client: redis.Redis,
    prefix: str,
) -> None:
    """GIVEN a standard request and a batch one counted in Redis in one minute
    WHEN the minute is flushed, then a late batch request flushed again
    THEN the row holds the totals and, within them, the batch part.
    """
    batch = UsageCounts(
        prompt_tokens=30,
        output_tokens=12,
        requests=1,
        batch_requests=1,
        batch_prompt_tokens=30,
        batch_output_tokens=12,
    )
    add(KEY, TEN)
    add(KEY, batch)
    fields = client.hgetall(usage_hash_key(prefix, KEY))
    assert fields[b"batch_prompt_tokens"] == b"30"

    assert flush() == 1
    assert row() == TEN + batch
    add(KEY, batch)
    assert flush() == 1
    assert row() == TEN + batch + batch
    usage = Usage.objects.get()
    assert (usage.requests, usage.batch_requests) == (3, 2)
    assert (usage.prompt_tokens, usage.batch_prompt_tokens) == (70, 60)
    assert (usage.output_tokens, usage.batch_output_tokens) == (31, 24)


def test_flush_memory_usage_adds_to_rows(team: Team, chat_v1: ModelVersion) -> None:
    other = UsageKey("search", "chat-7b", "v1", MINUTE + 60)
    assert flush_memory_usage(entries={KEY: TEN, other: TEN}) == 2
    batch = UsageCounts(
        prompt_tokens=2, output_tokens=1, batch_prompt_tokens=2, batch_output_tokens=1
    )
    assert flush_memory_usage(entries={KEY: UsageCounts(shed=3) + batch}) == 1

    assert row() == TEN + UsageCounts(shed=3) + batch
    assert row(other) == TEN


def test_flush_memory_usage_skips_unknown_versions(
    team: Team, chat_v1: ModelVersion
) -> None:
    unknown = UsageKey("search", "chat-7b", "v9", MINUTE)
    assert flush_memory_usage(entries={KEY: TEN, unknown: TEN}) == 1
    assert Usage.objects.count() == 1


def test_flush_usage_task_flushes_redis(
    team: Team,
    chat_v1: ModelVersion,
    add: AddUsage,
    client: redis.Redis,
    prefix: str,
    settings: Settings,
    redis_url: str,
    django_capture_on_commit_callbacks: DjangoCaptureOnCommitCallbacks,
) -> None:
    settings.REDIS_URL = redis_url
    settings.REDIS_KEY_PREFIX = prefix
    key = UsageKey.from_time("search", "chat-7b", "v1", time.time() - 180)
    add(key, TEN)

    with django_capture_on_commit_callbacks(execute=True):
        result = flush_usage.apply()

    assert result.get() == 1
    assert row(key) == TEN
    assert indexed(client, prefix) == set()


def test_flush_usage_task_returns_zero_without_redis(settings: Settings) -> None:
    settings.REDIS_URL = ""
    assert flush_usage.apply().get() == 0
