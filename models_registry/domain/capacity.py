"""A version's measured capacity and what a pool can carry with it.

Public surface: ``CapacityRecord``, ``replica_tokens_in_flight``,
``replica_tokens_per_s``, ``pool_capacity_tokens``.

For a version of an embedding model the figures are of input tokens: the input
tokens/s one replica sustains at its latency target, and the input tokens in
flight at that point (what the load-test gate writes).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CapacityRecord",
    "pool_capacity_tokens",
    "replica_tokens_in_flight",
    "replica_tokens_per_s",
]


@dataclass(frozen=True, slots=True)
class CapacityRecord:
    """What the load-test gate measured for one version (None until it has run)."""

    tokens_per_s: float | None
    tokens_in_flight: int | None

    @property
    def is_measured(self) -> bool:
        """True once the gate has saved both figures."""
        return self.tokens_per_s is not None and self.tokens_in_flight is not None


def replica_tokens_in_flight(
    capacity: CapacityRecord, default_tokens_in_flight: int
) -> tuple[int, bool]:
    """Return the tokens in flight one replica carries, and whether that is
    ``default_tokens_in_flight`` (assumed: no load test has measured it).

    A figure of 0 is no measurement here, as admission reads it (it passes
    ``measured or None``), so that a pool is sized on the default.
    """
    if capacity.tokens_in_flight:
        return capacity.tokens_in_flight, False
    return default_tokens_in_flight, True


def replica_tokens_per_s(
    capacity: CapacityRecord, default_tokens_per_s: float
) -> tuple[float, bool]:
    """Return the tokens/s one replica sustains at its latency target, and whether
    that is ``default_tokens_per_s`` (assumed: no load test has measured it).

    A figure of 0 (or less) is no measurement, as for tokens in flight.
    """
    if capacity.tokens_per_s is not None and capacity.tokens_per_s > 0:
        return float(capacity.tokens_per_s), False
    return float(default_tokens_per_s), True


def pool_capacity_tokens(
    serving_replicas: int, capacity: CapacityRecord, default_tokens_in_flight: int
) -> int:
    """Return the tokens in flight a pool can hold: serving replicas x measured capacity.

    Until the load test has run, ``default_tokens_in_flight`` per replica stands in.
    """
    per_replica = (
        capacity.tokens_in_flight
        if capacity.tokens_in_flight is not None
        else default_tokens_in_flight
    )
    return max(0, serving_replicas) * max(0, per_replica)
