"""How many warm nodes a pool keeps: the forecast of the next cold-start window.

Public surface: ``Trend``, ``follow``, ``warm_nodes``.

A replica started on a node that already has the weights on its disk serves after
load and warm-up (under a minute); one started cold waits for a node as well (the
seed's sum: about 5 minutes, "so plan for 6"). A warm node is a GPU node that is up
and idle, billed all the same, so a constant pool of them pays all day for the
few minutes of the morning ramp it helps. Here the pool's size follows what the
demand is expected to need one cold start ahead, at the growth observed now:

- ``follow`` keeps the demand's level and slope (Holt's linear trend for samples
  at irregular times: each observation pulls the level with weight
  ``1 - exp(-dt / level_s)`` and the slope with ``1 - exp(-dt / slope_s)``), so a
  tick's noise moves neither much and a steady climb shows as a steady slope;
- ``warm_nodes`` projects the level ``horizon_s`` ahead along the slope, counts
  the replicas that demand needs at the target utilisation, and keeps warm the
  ones the pool does not already have or ask for, between the pool's
  ``warm_nodes_min`` (the seed's "warm minimum" against a spike no trend
  foretells) and ``warm_nodes_max``. One node per replica: a warm node is sized
  for one replica (its ``gpus_per_replica`` GPUs).

A target that falls holds for ``horizon_s`` after it was last reached: a node
released and provisioned again costs its start (4 minutes billed for nothing),
and a trend seen once tends to come back within a cold start.

The autoscaler's policy (``models_registry.domain.autoscaler.decide``) calls both
at every tick, live and in the fleet simulator, and returns the count with its
decision (``ScalingDecision.warm_nodes``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Trend", "follow", "warm_nodes"]

_TOLERANCE = 1e-9


@dataclass(frozen=True, slots=True)
class Trend:
    """The demand's smoothed level (demand units) and slope (units per second) at
    ``at``; ``warm`` is the last warm target and ``warm_at`` when it was raised."""

    at: float
    level: float
    slope: float = 0.0
    warm: int = 0
    warm_at: float | None = None

    def forecast(self, horizon_s: float) -> float:
        """The demand expected ``horizon_s`` from now, never below zero."""
        return max(0.0, self.level + self.slope * horizon_s)

    def as_list(self) -> list[float | int | None]:
        return [self.at, self.level, self.slope, self.warm, self.warm_at]

    @classmethod
    def from_list(cls, data: list[float | int | None] | None) -> Trend | None:
        """Read back ``as_list``; None for a missing record (a malformed one
        raises ``TypeError`` or ``ValueError``)."""
        if not data:
            return None
        at, level, slope, warm, warm_at = data
        return cls(
            at=float(at),  # type: ignore[arg-type]
            level=float(level),  # type: ignore[arg-type]
            slope=float(slope),  # type: ignore[arg-type]
            warm=int(warm),  # type: ignore[arg-type]
            warm_at=None if warm_at is None else float(warm_at),
        )


def follow(
    trend: Trend | None, at: float, demand: float, *, level_s: float, slope_s: float
) -> Trend:
    """Return the trend after observing ``demand`` at ``at``.

    The first observation sets the level with no slope; an observation no later
    than the last one replaces nothing (the record keeps the later time).
    """
    if trend is None:
        return Trend(at=at, level=demand)
    dt = at - trend.at
    if dt <= 0:
        return trend
    projected = trend.level + trend.slope * dt
    alpha = 1.0 - math.exp(-dt / level_s)
    beta = 1.0 - math.exp(-dt / slope_s)
    level = projected + alpha * (demand - projected)
    slope = trend.slope + beta * ((level - trend.level) / dt - trend.slope)
    return Trend(
        at=at, level=level, slope=slope, warm=trend.warm, warm_at=trend.warm_at
    )


def warm_nodes(
    trend: Trend,
    *,
    horizon_s: float,
    per_replica: float,
    target_utilisation: float,
    desired: int,
    current: int,
    max_replicas: int,
    startable: int,
    minimum: int,
    maximum: int,
) -> Trend:
    """Return ``trend`` with its warm target for this tick (``Trend.warm``).

    A lower target than the last one waits until ``horizon_s`` has passed since
    the last was reached. ``desired`` and ``current`` are the pool's replicas (asked for, had);
    ``startable`` is how many more replicas the region's free GPUs could start
    beyond ``desired``. The target is the replicas the forecast needs beyond
    ``max(desired, current)``, at least ``minimum``, and at most ``maximum``, the
    room left under ``max_replicas`` and what the free GPUs allow.
    """
    if maximum <= 0:
        return Trend(trend.at, trend.level, trend.slope)
    needed = math.ceil(
        trend.forecast(horizon_s) / (target_utilisation * per_replica) - _TOLERANCE
    )
    wanted = max(minimum, needed - max(desired, current))
    room = min(maximum, max(0, max_replicas - desired), max(0, startable))
    target = max(0, min(wanted, room))
    reached_at = trend.at if target >= trend.warm else trend.warm_at
    held = reached_at is not None and trend.at - reached_at < horizon_s
    if target < trend.warm and held:
        target = min(trend.warm, room)
    return Trend(
        trend.at,
        trend.level,
        trend.slope,
        warm=target,
        warm_at=reached_at if target > 0 else None,
    )
