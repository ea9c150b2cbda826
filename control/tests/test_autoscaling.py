"""The live autoscaler: its tick on real rows and a real Redis, on an injected clock."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import redis
import time_machine
from django.db import models
from pytest_django import Settings
from redis.typing import EncodableT, FieldT

from control import autoscaling, tasks
from engine_nodes import services
from engine_nodes.domain.load_shares import (
    gateway_load_key,
    gateways_seen_key,
    pool_key,
    queue_depth_key,
    queue_tokens_key,
)
from engine_nodes.models import Replica, ScalingDecision
from models_registry import services as registry_services
from models_registry.domain.autoscaler import ScalingSettings
from models_registry.models import SCALING_FIELDS, ModelVersion, Pool, PoolSchedule
from tests.factories import ReplicaFactory, digest, version_body

pytestmark = pytest.mark.django_db

# Monday 2026-11-30 12:00 UTC.
T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
PER_REPLICA = 100_000
REGION = "eu"


def plenty(region: str, *, now: datetime, gpus_per_replica: int) -> int:
    """Free GPUs of a region with room for anything."""
    return 10**6


def none_free(region: str, *, now: datetime, gpus_per_replica: int) -> int:
    return 0


@pytest.fixture(autouse=True)
def beats(settings: Settings) -> None:
    settings.PLATFORM_HEARTBEAT_S = 1.0
    settings.PLATFORM_HEARTBEAT_DB_S = 1.0
    settings.PLATFORM_MISSED_BEATS = 3
    settings.PLATFORM_AUTOSCALE_DECISIONS_KEPT = 1000


@pytest.fixture
def measured(chat_v1: ModelVersion) -> ModelVersion:
    """chat-7b@v1 with a load test: each replica carries 100,000 tokens in flight."""
    ModelVersion.objects.filter(pk=chat_v1.pk).update(
        load_test_tokens_per_s=2500.0, load_test_tokens_in_flight=PER_REPLICA
    )
    chat_v1.refresh_from_db()
    return chat_v1


@pytest.fixture
def pool(measured: ModelVersion) -> Pool:
    """chat-7b@v1 in eu: 1 to 10 replicas, 2 wanted."""
    return Pool.objects.create(
        model=measured.model,
        version=measured,
        region=REGION,
        min_replicas=1,
        max_replicas=10,
        desired_replicas=2,
    )


def serving(version: ModelVersion, n: int, *, tokens: int = 0, queue: int = 0) -> None:
    """Add ``n`` serving replicas, each reporting ``tokens`` in flight at T0."""
    for _ in range(n):
        ReplicaFactory.create(
            version=version,
            region=REGION,
            last_heartbeat=T0,
            tokens_in_flight=tokens,
            queue_depth=queue,
        )


def tick(
    at: datetime,
    *,
    client: redis.Redis | None = None,
    free_gpus: autoscaling.FreeGpus = plenty,
) -> list[autoscaling.TickResult]:
    # The replicas beat on: their rows are fresh at every tick.
    Replica.objects.update(last_heartbeat=at)
    return autoscaling.autoscale_region(
        region=REGION, now=at, redis_client=client, free_gpus=free_gpus
    )


def reloaded(pool: Pool) -> Pool:
    return Pool.objects.get(pk=pool.pk)


def test_pool_defaults_are_the_policys() -> None:
    policy = ScalingSettings()
    for name in SCALING_FIELDS:
        if name in ("min_replicas", "max_replicas"):
            continue
        field = Pool._meta.get_field(name)
        assert isinstance(field, models.Field)
        assert field.default == getattr(policy, name), name


def test_tick_scales_up_at_once_and_writes_one_row_per_change(pool: Pool) -> None:
    """GIVEN 2 serving replicas carrying 90,000 tokens each (90% of capacity)
    WHEN the autoscaler ticks, and again while the new replica starts
    THEN the first tick asks for 3 (180,000 under 70% of 3 replicas) with a row
    saying why, and the next ticks change nothing and write no row.
    """
    serving(pool.version, 2, tokens=90_000)

    [first] = tick(T0)
    assert first.written
    assert reloaded(pool).desired_replicas == 3
    row = ScalingDecision.objects.get()
    assert (row.from_replicas, row.to_replicas, row.reason) == (2, 3, "utilisation")
    assert row.region == REGION and row.decided_at == T0
    assert row.signals["tokens_in_flight"] == 180_000
    assert row.signals["replica_tokens_in_flight"] == PER_REPLICA
    assert row.utilisation == pytest.approx(0.9)
    assert not row.capacity_is_assumed

    # The agent has not started it yet: the same wish is no new change.
    [second] = tick(T0 + timedelta(seconds=5))
    assert not second.written
    ReplicaFactory.create(version=pool.version, region=REGION, state="starting")
    [third] = tick(T0 + timedelta(seconds=10))
    assert not third.written
    assert ScalingDecision.objects.count() == 1
    assert reloaded(pool).desired_replicas == 3


def test_tick_never_undoes_a_larger_scale_up_the_agents_have_not_started(
    pool: Pool,
) -> None:
    """GIVEN a pool that asked for 6 replicas, of which the agents have written
    only 2 rows (serving, 90% full)
    WHEN the autoscaler ticks: the 2 it counts alone would ask for 3
    THEN the 6 stand and no row is written; a scale-up past 6 still is.
    """
    Pool.objects.filter(pk=pool.pk).update(desired_replicas=6)
    serving(pool.version, 2, tokens=90_000)

    [result] = tick(T0)

    assert result.decision.desired == 3 and not result.written
    assert reloaded(pool).desired_replicas == 6
    assert not ScalingDecision.objects.exists()
    Replica.objects.update(tokens_in_flight=300_000)  # 600,000: 9 replicas
    [more] = tick(T0 + timedelta(seconds=10))
    assert more.written and reloaded(pool).desired_replicas == 9


def test_tick_scales_down_one_replica_after_a_quiet_stable_window(pool: Pool) -> None:
    """GIVEN 3 serving replicas nearly idle
    WHEN the autoscaler ticks every 5 s, each tick a new call (as after a restart)
    THEN it removes one replica once the 60 s stable window is full of quiet, and
    no other before the 600 s scale-down interval: its windows live in the pool row.
    """
    Pool.objects.filter(pk=pool.pk).update(desired_replicas=3)
    serving(pool.version, 3, tokens=5_000)

    for seconds in range(0, 60, 5):
        [result] = tick(T0 + timedelta(seconds=seconds))
        assert not result.written, seconds
    [down] = tick(T0 + timedelta(seconds=60))
    assert down.written
    assert reloaded(pool).desired_replicas == 2
    row = ScalingDecision.objects.get()
    assert (row.from_replicas, row.to_replicas, row.reason) == (3, 2, "scale_down")

    # The agent drains one; the next scale-down waits for its interval.
    first = Replica.objects.order_by("pk").first()
    assert first is not None
    Replica.objects.filter(pk=first.pk).update(state="draining")
    for seconds in range(65, 600, 60):
        [result] = tick(T0 + timedelta(seconds=seconds))
        assert not result.written, seconds
    [again] = tick(T0 + timedelta(seconds=665))
    assert again.written and reloaded(pool).desired_replicas == 1


def test_tick_sizes_the_warm_pool_from_the_demands_trend(pool: Pool) -> None:
    """GIVEN a pool that keeps 1 to 4 warm nodes, its 2 replicas' load climbing
    by 300 tokens in flight a second each
    WHEN the autoscaler ticks every 5 s for 4 minutes, each tick a new call
    THEN the trend lives in the pool row between ticks, and the warm target
    rises from the minimum with it; a flat pool keeps the minimum.
    """
    Pool.objects.filter(pk=pool.pk).update(warm_nodes_min=1, warm_nodes_max=4)
    serving(pool.version, 2, tokens=20_000)

    targets = []
    for seconds in range(0, 240, 5):
        Replica.objects.update(tokens_in_flight=20_000 + 300 * seconds)
        tick(T0 + timedelta(seconds=seconds))
        last = reloaded(pool).last_tick()
        targets.append(last["warm_nodes"])
    assert targets[0] == 1
    assert targets[-1] > 1
    # The slope follows with a 3-minute time constant (half the horizon): after
    # 4 minutes it has most of the true 600 tokens/s, and never overshoots it.
    assert 300 < last["signals"]["growth_per_s"] <= 600

    flat = Pool.objects.create(
        model=pool.model,
        version=pool.version,
        region="us",
        min_replicas=1,
        max_replicas=10,
        warm_nodes_min=1,
        warm_nodes_max=4,
    )
    for seconds in range(0, 240, 5):
        autoscaling.autoscale_region(
            region="us",
            now=T0 + timedelta(seconds=seconds),
            redis_client=None,
            free_gpus=plenty,
        )
    assert reloaded(flat).last_tick()["warm_nodes"] == 1


@pytest.fixture
def shares(redis_url: str, settings: Settings) -> Iterator[redis.Redis]:
    """A Redis client under a prefix of this test's own."""
    settings.REDIS_KEY_PREFIX = f"as-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_url)
    yield client
    keys = list(client.scan_iter(f"{settings.REDIS_KEY_PREFIX}:*"))
    if keys:
        client.delete(*keys)
    client.close()


