"""A pool's live figures in ``GET /admin/pools/{model}/state``: per pool and
region, always there, from the gateways' role ``pool`` figures and live-load
shares."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
import redis
from django.utils import timezone
from prometheus_client import REGISTRY
from pytest_django import Settings
from rest_framework.test import APIClient

from engine_nodes.domain.load_shares import (
    gateway_load_key,
    gateways_seen_key,
    queue_depth_key,
)
from metering.domain.figures import Role, VersionFigures, one_request
from metering.models import VersionFigure
from metering.services import _figure_columns
from models_registry.models import ModelVersion, Pool
from tests.factories import ReplicaFactory

pytestmark = pytest.mark.django_db


def answers(count: int, *, ttft_s: float, prompt: int, cached: int) -> VersionFigures:
    total = VersionFigures()
    for _ in range(count):
        total = total + one_request(
            ttft_s=ttft_s,
            output_tokens=10,
            prompt_tokens=prompt,
            cached_tokens=cached,
            tpot_s=0.02,
        )
    return total


def write(
    version: ModelVersion,
    region: str,
    figures: VersionFigures,
    *,
    role: Role = Role.POOL,
    at: datetime | None = None,
) -> None:
    start = (at or timezone.now()).replace(second=0, microsecond=0)
    VersionFigure.objects.create(
        model=version.model,
        version=version.version,
        role=role,
        region=region,
        bucket_start=start,
        bucket_s=60,
        **_figure_columns(figures),
    )


@pytest.fixture
def pools(chat_v1: ModelVersion) -> list[Pool]:
    return [
        Pool.objects.create(
            model=chat_v1.model, version=chat_v1, region=region, max_replicas=4
        )
        for region in ("eu", "us")
    ]


def entry(data: dict[str, Any], region: str) -> dict[str, Any]:
    [found] = [p for p in data["pools"] if p["region"] == region]
    return found


def test_each_pool_has_its_own_figures_without_a_rollout(
    admin_client: APIClient, chat_v1: ModelVersion, pools: list[Pool]
) -> None:
    write(chat_v1, "eu", answers(20, ttft_s=0.1, prompt=100, cached=50))
    write(chat_v1, "us", answers(20, ttft_s=0.8, prompt=100, cached=90))

    data = admin_client.get("/admin/pools/chat-7b/state").json()

    eu, us = entry(data, "eu"), entry(data, "us")
    assert (eu["requests"], us["requests"]) == (20, 20)
    assert eu["prefix_hit_rate"] == pytest.approx(0.5)
    assert us["prefix_hit_rate"] == pytest.approx(0.9)
    assert 100 <= eu["ttft_p95_ms"] <= 110 and 800 <= us["ttft_p95_ms"] <= 880
    assert eu["ttft_p99_ms"] == eu["ttft_p95_ms"]
    assert 20 <= eu["tpot_p50_ms"] <= 22 and 20 <= eu["tpot_p95_ms"] <= 22
    # The model's hit rate sums its pools.
    assert data["prefix_hit_rate"] == pytest.approx(0.7)


def test_region_narrows_the_pools_and_the_models_hit_rate(
    admin_client: APIClient, chat_v1: ModelVersion, pools: list[Pool]
) -> None:
    write(chat_v1, "eu", answers(4, ttft_s=0.1, prompt=100, cached=50))
    write(chat_v1, "us", answers(4, ttft_s=0.8, prompt=100, cached=90))

    data = admin_client.get("/admin/pools/chat-7b/state?region=us").json()

    assert data["region"] == "us"
    assert [p["region"] for p in data["pools"]] == ["us"]
    assert data["prefix_hit_rate"] == pytest.approx(0.9)


@pytest.mark.parametrize("region", ["US", "us east", "-us", "a" * 65, ""])
def test_a_malformed_region_is_a_400_in_openais_shape(
    admin_client: APIClient, pools: list[Pool], region: str
) -> None:
    response = admin_client.get("/admin/pools/chat-7b/state", {"region": region})

    assert response.status_code == 400
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"type", "message", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == "region"


def test_an_idle_pool_shows_no_figures_and_old_buckets_leave(
    admin_client: APIClient, chat_v1: ModelVersion, pools: list[Pool]
) -> None:
    write(
        chat_v1,
        "eu",
        answers(3, ttft_s=0.1, prompt=10, cached=5),
        at=timezone.now() - timedelta(minutes=30),
    )
    # The guards' figures are no pool's: a canary row changes nothing here.
    write(chat_v1, "eu", answers(3, ttft_s=0.1, prompt=10, cached=5), role=Role.LIVE)

    eu = entry(admin_client.get("/admin/pools/chat-7b/state").json(), "eu")

    assert eu["requests"] == 0
    assert eu["ttft_p95_ms"] is None and eu["prefix_hit_rate"] is None
    assert eu["usd_per_million_tokens"] is None


def test_usd_per_million_prices_the_gpus_held_over_the_tokens_served(
    admin_client: APIClient,
    chat_v1: ModelVersion,
    pools: list[Pool],
    settings: Settings,
) -> None:
    settings.PLATFORM_GPU_HOUR_USD_BY_REGION = {"eu": 3.0}
    ReplicaFactory(version=chat_v1, region="eu", last_heartbeat=timezone.now())
    # 10 requests of 100 prompt and 10 output tokens: 1,100 tokens in 5 minutes.
    write(chat_v1, "eu", answers(10, ttft_s=0.1, prompt=100, cached=0))

    eu = entry(admin_client.get("/admin/pools/chat-7b/state").json(), "eu")

    hourly = 3.0 * chat_v1.gpus_per_replica
    assert eu["usd_per_million_tokens"] == pytest.approx(
        hourly * 300 / 3600 / 1100 * 1e6, rel=1e-3
    )


@pytest.fixture
def shares(settings: Settings, redis_url: str) -> Iterator[redis.Redis]:
    """This region's Redis under a prefix of its own, emptied afterwards (the
    routers' figures live there only: without Redis the test is skipped)."""
    settings.REDIS_URL = redis_url
    settings.REDIS_KEY_PREFIX = f"test-{secrets.token_hex(4)}"
    settings.PLATFORM_REGION = "eu"
    client = redis.Redis.from_url(redis_url)
    yield client
    keys = client.keys(f"{settings.REDIS_KEY_PREFIX}:*")
    if keys:
        client.delete(*keys)
    client.close()


