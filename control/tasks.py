"""Celery tasks of the engine fleet."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import redis
from celery import shared_task
from django.conf import settings
from django.utils import timezone

from control import autoscaling, gates, rollout_guard
from engine_nodes import services


@shared_task(
    name="engine_nodes.reap_silent_replicas", acks_late=True, ignore_result=True
)
def reap_silent_replicas() -> int:
    """Mark replicas that missed their heartbeats as gone; return how many."""
    return len(services.reap_silent_replicas(now=timezone.now()))


@shared_task(name="engine_nodes.autoscale_pools", acks_late=True, ignore_result=True)
def autoscale_pools(*, region: str = "") -> int:
    """Size the region's pools once (the autoscaler's tick); return how many changed.

    ``region`` defaults to this worker's ``PLATFORM_REGION``: each region's worker
    sizes its own pools, from its own Redis. A redelivered tick just decides again.
    """
    with _region_redis() as client:
        results = autoscaling.autoscale_region(
            region=region or settings.PLATFORM_REGION,
            now=timezone.now(),
            redis_client=client,
        )
    return sum(result.written for result in results)


@shared_task(
    name="engine_nodes.run_gates",
    acks_late=True,
    ignore_result=True,
    time_limit=int(settings.PLATFORM_GATE_TIME_LIMIT_S),
    soft_time_limit=int(settings.PLATFORM_GATE_TIME_LIMIT_S) - 30,
)
def run_gates(version_id: int, attempt: int) -> str:
    """Run one attempt at a version's gates (``control.gates``); return its
    status after. Queued by ``models_registry.services.start_gates``."""
    return gates.run_gates(version_id, attempt)


@shared_task(name="engine_nodes.guard_rollouts", acks_late=True, ignore_result=True)
def guard_rollouts() -> dict[int, str]:
    """Run one tick of the rollout guards (``control.rollout_guard``); return
    each evaluated rollout's action. A redelivered tick evaluates again: each
    action is taken under a lock on the rollout at the step it evaluated."""
    return rollout_guard.guard_rollouts(now=timezone.now()).actions


@contextlib.contextmanager
def _region_redis() -> Iterator[redis.Redis | None]:
    """Yield a client of this region's Redis (short timeouts), or None without one."""
    if not settings.REDIS_URL:
        yield None
        return
    with redis.Redis.from_url(
        settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2
    ) as client:
        yield client