def publish_share(
    client: redis.Redis, prefix: str, gateway_id: str, share: dict[str, int]
) -> None:
    """Write a gateway process's share as ``routing.live.LiveLoad`` does."""
    client.zadd(gateways_seen_key(prefix, REGION), {gateway_id: T0.timestamp()})
    fields: dict[FieldT, EncodableT] = dict(share.items())
    client.hset(gateway_load_key(prefix, REGION, gateway_id), mapping=fields)


def test_tick_sums_tokens_and_queues_over_gateway_processes(
    pool: Pool, shares: redis.Redis, settings: Settings
) -> None:
    """GIVEN two gateway processes sharing their load in Redis, and one serving
    replica whose engine holds 2 requests waiting
    WHEN the autoscaler ticks
    THEN tokens in flight, queued tokens and queue depth are summed over both
    processes (plus the engine's queue), and the pool is sized on all of it.
    """
    prefix = settings.REDIS_KEY_PREFIX
    Pool.objects.filter(pk=pool.pk).update(desired_replicas=1)
    serving(pool.version, 1, tokens=0, queue=2)
    v1 = ("chat-7b", "v1")
    publish_share(
        shares,
        prefix,
        "gw-1",
        {
            pool_key(*v1): 120_000,
            queue_tokens_key(*v1): 30_000,
            queue_depth_key(*v1): 3,
        },
    )
    publish_share(
        shares,
        prefix,
        "gw-2",
        {pool_key(*v1): 60_000, queue_tokens_key(*v1): 10_000, queue_depth_key(*v1): 1},
    )
    publish_share(shares, prefix, "gw-idle", {"other-replica": 5})

    [result] = tick(T0, client=shares)

    signals = result.decision.signals
    assert signals["tokens_in_flight"] == 180_000
    assert signals["queued_tokens"] == 40_000
    assert signals["queue_depth"] == 6
    # 220,000 tokens wanted at 70% of 100,000 per replica: 4 replicas.
    assert reloaded(pool).desired_replicas == 4
    assert reloaded(pool).autoscaler_state["last"]["load_source"] == "gateways"


