"""Replica convergence's two drivers decide alike on the same observations.

The step is ``engine_nodes.domain.convergence.converge_steps``; the node agent's
reconcile (``engine_nodes.services.reconcile_pools``) performs its effects on the
database, the fleet simulator (``FleetSim.converge``) on its modelled replicas.
Each step below takes the simulator's pool as it stands, writes the same
replicas as rows, runs both drivers toward the same target, and compares what
each started, cancelled and drained.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from itertools import count

import pytest
import time_machine
from pytest_django import Settings

from drills.domain.fleet import FleetSim
from drills.domain.fleet_config import FleetConfig
from drills.domain.fleet_scaling import ColdStart, FleetAutoscaling
from drills.domain.workload import Arrival
from engine_nodes import services
from engine_nodes.domain.convergence import StartReplica
from engine_nodes.models import Replica
from models_registry.domain.autoscaler import ScalingSettings
from models_registry.models import ModelVersion, Pool
from tests.factories import ReplicaFactory

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
Decision = tuple[int, list[str]]  # (replicas started, ids cancelled or drained)


def _fleet() -> FleetSim:
    """Three serving replicas, each holding long streams of different sizes."""
    sim = FleetSim(
        FleetConfig(
            replicas=3,
            policy="round_robin",
            replica_tokens_in_flight=20_000,
            admission=True,
            autoscaling=FleetAutoscaling(
                settings=ScalingSettings(min_replicas=1, max_replicas=4),
                cold_start=ColdStart(node_start_s=20.0, weights_gb=1.0, warmup_s=5.0),
                warm_nodes=1,
                first_tick_s=10**6,  # the policy stays out: the test sets targets
            ),
        ),
        arrivals=[
            Arrival(
                at=0.01 * i,
                team="t",
                tier="interactive",
                conversation=i,
                prompt_tokens=100 * (i + 1),
                output_tokens=4000,
                max_tokens=4000,
                history_tokens=0,
                stream_tokens=1,
            )
            for i in range(6)
        ],
    )
    sim.run(1.0, drain_s=0.0)
    return sim


def _mirror(sim: FleetSim) -> None:
    """Write the simulator's pool as the agent's rows would hold it."""
    Replica.objects.all().delete()
    for view in sim.replica_views():
        with time_machine.travel(T0 + timedelta(seconds=view.created_at), tick=False):
            ReplicaFactory.create(
                replica_id=view.replica_id,
                version=ModelVersion.objects.get(),
                region="eu",
                node="elsewhere",
                state=view.state,
                tokens_in_flight=view.tokens_in_flight,
                last_heartbeat=T0 + timedelta(seconds=sim.now),
            )


def _live(pool: Pool, target: int, sim: FleetSim) -> Decision:
    Pool.objects.filter(pk=pool.pk).update(desired_replicas=target)
    ports = count(9000)
    created, drained = services.reconcile_pools(
        region="eu",
        node="here",
        gpus_free=8,
        allocate_port=lambda: next(ports),
        host="127.0.0.1",
        now=T0 + timedelta(seconds=sim.now),
    )
    return len(created), drained


def _simulated(sim: FleetSim, target: int) -> Decision:
    effects = sim.converge(target)
    started = sum(isinstance(effect, StartReplica) for effect in effects)
    left = [
        effect.replica_id for effect in effects if not isinstance(effect, StartReplica)
    ]
    return started, left


def test_convergence_live_and_simulated_drivers_decide_alike(
    chat_v1: ModelVersion, settings: Settings
) -> None:
    settings.PLATFORM_HEARTBEAT_DB_S = 1.0
    settings.PLATFORM_MISSED_BEATS = 3
    pool = Pool.objects.create(
        model_id="chat-7b", version=chat_v1, region="eu", min_replicas=1, max_replicas=4
    )
    sim = _fleet()
    decisions: list[Decision] = []
    seen = []
    for target in (1, 1, 4, 3, 1):
        seen.append({view.replica_id: view for view in sim.replica_views()})
        _mirror(sim)
        live = _live(pool, target, sim)
        assert live == _simulated(sim, target), f"target {target}"
        decisions.append(live)
    first = seen[0]
    drained = decisions[0][1][0]
    assert first[drained].tokens_in_flight == min(
        view.tokens_in_flight for view in first.values()
    )
    assert first[drained].tokens_in_flight > 0  # it holds streams: it drains on
    assert seen[3][decisions[3][1][0]].state == "starting"
    assert seen[4][decisions[4][1][0]].state == "loading"
    # One drain, then it waits for it; short by two, two starts (one warm, so
    # loading, one cold, still starting); one too many, the cold start goes;
    # the warm one goes too once the target falls below the serving replicas.
    assert [(started, len(left)) for started, left in decisions] == [
        (0, 1),
        (0, 0),
        (2, 0),
        (0, 1),
        (0, 1),
    ]
