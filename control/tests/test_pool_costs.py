"""The pools' GPUs, cost and silent replicas at /metrics, read from real rows."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from prometheus_client import REGISTRY
from pytest_django import Settings

from control.pool_costs import pool_cost_figures
from engine_nodes.models import Replica
from models_registry import services as registry_services
from models_registry.models import Model, ModelVersion, Pool
from tests.factories import ReplicaFactory, version_body

pytestmark = pytest.mark.django_db

REGION = "eu"
POOL = {"model": "chat-7b", "version": "v1", "region": REGION}


@pytest.fixture(autouse=True)
def beats(settings: Settings) -> None:
    settings.PLATFORM_REGION = REGION
    settings.PLATFORM_HEARTBEAT_DB_S = 1.0
    settings.PLATFORM_MISSED_BEATS = 3
    settings.PLATFORM_GPU_HOUR_USD = 2.50
    settings.PLATFORM_GPU_HOUR_USD_BY_REGION = {}
    settings.PLATFORM_ASSUMED_TOKENS_PER_S = 2500.0


@pytest.fixture
def pool(chat_v1: ModelVersion) -> Pool:
    return Pool.objects.create(
        model=chat_v1.model, version=chat_v1, region=REGION, min_replicas=1
    )


def replica(version: ModelVersion, state: str, *, beat_s_ago: float | None) -> None:
    """Add a replica in ``state`` whose last beat was ``beat_s_ago`` seconds ago
    (None: it never beat, and was created that long ago as 0)."""
    now = timezone.now()
    beat = None if beat_s_ago is None else now - timedelta(seconds=beat_s_ago)
    ReplicaFactory.create(
        version=version, region=REGION, state=state, last_heartbeat=beat
    )


def test_every_replica_not_gone_holds_its_gpus_at_the_regions_price(
    chat_model: Model, settings: Settings
) -> None:
    two_gpus = registry_services.register_version(
        model_id="chat-7b", **version_body(gpus_per_replica=2)
    )
    pool = Pool.objects.create(model=chat_model, version=two_gpus, region=REGION)
    settings.PLATFORM_GPU_HOUR_USD_BY_REGION = {REGION: 3.0, "us": 9.0}
    for state in ("starting", "loading", "serving", "stalled", "draining"):
        replica(pool.version, state, beat_s_ago=0.5)
    replica(pool.version, "gone", beat_s_ago=0.5)
    # Another region's replica is that region's pool's.
    ReplicaFactory.create(version=pool.version, region="us", last_heartbeat=None)

    value = REGISTRY.get_sample_value
    assert value("platform_pool_gpus", POOL) == 10  # 5 replicas x 2 GPUs
    assert value("platform_pool_gpu_usd_per_hour", POOL) == pytest.approx(30.0)
    assert value("platform_pool_silent_replicas", POOL) == 0


def test_usd_per_million_at_full_is_the_seeds(pool: Pool, settings: Settings) -> None:
    """Seed: 1 GPU at 2.50 USD an hour making 2,500 tokens a second: 0.28. Before
    a load test the cost model's assumed rate stands in; after, the measured one."""
    settings.PLATFORM_ASSUMED_TOKENS_PER_S = 2500.0
    value = REGISTRY.get_sample_value
    at_full = "platform_pool_usd_per_million_tokens_at_full"
    assert value(at_full, POOL) == pytest.approx(0.2778, abs=1e-4)

    ModelVersion.objects.filter(pk=pool.version_id).update(
        load_test_tokens_per_s=5000.0
    )
    assert value(at_full, POOL) == pytest.approx(0.1389, abs=1e-4)
    # Without a regional price the default applies; no replica, no GPUs.
    assert value("platform_pool_gpus", POOL) == 0
    assert value("platform_pool_gpu_usd_per_hour", POOL) == 0


def test_silent_replicas_are_those_past_the_missed_beat_window(pool: Pool) -> None:
    replica(pool.version, "serving", beat_s_ago=2.0)  # within 3 x 1 s
    replica(pool.version, "serving", beat_s_ago=10.0)
    replica(pool.version, "stalled", beat_s_ago=10.0)
    replica(pool.version, "gone", beat_s_ago=10.0)  # reaped: neither silent nor held
    replica(pool.version, "starting", beat_s_ago=None)  # just created: not yet silent
    Replica.objects.create(
        replica_id="never-beat",
        model=pool.model,
        version=pool.version,
        region=REGION,
        node="node-1",
        state="starting",
    )
    # created_at is auto_now_add: move it back past the window.
    Replica.objects.filter(replica_id="never-beat").update(
        created_at=timezone.now() - timedelta(seconds=10)
    )

    [figures] = pool_cost_figures()
    assert figures.silent_replicas == 3
    assert figures.gpus == 5
    assert REGISTRY.get_sample_value("platform_pool_silent_replicas", POOL) == 3


def test_an_embedding_pool_costs_per_million_input_tokens(
    settings: Settings,
) -> None:
    """An embedding version's load test measured input tokens/s: its pool's
    figure at full is per million input tokens (1 GPU at 2.50 USD embedding
    50,000 tokens a second: 0.0139)."""
    registry_services.create_model(
        model_id="embed-small", kind="embedding", dimensions=384, max_input_tokens=512
    )
    version = registry_services.register_version(
        model_id="embed-small",
        **{**version_body(), "engine_config": {"runner": "pooling"}},
    )
    ModelVersion.objects.filter(pk=version.pk).update(load_test_tokens_per_s=50_000.0)
    Pool.objects.create(model_id="embed-small", version=version, region=REGION)
    replica(version, "serving", beat_s_ago=0.5)

    (figures,) = [f for f in pool_cost_figures() if f.model == "embed-small"]
    assert figures.usd_per_million_tokens_at_full == pytest.approx(2.50 / 180)
    value = REGISTRY.get_sample_value
    assert value(
        "platform_pool_usd_per_million_tokens_at_full",
        {"model": "embed-small", "version": version.version, "region": REGION},
    ) == pytest.approx(2.50 / 180)