def test_tick_reads_heartbeats_when_redis_does_not_answer(pool: Pool) -> None:
    serving(pool.version, 2, tokens=90_000)
    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5)

    [result] = tick(T0, client=dead)

    assert result.decision.signals["tokens_in_flight"] == 180_000
    assert reloaded(pool).autoscaler_state["last"]["load_source"] == "beats"


def test_tick_flags_capacity_assumed_without_a_load_test(
    chat_v1: ModelVersion, settings: Settings
) -> None:
    settings.PLATFORM_DEFAULT_REPLICA_TOKENS_IN_FLIGHT = 1000
    pool = Pool.objects.create(
        model=chat_v1.model, version=chat_v1, region=REGION, max_replicas=10
    )
    serving(chat_v1, 1, tokens=1500)

    tick(T0)

    row = ScalingDecision.objects.get()
    # 1,500 tokens at 70% of the default 1,000 per replica: 3 replicas.
    assert (row.to_replicas, row.capacity_is_assumed) == (3, True)
    assert row.signals["replica_tokens_in_flight"] == 1000
    state = autoscaling.pool_state(model_id="chat-7b", now=T0, region=REGION)
    [entry] = state["pools"]
    assert entry["capacity_is_assumed"] and entry["replica_tokens_in_flight"] == 1000
    assert any(w.startswith("capacity assumed") for w in entry["warnings"])
    assert reloaded(pool).desired_replicas == 3


def test_tick_shares_the_regions_free_gpus_between_pools(
    pool: Pool, measured: ModelVersion
) -> None:
    """GIVEN two pools of a region, each needing 2 more replicas, and 2 free GPUs
    THEN the first pool takes them and the second reports capacity exhausted.
    """
    v2 = registry_services.register_version(
        model_id="chat-7b", **version_body(weights_hash=digest("v2 weights"))
    )
    ModelVersion.objects.filter(pk=v2.pk).update(load_test_tokens_in_flight=PER_REPLICA)
    second = Pool.objects.create(
        model=v2.model, version=v2, region=REGION, max_replicas=10, desired_replicas=1
    )
    Pool.objects.filter(pk=pool.pk).update(desired_replicas=1)
    serving(measured, 1, tokens=200_000)
    serving(v2, 1, tokens=200_000)

    def two_free(region: str, *, now: datetime, gpus_per_replica: int) -> int:
        return 2

    results = {r.pool_id: r for r in tick(T0, free_gpus=two_free)}

    assert reloaded(pool).desired_replicas == 3
    assert reloaded(second).desired_replicas == 1
    assert results[second.pk].decision.is_capacity_exhausted
    assert not results[second.pk].written
    [entry] = [
        p
        for p in autoscaling.pool_state(model_id="chat-7b", now=T0)["pools"]
        if p["version"] == "v2"
    ]
    assert entry["is_capacity_exhausted"]
    assert any(w.startswith("capacity exhausted") for w in entry["warnings"])


