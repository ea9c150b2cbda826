"""The rollout figures in Redis and PostgreSQL: one script per request, several
gateway processes into one bucket, distinct conversations, an idempotent flush,
buckets forgotten once old, the guards' reads, and a Redis that fails."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
import redis.asyncio
from prometheus_client import REGISTRY
from pytest_django import DjangoCaptureOnCommitCallbacks, Settings

from metering.domain.figures import Role, VersionFigures, one_request
from metering.figures import (
    FIGURES_TTL_S,
    FigureKey,
    RedisFigureRecorder,
    figures_conversations_key,
    figures_hash_key,
    figures_index_key,
)
from metering.models import VersionFigure
from metering.services import (
    figure_buckets,
    flush_memory_figures,
    flush_redis_figures,
    version_figures,
)
from metering.tasks import flush_usage
from models_registry.models import Model

pytestmark = pytest.mark.django_db

BUCKET = 1_740_830_400  # 2025-03-01 12:00 UTC
CANARY = FigureKey("chat-7b", "v2", Role.CANARY, BUCKET, 60)
LIVE = FigureKey("chat-7b", "v1", Role.LIVE, BUCKET, 60)
OK = one_request(ttft_s=0.25, output_tokens=40)
REFUSED = one_request(ttft_s=0.1, output_tokens=9, refused=True)
BROKEN = one_request(ttft_s=0.3, output_tokens=None, error_kind="broken")
SOON = datetime.fromtimestamp(BUCKET + 30, tz=UTC)  # inside the bucket
LATER = datetime.fromtimestamp(BUCKET + 4 * 60, tz=UTC)  # three buckets on


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


Gateways = Callable[[Callable[[list[RedisFigureRecorder]], Awaitable[None]]], None]


@pytest.fixture
def gateways(redis_url: str, prefix: str) -> Gateways:
    """Return run(work): work(recorders) with two recorders, as two gateway
    processes would have (each its own connection pool)."""

    def run(work: Callable[[list[RedisFigureRecorder]], Awaitable[None]]) -> None:
        async def main() -> None:
            recorders = [
                RedisFigureRecorder(redis.asyncio.Redis.from_url(redis_url), prefix)
                for _ in range(2)
            ]
            try:
                await work(recorders)
            finally:
                for recorder in recorders:
                    await recorder.aclose()

        asyncio.run(main())

    return run


@pytest.fixture
def flush(
    client: redis.Redis,
    prefix: str,
    django_capture_on_commit_callbacks: DjangoCaptureOnCommitCallbacks,
) -> Callable[[datetime], int]:
    def flush(now: datetime) -> int:
        with django_capture_on_commit_callbacks(execute=True):
            return flush_redis_figures(
                client=client, prefix=prefix, region="us-east", now=now
            )

    return flush


def rows() -> list[dict[str, Any]]:
    columns = (
        "model_id",
        "version",
        "role",
        "region",
        "bucket_start",
        "bucket_s",
        "requests",
        "answered",
        "refusals",
        "output_tokens",
        "conversations",
        "errors",
        "ttft",
        "output",
    )
    ordered = VersionFigure.objects.order_by("version", "role")
    return [dict(row) for row in ordered.values(*columns)]


def indexed(client: redis.Redis, prefix: str) -> set[str]:
    members = client.smembers(figures_index_key(prefix))
    return {m.decode() if isinstance(m, bytes) else m for m in members}


def test_one_script_adds_fields_index_and_conversation(
    chat_model: Model, gateways: Gateways, client: redis.Redis, prefix: str
) -> None:
    async def work(recorders: list[RedisFigureRecorder]) -> None:
        await recorders[0].add(CANARY, OK, "conv-a")

    gateways(work)
    hash_key = figures_hash_key(prefix, CANARY)
    stored = {
        (k.decode() if isinstance(k, bytes) else k): int(v)
        for k, v in client.hgetall(hash_key).items()
    }
    assert VersionFigures.from_fields(stored) == OK
    assert indexed(client, prefix) == {hash_key}
    hll = figures_conversations_key(hash_key)
    assert client.pfcount(hll) == 1
    for key in (hash_key, hll):
        assert 0 < client.ttl(key) <= FIGURES_TTL_S


def test_two_gateways_add_into_one_bucket_conversations_distinct(
    chat_model: Model,
    gateways: Gateways,
    flush: Callable[[datetime], int],
) -> None:
    async def work(recorders: list[RedisFigureRecorder]) -> None:
        first, second = recorders
        await asyncio.gather(
            *(first.add(CANARY, OK, f"conv-{i}") for i in range(30)),
            *(second.add(CANARY, REFUSED, f"conv-{i}") for i in range(10, 40)),
            second.add(CANARY, BROKEN, None),
            first.add(LIVE, OK, "conv-1"),
        )

    gateways(work)
    assert flush(SOON) == 2
    canary = version_figures(
        model_id="chat-7b", version="v2", role=Role.CANARY, since=SOON
    )
    expected = VersionFigures()
    for figures in [OK] * 30 + [REFUSED] * 30 + [BROKEN]:
        expected = expected + figures
    assert canary == expected + VersionFigures(conversations=40)
    assert canary.refusal_rate == pytest.approx(0.5)
    assert canary.errors == {"broken": 1}
    live = version_figures(model_id="chat-7b", version="v1", role=Role.LIVE, since=SOON)
    assert live == OK + VersionFigures(conversations=1)


def test_flush_twice_writes_the_same_rows_and_later_adds_overwrite(
    chat_model: Model,
    gateways: Gateways,
    flush: Callable[[datetime], int],
) -> None:
    async def add_one(recorders: list[RedisFigureRecorder]) -> None:
        await recorders[0].add(CANARY, OK, "conv-a")

    gateways(add_one)
    flush(SOON)
    first = rows()
    flush(SOON)
    assert rows() == first
    gateways(add_one)  # a second request, same conversation
    flush(SOON)
    (row,) = rows()
    assert (row["requests"], row["conversations"]) == (2, 1)
    assert row["region"] == "us-east"
    assert row["bucket_start"] == CANARY.bucket_start


def test_old_buckets_leave_the_index_and_late_figures_return(
    chat_model: Model,
    gateways: Gateways,
    flush: Callable[[datetime], int],
    client: redis.Redis,
    prefix: str,
) -> None:
    async def add_one(recorders: list[RedisFigureRecorder]) -> None:
        await recorders[0].add(CANARY, OK, "conv-a")

    gateways(add_one)
    hash_key = figures_hash_key(prefix, CANARY)
    # Two buckets after its end the bucket is still listed (late adds welcome).
    flush(datetime.fromtimestamp(BUCKET + 60 + 120, tz=UTC))
    assert indexed(client, prefix) == {hash_key}
    flush(LATER)
    assert indexed(client, prefix) == set()
    assert 0 < client.ttl(hash_key) <= 3600
    # A late add lists it again, and the next flush writes the full totals.
    gateways(add_one)
    assert indexed(client, prefix) == {hash_key}
    flush(LATER)
    (row,) = rows()
    assert row["requests"] == 2


def test_unknown_models_and_malformed_members_are_dropped(
    chat_model: Model,
    gateways: Gateways,
    flush: Callable[[datetime], int],
    client: redis.Redis,
    prefix: str,
) -> None:
    unknown = FigureKey("gone-7b", "v1", Role.LIVE, BUCKET, 60)

    async def work(recorders: list[RedisFigureRecorder]) -> None:
        await recorders[0].add(unknown, OK, "c")
        await recorders[0].add(CANARY, OK, "c")

    gateways(work)
    client.sadd(figures_index_key(prefix), f"{prefix}:figures:bogus")
    assert flush(SOON) == 1
    assert indexed(client, prefix) == {figures_hash_key(prefix, CANARY)}
    assert not client.exists(figures_hash_key(prefix, unknown))


def test_version_figures_floors_since_and_stops_before_until(
    chat_model: Model, gateways: Gateways, flush: Callable[[datetime], int]
) -> None:
    keys = [
        FigureKey("chat-7b", "v2", Role.CANARY, BUCKET + i * 60, 60) for i in range(3)
    ]

    async def work(recorders: list[RedisFigureRecorder]) -> None:
        for i, key in enumerate(keys):
            for _ in range(i + 1):
                await recorders[i % 2].add(key, OK, f"conv-{i}")

    gateways(work)
    flush(LATER)

    def total(since: int, until: int | None = None) -> int:
        return version_figures(
            model_id="chat-7b",
            version="v2",
            role=Role.CANARY,
            since=datetime.fromtimestamp(since, tz=UTC),
            until=datetime.fromtimestamp(until, tz=UTC) if until else None,
        ).requests

    assert total(BUCKET) == 6
    assert total(BUCKET + 59) == 6  # floored to the first bucket
    assert total(BUCKET + 60) == 5
    assert total(BUCKET, until=BUCKET + 120) == 3
    assert total(BUCKET + 181) == 0
    assert (
        version_figures(
            model_id="chat-7b",
            version="v2",
            role=Role.LIVE,
            since=datetime.fromtimestamp(BUCKET, tz=UTC),
        )
        == VersionFigures()
    )
    buckets = figure_buckets(
        model_id="chat-7b",
        version="v2",
        role=Role.CANARY,
        since=datetime.fromtimestamp(BUCKET, tz=UTC),
    )
    assert [(at.timestamp(), f.requests, f.conversations) for at, f in buckets] == [
        (BUCKET, 1, 1),
        (BUCKET + 60, 2, 1),
        (BUCKET + 120, 3, 1),
    ]


def test_reads_sum_regions(chat_model: Model) -> None:
    for region in ("us-east", "eu-west"):
        flush_memory_figures(entries={CANARY: OK + OK}, region=region)
    since = datetime.fromtimestamp(BUCKET, tz=UTC)
    figures = version_figures(
        model_id="chat-7b", version="v2", role=Role.CANARY, since=since
    )
    assert figures.requests == 4
    ((at, per_bucket),) = figure_buckets(
        model_id="chat-7b", version="v2", role=Role.CANARY, since=since
    )
    assert (at, per_bucket.requests) == (CANARY.bucket_start, 4)


def test_flush_memory_figures_adds_and_skips_unknown_models(chat_model: Model) -> None:
    unknown = FigureKey("gone-7b", "v1", Role.LIVE, BUCKET, 60)
    first = OK + VersionFigures(conversations=1)
    assert flush_memory_figures(entries={CANARY: first, unknown: OK}, region="e") == 1
    assert flush_memory_figures(entries={CANARY: BROKEN}, region="e") == 1
    figures = version_figures(
        model_id="chat-7b",
        version="v2",
        role=Role.CANARY,
        since=datetime.fromtimestamp(BUCKET, tz=UTC),
    )
    assert figures == first + BROKEN


def _dropped() -> float:
    return (
        REGISTRY.get_sample_value("platform_figures_dropped_total", {"reason": "redis"})
        or 0.0
    )


def test_a_failing_redis_drops_figures_counts_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]

    async def main() -> None:
        # Nothing listens on port 1: every call fails at once.
        client = redis.asyncio.Redis.from_url(
            "redis://127.0.0.1:1/0", socket_connect_timeout=0.5
        )
        recorder = RedisFigureRecorder(client, "p", clock=lambda: now[0])
        try:
            for _ in range(3):
                await recorder.add(CANARY, OK, "c")  # never raises
            now[0] += 2.0  # past the pause: it tries Redis again, and fails
            await recorder.add(CANARY, OK, "c")
        finally:
            await recorder.aclose()

    before = _dropped()
    with caplog.at_level(logging.WARNING, logger="metering.figures"):
        asyncio.run(main())
    assert _dropped() - before == 4
    warnings = [r for r in caplog.records if "figures are dropped" in r.message]
    assert len(warnings) == 1


def test_flush_usage_task_flushes_figures_too(
    chat_model: Model,
    gateways: Gateways,
    redis_url: str,
    prefix: str,
    settings: Settings,
    django_capture_on_commit_callbacks: DjangoCaptureOnCommitCallbacks,
) -> None:
    settings.REDIS_URL = redis_url
    settings.REDIS_KEY_PREFIX = prefix
    settings.PLATFORM_REGION = "task-region"
    key = FigureKey.from_time(
        "chat-7b", "v1", Role.LIVE, datetime.now(tz=UTC).timestamp(), 60
    )

    async def work(recorders: list[RedisFigureRecorder]) -> None:
        await recorders[0].add(key, OK, "c")

    gateways(work)
    with django_capture_on_commit_callbacks(execute=True):
        flush_usage.apply()
    (row,) = rows()
    assert (row["region"], row["requests"]) == ("task-region", 1)
    recent = datetime.now(tz=UTC) - timedelta(minutes=2)
    assert (
        version_figures(
            model_id="chat-7b", version="v1", role=Role.LIVE, since=recent
        ).requests
        == 1
    )
