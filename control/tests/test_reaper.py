"""The heartbeat reaper, on a moved clock."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
import redis
import time_machine
from pytest_django import Settings

from control import tasks
from engine_nodes import services
from engine_nodes.domain.beats import ReplicaBeat
from engine_nodes.heartbeats import RedisBeatStore
from engine_nodes.models import Replica
from models_registry.models import ModelVersion
from tests.factories import ReplicaFactory

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)

# What the ``replicas`` fixture returns: (fresh, stale, never beat).
Replicas = tuple[Replica, Replica, Replica]


@pytest.fixture
def replicas(chat_v1: ModelVersion, settings: Settings) -> Replicas:
    settings.PLATFORM_HEARTBEAT_S = 1.0
    settings.PLATFORM_HEARTBEAT_DB_S = 1.0
    settings.PLATFORM_MISSED_BEATS = 3
    with time_machine.travel(T0, tick=False):
        fresh = ReplicaFactory.create(version=chat_v1, last_heartbeat=T0)
        stale = ReplicaFactory.create(
            version=chat_v1, last_heartbeat=T0 - timedelta(seconds=2)
        )
        never = ReplicaFactory.create(
            version=chat_v1, state="starting", last_heartbeat=None
        )
    return fresh, stale, never


def states() -> dict[str, str]:
    return dict(Replica.objects.values_list("replica_id", "state"))


def test_reaper_spares_replicas_within_three_beats(replicas: Replicas) -> None:
    with time_machine.travel(T0 + timedelta(seconds=0.5), tick=False):
        reaped = services.reap_silent_replicas(now=datetime.now(UTC))
    assert reaped == []
    assert set(states().values()) == {"serving", "starting"}


def test_reaper_marks_replicas_silent_for_three_beats_gone(replicas: Replicas) -> None:
    fresh, stale, never = replicas
    # stale beat at T0-2s: at T0+1.5s it has been silent 3.5 s, past 3 beats.
    now = T0 + timedelta(seconds=1.5)
    reaped = services.reap_silent_replicas(now=now)
    assert reaped == [stale.replica_id]
    assert states()[fresh.replica_id] == "serving"
    assert states()[never.replica_id] == "starting"


def test_reaper_reaps_replica_that_never_beat_once_it_is_old(
    replicas: Replicas,
) -> None:
    fresh, stale, never = replicas
    reaped = services.reap_silent_replicas(now=T0 + timedelta(seconds=3.5))
    assert sorted(reaped) == sorted(
        [fresh.replica_id, stale.replica_id, never.replica_id]
    )
    assert set(states().values()) == {"gone"}


def test_reaper_is_idempotent(replicas: Replicas) -> None:
    now = T0 + timedelta(seconds=10)
    assert len(services.reap_silent_replicas(now=now)) == 3
    assert services.reap_silent_replicas(now=now) == []


def test_reaper_judges_by_the_database_beat(
    replicas: Replicas, settings: Settings
) -> None:
    # Beats reach the database every 5 s: 10 s of silence is 2 missed beats.
    settings.PLATFORM_HEARTBEAT_DB_S = 5.0
    assert services.reap_silent_replicas(now=T0 + timedelta(seconds=10)) == []


def test_reaper_task_wiring_uses_the_clock(replicas: Replicas) -> None:
    with time_machine.travel(T0 + timedelta(seconds=1.5), tick=False):
        result = tasks.reap_silent_replicas.apply()
    assert result.successful()
    assert result.result == 1
    assert list(
        Replica.objects.filter(state="gone").values_list("replica_id", flat=True)
    ) == [replicas[1].replica_id]


def test_reaper_spares_replicas_the_routers_still_hear(replicas: Replicas) -> None:
    """A replica beating to Redis is alive whatever its database heartbeat says
    (its agent's database writes wait, or the database is just back)."""
    fresh, stale, never = replicas
    reaped = services.reap_silent_replicas(
        now=T0 + timedelta(seconds=10), heard={stale.replica_id}
    )
    assert sorted(reaped) == sorted([fresh.replica_id, never.replica_id])
    assert states()[stale.replica_id] == "serving"


def test_reaper_task_spares_replicas_beating_to_the_regions_redis(
    replicas: Replicas, redis_url: str, settings: Settings
) -> None:
    """GIVEN the stale replica still beating to this region's Redis
    WHEN the reaper's task runs past its database silence
    THEN it reaps only the replica that never beat."""
    fresh, stale, never = replicas
    prefix = f"test-reaper-{uuid.uuid4().hex[:8]}"
    settings.REDIS_URL = redis_url
    settings.REDIS_KEY_PREFIX = prefix
    settings.PLATFORM_REGION = stale.region
    client = redis.Redis.from_url(redis_url)
    store = RedisBeatStore(client, prefix=prefix, ttl_s=60.0)
    try:
        for replica in (fresh, stale):
            store.publish([_beat_of(replica)])
        with time_machine.travel(T0 + timedelta(seconds=5), tick=False):
            result = tasks.reap_silent_replicas.apply()
        assert result.successful()
        assert result.result == 1
        assert states() == {
            fresh.replica_id: "serving",
            stale.replica_id: "serving",
            never.replica_id: "gone",
        }
    finally:
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)
        client.close()


def _beat_of(replica: Replica) -> ReplicaBeat:
    return ReplicaBeat(
        replica_id=replica.replica_id,
        model=replica.model_id,
        version="v1",
        region=replica.region,
        node=replica.node,
        url=replica.url,
        state="serving",
        queue_depth=0,
        num_running=0,
        tokens_in_flight=0,
        kv_cache_usage_perc=0.0,
        beat_at=T0.timestamp(),
    )


def test_reaper_task_reaps_only_its_own_regions_replicas(
    replicas: Replicas, settings: Settings
) -> None:
    """Another region's replicas are its own worker's to judge (it hears them)."""
    settings.PLATFORM_REGION = "elsewhere"
    with time_machine.travel(T0 + timedelta(seconds=10), tick=False):
        result = tasks.reap_silent_replicas.apply()
    assert result.successful() and result.result == 0
    settings.PLATFORM_REGION = replicas[0].region
    with time_machine.travel(T0 + timedelta(seconds=10), tick=False):
        assert tasks.reap_silent_replicas.apply().result == 3
