"""One limit across regions: the tick over two regions' Redis and the control plane."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import redis
import redis.asyncio
from django.db import DatabaseError
from pytest_django import Settings

from accounts.models import RegionDemand
from control import region_limits, tasks
from routing.domain.region_shares import ShareOptions, shares_key
from routing.region_limits import RegionLimits

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 12, 5, 12, 0, 0, tzinfo=UTC)
OPTIONS = ShareOptions(window_s=30.0, slot_s=5.0, floor=0.05, stale_after_s=6.0)


@pytest.fixture
def prefixes(redis_url: str) -> Iterator[dict[str, str]]:
    """Two regions' Redis, as two prefixes of this test's own on one server."""
    run = uuid.uuid4().hex[:8]
    names = {region: f"rl-{run}-{region}" for region in ("east", "west")}
    yield names
    client = redis.Redis.from_url(redis_url)
    for prefix in names.values():
        keys = list(client.scan_iter(f"{prefix}:*"))
        if keys:
            client.delete(*keys)
    client.close()


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def gateway_sends(redis_url: str, prefix: str, at: datetime, **asked: int) -> float:
    """Note charges in a gateway of the region and exchange once; return a share."""

    async def run() -> float:
        async_client = redis.asyncio.Redis.from_url(redis_url)
        limits = RegionLimits(
            redis=async_client,
            prefix=prefix,
            slot_s=OPTIONS.slot_s,
            slot_ttl_s=40.0,
            clock=at.timestamp,
        )
        for key, tokens in asked.items():
            limits.note(key.replace("__", ":"), tokens)
        await limits.exchange()
        await async_client.aclose()
        return limits.share("a:chat")

    return asyncio.run(run())


def tick(
    client: redis.Redis, prefix: str, region: str, at: datetime
) -> dict[str, float]:
    return region_limits.share_region_limits(
        client=client, prefix=prefix, region=region, now=at, options=OPTIONS
    )


def test_tick_shares_follow_each_regions_demand(
    redis_url: str, client: redis.Redis, prefixes: dict[str, str]
) -> None:
    """GIVEN team a asking 3,000 tokens in east and 1,000 in west, and team b
    asking only in east, WHEN both regions tick, THEN each region's shares follow
    its part of the demand above the floor, and the gateways read them back."""
    gateway_sends(redis_url, prefixes["east"], T0, a__chat=3000, b__chat=500)
    gateway_sends(redis_url, prefixes["west"], T0, a__chat=1000)

    tick(client, prefixes["east"], "east", T0)
    west = tick(client, prefixes["west"], "west", T0 + timedelta(seconds=1))
    east = tick(client, prefixes["east"], "east", T0 + timedelta(seconds=2))

    assert east["a:chat"] == pytest.approx(0.05 + 0.9 * 0.75)
    assert west["a:chat"] == pytest.approx(0.05 + 0.9 * 0.25)
    assert east["b:chat"] == pytest.approx(0.95)  # a one-region team
    assert west["b:chat"] == pytest.approx(0.05)
    assert east["*"] == west["*"] == 0.5
    # What the gateways size buckets by, read back at their next exchange.
    at = T0 + timedelta(seconds=3)
    assert gateway_sends(redis_url, prefixes["east"], at) == pytest.approx(0.725)
    assert gateway_sends(redis_url, prefixes["west"], at) == pytest.approx(0.275)
    rows = RegionDemand.objects.filter(region="east").values_list(
        "limit_key", "demand_tokens"
    )
    assert sorted(rows) == [("", 0), ("a:chat", 3000), ("b:chat", 500)]


def test_tick_demand_window_forgets_old_slots(
    redis_url: str, client: redis.Redis, prefixes: dict[str, str]
) -> None:
    gateway_sends(redis_url, prefixes["east"], T0, a__chat=3000)
    gateway_sends(redis_url, prefixes["east"], T0 + timedelta(seconds=20), a__chat=7)

    demand = region_limits.read_region_demand(
        client,
        prefix=prefixes["east"],
        now=(T0 + timedelta(seconds=40)).timestamp(),
        window_s=30.0,
        slot_s=5.0,
    )

    assert demand == {"a:chat": 7}
    tick(client, prefixes["east"], "east", T0 + timedelta(seconds=60))
    assert list(RegionDemand.objects.values_list("limit_key", flat=True)) == [""]


def test_tick_gives_a_lost_regions_share_to_the_survivor(
    redis_url: str, client: redis.Redis, prefixes: dict[str, str]
) -> None:
    """GIVEN both regions ticking with demand, WHEN west stops publishing, THEN
    east takes the whole limit once west's figures are older than the bound."""
    gateway_sends(redis_url, prefixes["east"], T0, a__chat=1000)
    gateway_sends(redis_url, prefixes["west"], T0, a__chat=9000)
    tick(client, prefixes["west"], "west", T0)
    assert tick(client, prefixes["east"], "east", T0)["a:chat"] < 0.2

    still = tick(client, prefixes["east"], "east", T0 + timedelta(seconds=6))
    lost = tick(client, prefixes["east"], "east", T0 + timedelta(seconds=6.5))

    assert still["a:chat"] < 0.2
    assert lost == {"a:chat": 1.0, "*": 1.0}


def test_tick_keeps_the_last_shares_while_the_control_plane_is_down(
    redis_url: str,
    client: redis.Redis,
    prefixes: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gateway_sends(redis_url, prefixes["east"], T0, a__chat=1000)
    gateway_sends(redis_url, prefixes["west"], T0, a__chat=3000)
    tick(client, prefixes["west"], "west", T0)
    before = tick(client, prefixes["east"], "east", T0)

    def down(*args: object, **kwargs: object) -> None:
        raise DatabaseError("the control plane is down")

    monkeypatch.setattr(RegionDemand.objects, "bulk_create", down)
    with pytest.raises(DatabaseError):
        tick(client, prefixes["east"], "east", T0 + timedelta(seconds=30))

    stored = client.hgetall(shares_key(prefixes["east"]))
    assert {
        (k.decode() if isinstance(k, bytes) else k): float(v) for k, v in stored.items()
    } == before
    assert before["a:chat"] == pytest.approx(0.05 + 0.9 * 0.25)


def test_share_region_limits_task_runs_the_tick(
    redis_url: str, prefixes: dict[str, str], settings: Settings
) -> None:
    settings.REDIS_URL = redis_url
    settings.REDIS_KEY_PREFIX = prefixes["east"]
    settings.PLATFORM_REGION = "east"

    result = tasks.share_region_limits.apply()

    assert result.get() == 0
    assert list(RegionDemand.objects.values_list("region", "limit_key")) == [
        ("east", "")
    ]
