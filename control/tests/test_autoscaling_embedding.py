"""The live autoscaler on an embedding pool: sized on the input tokens/s the
gateways admit (their cumulative counts in Redis), on an injected clock; the pool
state and ``/metrics`` show its kind and its capacity in input tokens/s."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import redis
import time_machine
from django.test import Client
from prometheus_client import REGISTRY
from pytest_django import Settings
from redis.typing import EncodableT, FieldT

from control import autoscaling
from control.pool_costs import pool_cost_figures
from engine_nodes.domain.load_shares import (
    admitted_key,
    gateway_load_key,
    gateways_seen_key,
    pool_key,
)
from engine_nodes.models import Replica, ScalingDecision
from models_registry import services as registry_services
from models_registry.models import ModelVersion, Pool
from tests.factories import VERSION_BODY, ReplicaFactory, accept, digest, version_body

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
REGION = "eu"
MODEL = "embed-1"
TOKENS_PER_S = 10_000.0  # one replica's measured input tokens/s
IN_FLIGHT = 400


def plenty(region: str, *, now: datetime, gpus_per_replica: int) -> int:
    return 10**6


@pytest.fixture(autouse=True)
def beats(settings: Settings) -> None:
    settings.PLATFORM_HEARTBEAT_S = 1.0
    settings.PLATFORM_HEARTBEAT_DB_S = 1.0
    settings.PLATFORM_MISSED_BEATS = 3
    settings.PLATFORM_REGION = REGION


@pytest.fixture
def embed_v1(db: None) -> ModelVersion:
    """embed-1@v1, an embedding model's version accepted as ready, unmeasured."""
    registry_services.create_model(
        model_id=MODEL, kind="embedding", dimensions=384, max_input_tokens=512
    )
    body = version_body(
        weights_uri="s3://models/embed-1/",
        weights_hash=digest("embed weights"),
        engine_config={**VERSION_BODY["engine_config"], "runner": "pooling"},
    )
    return accept(registry_services.register_version(model_id=MODEL, **body))


@pytest.fixture
def measured(embed_v1: ModelVersion) -> ModelVersion:
    ModelVersion.objects.filter(pk=embed_v1.pk).update(
        load_test_tokens_per_s=TOKENS_PER_S, load_test_tokens_in_flight=IN_FLIGHT
    )
    embed_v1.refresh_from_db()
    return embed_v1


def make_pool(version: ModelVersion, *, serving: int) -> Pool:
    pool = Pool.objects.create(
        model=version.model,
        version=version,
        region=REGION,
        min_replicas=1,
        max_replicas=10,
        desired_replicas=serving,
        stable_window_s=60.0,
        panic_window_s=6.0,
        scale_down_interval_s=30.0,
    )
    for _ in range(serving):
        ReplicaFactory.create(version=version, region=REGION, last_heartbeat=T0)
    return pool


@pytest.fixture
def shares(redis_url: str, settings: Settings) -> Iterator[redis.Redis]:
    settings.REDIS_KEY_PREFIX = f"emb-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_url)
    yield client
    keys = list(client.scan_iter(f"{settings.REDIS_KEY_PREFIX}:*"))
    if keys:
        client.delete(*keys)
    client.close()


def publish(client: redis.Redis, gateway_id: str, share: dict[str, int]) -> None:
    """Write a gateway process's share as ``routing.live.LiveLoad`` does."""
    from django.conf import settings

    prefix = settings.REDIS_KEY_PREFIX
    client.zadd(gateways_seen_key(prefix, REGION), {gateway_id: T0.timestamp()})
    key = gateway_load_key(prefix, REGION, gateway_id)
    fields: dict[FieldT, EncodableT] = dict(share.items())
    client.delete(key)
    client.hset(key, mapping=fields)


def tick(at: datetime, client: redis.Redis | None) -> autoscaling.TickResult:
    Replica.objects.update(last_heartbeat=at)
    [result] = autoscaling.autoscale_region(
        region=REGION, now=at, redis_client=client, free_gpus=plenty
    )
    return result


def test_tick_sizes_an_embedding_pool_on_the_input_tokens_per_s_admitted(
    measured: ModelVersion, shares: redis.Redis
) -> None:
    """GIVEN one replica sustaining 10,000 input tokens/s and two gateway processes
    WHEN they admit 30,000 input tokens/s between two ticks 10 s apart (the short
    window, 6 s, then holds the second tick alone)
    THEN the pool goes to ceil(30,000 / 7,000) = 5 replicas, in one decision, and a
    snapshot of tokens in flight plays no part once the rate is measured.
    """
    pool = make_pool(measured, serving=1)
    v1 = (MODEL, "v1")
    publish(shares, "gw-1", {admitted_key(*v1): 1_000_000, pool_key(*v1): 1})
    publish(shares, "gw-2", {admitted_key(*v1): 20_000})
    first = tick(T0, shares)
    # The first reading has nothing to measure against: 1 token in flight x
    # (10,000 / 400) stands in, and holds.
    assert (first.decision.desired, first.written) == (1, False)

    publish(shares, "gw-1", {admitted_key(*v1): 1_200_000, pool_key(*v1): 10**6})
    publish(shares, "gw-2", {admitted_key(*v1): 120_000})
    second = tick(T0 + timedelta(seconds=10), shares)

    signals = second.decision.signals
    assert signals["admitted_tokens_per_s"] == 30_000
    assert signals["replica_tokens_per_s"] == TOKENS_PER_S
    assert second.written and second.decision.desired == 5
    row = ScalingDecision.objects.get(pool=pool)
    assert (row.from_replicas, row.to_replicas, row.reason) == (1, 5, "panic")
    assert not row.capacity_is_assumed
    assert Pool.objects.get(pk=pool.pk).desired_replicas == 5


