"""The fleet simulator configured as the gateway is: one place reads the settings.

Public surface: ``platform_fleet_config``.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from drills.domain.fleet_config import FleetConfig

__all__ = ["platform_fleet_config"]


def platform_fleet_config(**overrides: Any) -> FleetConfig:
    """Return a ``FleetConfig`` with the platform's routing and admission settings.

    ``overrides`` (replicas, profile, seed, admission, ...) win over the settings.
    """
    values: dict[str, Any] = {
        "policy": settings.PLATFORM_ROUTING_POLICY,
        "min_bound_tokens": settings.PLATFORM_AFFINITY_MIN_BOUND_TOKENS,
        "ring_choices": settings.PLATFORM_AFFINITY_RING_CHOICES,
        "replica_tokens_in_flight": settings.PLATFORM_DEFAULT_REPLICA_TOKENS_IN_FLIGHT,
        "max_queue": settings.PLATFORM_ADMISSION_MAX_QUEUE,
        "max_wait_s": settings.PLATFORM_ADMISSION_MAX_WAIT_S,
        "batch_ceiling": settings.PLATFORM_BATCH_CEILING,
        "batch_lane": settings.PLATFORM_BATCH_LANE,
        "retry_ratio": settings.PLATFORM_RETRY_RATIO,
    }
    values.update(overrides)
    return FleetConfig(**values)