def test_tick_yields_to_a_size_changed_meanwhile(pool: Pool) -> None:
    """An operator's (or an overlapping tick's) change between the read and the
    write wins: the tick writes neither the size nor a row."""
    serving(pool.version, 2, tokens=90_000)

    def operator_changes_the_size(
        region: str, *, now: datetime, gpus_per_replica: int
    ) -> int:
        Pool.objects.filter(pk=pool.pk).update(desired_replicas=7)
        return 10**6

    assert tick(T0, free_gpus=operator_changes_the_size) == []
    assert reloaded(pool).desired_replicas == 7
    assert not ScalingDecision.objects.exists()


def test_tick_raises_the_floor_on_a_schedule(pool: Pool) -> None:
    PoolSchedule.objects.create(
        pool=pool,
        weekdays=[0, 1, 2, 3, 4],
        start_minute=11 * 60,
        end_minute=13 * 60,
        min_replicas=5,
    )
    serving(pool.version, 2)

    tick(T0)

    assert reloaded(pool).desired_replicas == 5
    assert ScalingDecision.objects.get().reason == "schedule"


def test_tick_keeps_a_bounded_number_of_rows(pool: Pool, settings: Settings) -> None:
    settings.PLATFORM_AUTOSCALE_DECISIONS_KEPT = 1
    serving(pool.version, 2, tokens=90_000)
    tick(T0)  # 2 -> 3
    Replica.objects.update(tokens_in_flight=200_000)
    # The short window averages 180,000 and 400,000: 5 replicas, over 2x serving.
    tick(T0 + timedelta(seconds=5))

    row = ScalingDecision.objects.get()
    assert (row.from_replicas, row.to_replicas, row.reason) == (3, 5, "panic")
    counts = reloaded(pool).autoscaler_state["decisions"]
    assert counts == {"utilisation": 1, "panic": 1}


def test_prune_decisions_keeps_the_newest(pool: Pool) -> None:
    for n in range(5):
        ScalingDecision.objects.create(
            pool=pool,
            region=REGION,
            decided_at=T0 + timedelta(seconds=n),
            from_replicas=n,
            to_replicas=n + 1,
            reason="utilisation",
        )

    assert autoscaling.prune_decisions(pool_id=pool.pk, keep=2) == 3
    assert sorted(ScalingDecision.objects.values_list("to_replicas", flat=True)) == [
        4,
        5,
    ]


def test_tick_skips_a_pool_whose_stored_settings_make_no_sense(pool: Pool) -> None:
    # Overlapping rows that disagree, written around the checks (no row of the
    # database can refuse them alone).
    for floor in (3, 4):
        PoolSchedule.objects.create(
            pool=pool, weekdays=[0], start_minute=0, end_minute=60, min_replicas=floor
        )
    serving(pool.version, 2, tokens=90_000)
    assert tick(T0) == []
    assert reloaded(pool).desired_replicas == 2


def test_pool_figures_for_metrics_come_from_the_rows(pool: Pool) -> None:
    serving(pool.version, 2, tokens=90_000)
    tick(T0)
    ReplicaFactory.create(
        version=pool.version, region=REGION, state="starting", last_heartbeat=T0
    )

    [figures] = autoscaling.pool_figures(region=REGION, now=T0)
    assert (figures.desired_replicas, figures.serving_replicas) == (3, 2)
    assert figures.starting_replicas == 1
    assert figures.utilisation == pytest.approx(0.9)  # 180,000 over 2 x 100,000
    assert figures.decisions == {"utilisation": 1}


def test_autoscale_pools_task_sizes_the_workers_region(
    pool: Pool, settings: Settings
) -> None:
    settings.REDIS_URL = ""
    settings.PLATFORM_REGION = REGION
    serving(pool.version, 2, tokens=90_000)
    with time_machine.travel(T0, tick=False):
        services.record_node_beat(node="gpu-1", region=REGION, gpus=8, now=T0)
        changed = tasks.autoscale_pools.apply(kwargs={"region": REGION}).get()

    assert changed == 1
    assert reloaded(pool).desired_replicas == 3
