"""Celery tasks of the control loops: each is a thin call into a loop's live tick.

Public surface: the tasks, and ``RENAMED`` (old task name -> new).

Beat runs the ticks (``config.settings.CELERY_BEAT_SCHEDULE``): the reaper, the
autoscaler, the region limit shares, the rollout guards and the batch dispatcher;
the version gates and a
batch's runner slices run on queues of their own (``CELERY_TASK_ROUTES``).

The tasks were named after the app that held them before the control loops had a
room of their own (``engine_nodes.*``, ``batches.*``). Those names stay registered
as aliases of the same bodies, so a message queued by an older process, or a beat
schedule not yet upgraded, still runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
from celery import Task, shared_task
from django.conf import settings
from django.utils import timezone

from batches import runner
from control import autoscaling, gates, region_limits, rollout_guard
from engine_nodes import services
from engine_nodes.heartbeats import RedisBeatStore

__all__ = [
    "RENAMED",
    "autoscale_pools",
    "dispatch_batches",
    "guard_rollouts",
    "reap_silent_replicas",
    "run_batch",
    "run_gates",
    "share_region_limits",
]

_TICK: dict[str, Any] = {"acks_late": True, "ignore_result": True}
_GATES: dict[str, Any] = {
    **_TICK,
    "time_limit": int(settings.PLATFORM_GATE_TIME_LIMIT_S),
    "soft_time_limit": int(settings.PLATFORM_GATE_TIME_LIMIT_S) - 30,
}
# A slice ends by waiting for its lines in flight (each bounded by the request
# timeout), so the task's limits leave room for that.
_SLICE_S = int(
    settings.PLATFORM_BATCH_SLICE_S + settings.PLATFORM_BATCH_REQUEST_TIMEOUT_S + 60
)
_BATCH: dict[str, Any] = {"soft_time_limit": _SLICE_S, "time_limit": _SLICE_S + 30}


def reap_silent_replicas_body() -> int:
    """Mark this region's replicas that missed their heartbeats gone; return how many.

    Each region's worker reaps its own region's replicas, and spares those its
    Redis still hears beating: their database heartbeats may lag their agent's
    (``services.reap_silent_replicas``). Another region's worker, which cannot
    hear them, would take every replica of a region whose agents are slower to
    reach the database after an outage for dead.
    """
    return len(
        services.reap_silent_replicas(
            now=timezone.now(),
            heard=_heard_in_region(),
            region=settings.PLATFORM_REGION,
        )
    )


def _heard_in_region() -> frozenset[str]:
    """Ids of the replicas beating to this region's Redis (none without Redis)."""
    with autoscaling.region_redis() as client:
        if client is None:
            return frozenset()
        store = RedisBeatStore(
            client,
            prefix=settings.REDIS_KEY_PREFIX,
            ttl_s=settings.PLATFORM_HEARTBEAT_S,
        )
        try:
            beats = store.read_region(settings.PLATFORM_REGION)
        except redis.RedisError:
            return frozenset()  # judged by the database alone, as without Redis
    return frozenset(beat.replica_id for beat in beats)


def autoscale_pools_body(*, region: str = "") -> int:
    """Size the region's pools once (the autoscaler's tick); return how many changed.

    ``region`` defaults to this worker's ``PLATFORM_REGION``: each region's worker
    sizes its own pools, from its own Redis. A redelivered tick just decides again.
    """
    with autoscaling.region_redis() as client:
        results = autoscaling.autoscale_region(
            region=region or settings.PLATFORM_REGION,
            now=timezone.now(),
            redis_client=client,
        )
    return sum(result.written for result in results)


def share_region_limits_body(*, region: str = "") -> int:
    """Publish the region's demand and share its teams' limits (one tick of
    ``control.region_limits``); return how many keys have a share of their own.

    Needs the region's Redis (where the gateways count demand and read shares):
    without one there is one process and nothing to share.
    """
    with autoscaling.region_redis() as client:
        if client is None:
            return 0
        shares = region_limits.share_region_limits(
            client=client,
            prefix=settings.REDIS_KEY_PREFIX,
            region=region or settings.PLATFORM_REGION,
            now=timezone.now(),
            options=region_limits.share_settings(),
        )
    return len(shares) - 1


def run_gates_body(version_id: int, attempt: int) -> str:
    """Run one attempt at a version's gates (``control.gates``); return its
    status after. Queued by ``models_registry.services.start_gates``."""
    return gates.run_gates(version_id, attempt)


def guard_rollouts_body() -> dict[int, str]:
    """Run one tick of the rollout guards (``control.rollout_guard``); return
    each evaluated rollout's action. A redelivered tick evaluates again: each
    action is taken under a lock on the rollout at the step it evaluated."""
    return rollout_guard.guard_rollouts(now=timezone.now()).actions


def dispatch_batches_body() -> dict[str, int]:
    """Hand each active batch nobody holds to a runner; end what must end."""
    return runner.dispatch(enqueue=hand_on)


def run_batch_body(batch_id: str) -> str:
    """Work one slice of a batch; when it goes on, queue the next slice at once."""
    outcome = runner.run_batch(batch_id)
    if outcome is runner.Outcome.CONTINUE:
        hand_on(batch_id)
    return outcome.value


def hand_on(batch_id: str) -> None:
    """Queue a runner slice for the batch (it expires unstarted after two leases)."""
    runner.mark_handed_on(batch_id)
    run_batch.apply_async((batch_id,), expires=settings.PLATFORM_BATCH_LEASE_S * 2)


RENAMED = {
    "engine_nodes.reap_silent_replicas": "control.reap_silent_replicas",
    "engine_nodes.autoscale_pools": "control.autoscale_pools",
    "engine_nodes.run_gates": "control.run_gates",
    "engine_nodes.guard_rollouts": "control.guard_rollouts",
    "batches.dispatch_batches": "control.dispatch_batches",
    "batches.run_batch": "control.run_batch",
}
_OLD_NAME = {new: old for old, new in RENAMED.items()}


def _register(
    name: str, body: Callable[..., Any], options: dict[str, Any]
) -> Task[Any, Any]:
    """Register ``body`` as the task ``name`` and, for what is already queued, under
    its old name; return the task under its new name."""
    shared_task(name=_OLD_NAME[name], **options)(body)
    task: Task[Any, Any] = shared_task(name=name, **options)(body)
    return task


reap_silent_replicas = _register(
    "control.reap_silent_replicas",
    reap_silent_replicas_body,
    _TICK,
)
autoscale_pools = _register(
    "control.autoscale_pools",
    autoscale_pools_body,
    _TICK,
)
run_gates = _register("control.run_gates", run_gates_body, _GATES)
guard_rollouts = _register(
    "control.guard_rollouts",
    guard_rollouts_body,
    _TICK,
)
share_region_limits: Task[Any, Any] = shared_task(
    name="control.share_region_limits", **_TICK
)(share_region_limits_body)
dispatch_batches = _register("control.dispatch_batches", dispatch_batches_body, {})
run_batch = _register("control.run_batch", run_batch_body, _BATCH)