def test_tick_scales_an_embedding_pool_down_when_the_load_stops(
    measured: ModelVersion, shares: redis.Redis
) -> None:
    pool = make_pool(measured, serving=3)
    v1 = (MODEL, "v1")
    count = 500_000
    sizes = []
    for n in range(40):  # 200 s of ticks with nothing admitted
        publish(shares, "gw-1", {admitted_key(*v1): count})
        result = tick(T0 + timedelta(seconds=5 * n), shares)
        if result.written:
            sizes.append((5 * n, result.decision.desired))
            # The agent drains one: the next tick counts one fewer.
            leaving = Replica.objects.filter(region=REGION).order_by("pk").first()
            assert leaving is not None
            leaving.delete()
    assert [size for _, size in sizes] == [2, 1]
    assert sizes[0][0] >= 60  # a full quiet stable window first
    assert sizes[1][0] - sizes[0][0] >= 30  # then one per interval
    assert Pool.objects.get(pk=pool.pk).desired_replicas == 1


def test_an_unmeasured_embedding_pool_is_sized_on_the_default_and_says_so(
    embed_v1: ModelVersion, settings: Settings
) -> None:
    """Without Redis the tokens in flight the replicas beat stand in, at the
    default's ratio; the state warns that capacity is assumed, in tokens/s."""
    settings.PLATFORM_DEFAULT_EMBEDDING_REPLICA_TOKENS_PER_S = 5_000.0
    settings.PLATFORM_DEFAULT_REPLICA_TOKENS_IN_FLIGHT = 1_000
    make_pool(embed_v1, serving=1)
    Replica.objects.update(tokens_in_flight=2_000)  # 10,000 input tokens/s

    result = tick(T0, None)

    assert result.decision.signals["admitted_tokens_per_s"] == 10_000
    assert result.decision.desired == 3  # ceil(10,000 / 3,500)
    assert result.decision.capacity_is_assumed
    [entry] = autoscaling.pool_state(model_id=MODEL, now=T0, region=REGION)["pools"]
    assert entry["kind"] == "embedding"
    assert entry["replica_tokens_per_s"] == 5_000.0
    assert entry["capacity_tokens_per_s"] == 5_000.0  # one serving replica
    assert entry["admitted_tokens_per_s"] == 10_000
    assert entry["capacity_is_assumed"]
    assert any("5000 input tokens/s" in w for w in entry["warnings"])


def test_pool_state_of_a_chat_pool_has_no_input_rate(chat_v1: ModelVersion) -> None:
    Pool.objects.create(model=chat_v1.model, version=chat_v1, region=REGION)
    [entry] = autoscaling.pool_state(model_id="chat-7b", now=T0, region=REGION)["pools"]
    assert entry["kind"] == "chat"
    assert entry["replica_tokens_per_s"] is None
    assert entry["capacity_tokens_per_s"] is None


def test_metrics_show_an_embedding_pools_kind_and_input_capacity(
    measured: ModelVersion, chat_v1: ModelVersion, settings: Settings
) -> None:
    settings.PLATFORM_METRICS_TOKEN = "scrape-secret"
    make_pool(measured, serving=2)
    Pool.objects.create(model=chat_v1.model, version=chat_v1, region=REGION)
    embed = {"model": MODEL, "version": "v1", "region": REGION}
    chat = {"model": "chat-7b", "version": "v1", "region": REGION}

    with time_machine.travel(T0 + timedelta(seconds=1), tick=False):
        value = REGISTRY.get_sample_value
        assert value("platform_pool_info", {**embed, "kind": "embedding"}) == 1
        assert value("platform_pool_info", {**chat, "kind": "chat"}) == 1
        assert value("platform_pool_capacity_input_tokens_per_s", embed) == 20_000
        assert value("platform_pool_capacity_input_tokens_per_s", chat) is None
        response = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-secret")
    text = response.content.decode()
    assert (
        'platform_pool_info{kind="embedding",model="embed-1",region="eu",'
        'version="v1"} 1.0'
    ) in text


def test_cost_at_full_of_an_unmeasured_embedding_pool_uses_its_default(
    embed_v1: ModelVersion, chat_v1: ModelVersion, settings: Settings
) -> None:
    settings.PLATFORM_DEFAULT_EMBEDDING_REPLICA_TOKENS_PER_S = 40_000.0
    settings.PLATFORM_ASSUMED_TOKENS_PER_S = 2_500.0
    make_pool(embed_v1, serving=1)
    Pool.objects.create(model=chat_v1.model, version=chat_v1, region=REGION)
    figures = {f.model: f for f in pool_cost_figures(region=REGION, now=T0)}
    # The same GPU: 16 x the tokens/s, a sixteenth of the price per million.
    assert figures[MODEL].usd_per_million_tokens_at_full == pytest.approx(
        figures["chat-7b"].usd_per_million_tokens_at_full / 16
    )