def test_router_figures_are_the_gateways_shares_of_this_region(
    admin_client: APIClient,
    chat_v1: ModelVersion,
    pools: list[Pool],
    shares: redis.Redis,
    settings: Settings,
) -> None:
    now = timezone.now()
    r1, r2 = "chat-v1-eu-1", "chat-v1-eu-2"
    ReplicaFactory(version=chat_v1, region="eu", replica_id=r1, last_heartbeat=now)
    ReplicaFactory(
        version=chat_v1,
        region="eu",
        replica_id=r2,
        last_heartbeat=now,
        tokens_in_flight=99_999,
    )
    prefix = settings.REDIS_KEY_PREFIX
    gateways: tuple[tuple[str, dict[str, int]], ...] = (
        ("g1", {r1: 1_000, r2: 500}),
        ("g2", {r1: 250, queue_depth_key("chat-7b", chat_v1.version): 3}),
    )
    for gateway, share in gateways:
        for field, value in share.items():
            shares.hset(gateway_load_key(prefix, "eu", gateway), field, value)
        shares.zadd(gateways_seen_key(prefix, "eu"), {gateway: now.timestamp()})

    data = admin_client.get("/admin/pools/chat-7b/state").json()

    eu, us = entry(data, "eu"), entry(data, "us")
    # The routers' count (prompt plus remaining output), not the replicas' KV.
    assert eu["router_tokens_in_flight"] == 1_750
    assert eu["router_queue_depth"] == 3
    assert eu["router_utilisation"] == pytest.approx(
        1_750 / eu["capacity_tokens_in_flight"]
    )
    # Another region's gateways publish to its own Redis: not read here.
    assert us["router_tokens_in_flight"] is None
    assert us["router_utilisation"] is None


def test_metrics_export_the_figures_the_pool_state_shows(
    admin_client: APIClient,
    chat_v1: ModelVersion,
    pools: list[Pool],
    settings: Settings,
) -> None:
    settings.PLATFORM_REGION = "eu"
    write(chat_v1, "eu", answers(20, ttft_s=0.1, prompt=100, cached=50))
    write(chat_v1, "us", answers(20, ttft_s=0.8, prompt=100, cached=90))
    eu = entry(admin_client.get("/admin/pools/chat-7b/state").json(), "eu")

    def sample(name: str) -> float | None:
        labels = {"model": "chat-7b", "version": chat_v1.version, "region": "eu"}
        return REGISTRY.get_sample_value(name, labels)

    assert sample("platform_pool_live_requests") == 20
    assert sample("platform_pool_ttft_p95_seconds") == pytest.approx(
        eu["ttft_p95_ms"] / 1000
    )
    assert sample("platform_pool_tpot_p50_seconds") == pytest.approx(
        eu["tpot_p50_ms"] / 1000
    )
    assert sample("platform_pool_prefix_hit_rate") == pytest.approx(0.5)
    # This process's region only: us's pool is its own region's to export.
    assert (
        REGISTRY.get_sample_value(
            "platform_pool_live_requests",
            {"model": "chat-7b", "version": chat_v1.version, "region": "us"},
        )
        is None
    )


def test_the_schema_names_the_region_parameter_the_400_and_the_figures(
    admin_client: APIClient,
) -> None:
    schema = json.loads(admin_client.get("/admin/schema").content)
    get = schema["paths"]["/admin/pools/{model}/state"]["get"]

    [region] = [p for p in get["parameters"] if p["name"] == "region"]
    assert region["in"] == "query" and "pattern" in region["schema"]
    assert "400" in get["responses"]
    state = schema["components"]["schemas"]["PoolState"]["properties"]
    assert state["pools"]["items"]["$ref"].endswith("/PoolStateEntry")
    entry = schema["components"]["schemas"]["PoolStateEntry"]["properties"]
    for name in (
        "requests",
        "ttft_p95_ms",
        "ttft_p99_ms",
        "tpot_p50_ms",
        "tpot_p95_ms",
        "prefix_hit_rate",
        "usd_per_million_tokens",
        "router_tokens_in_flight",
        "router_queue_depth",
        "router_utilisation",
    ):
        assert name in entry, name
