"""The heartbeat reaper, on a moved clock."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import time_machine
from pytest_django import Settings

from control import tasks
from engine_nodes import services
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
