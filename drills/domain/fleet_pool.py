"""The simulated gateway's view of its one pool, for admission.

Public surface: ``FleetPool`` (re-exported by ``drills.domain.fleet``).
"""

from __future__ import annotations

from drills.domain.replica import FleetReplica
from models_registry.domain.capacity import CapacityRecord, pool_capacity_tokens
from routing.domain.admission import PoolState
from routing.domain.tiers import Tier

__all__ = ["FleetPool"]


class FleetPool:
    """The simulated gateway's view of its one pool, for admission.

    Load is exact and live (one gateway); capacity is the serving replicas times
    ``replica_tokens_in_flight``. Without tiered admission (``is_tiered`` false)
    the pool reports no state, so admission takes every request that passed its
    team's limits straight to routing, as the gateway does for a pool it cannot
    judge.
    """

    def __init__(
        self,
        serving: list[FleetReplica],
        *,
        replica_tokens_in_flight: int,
        is_tiered: bool,
    ) -> None:
        self.serving = serving  # the simulator's list, updated as replicas come and go
        self.replica_tokens_in_flight = replica_tokens_in_flight
        self.is_tiered = is_tiered
        self.in_flight = 0
        self.team_in_flight: dict[str, int] = {}
        self.batch_in_flight = 0

    def state(self, model: str, version: str) -> PoolState | None:
        if not self.is_tiered:
            return None
        capacity = pool_capacity_tokens(
            len(self.serving),
            CapacityRecord(tokens_per_s=None, tokens_in_flight=None),
            self.replica_tokens_in_flight,
        )
        if capacity <= 0:
            return None
        return PoolState(
            capacity=capacity,
            in_flight=self.in_flight,
            team_in_flight=self.team_in_flight,
            batch_in_flight=self.batch_in_flight,
        )

    def take(
        self, model: str, version: str, team: str, tokens: int, tier: Tier
    ) -> None:
        self.in_flight += tokens
        self.team_in_flight[team] = self.team_in_flight.get(team, 0) + tokens
        if tier == Tier.BATCH:
            self.batch_in_flight += tokens

    def give_back(
        self, model: str, version: str, team: str, tokens: int, tier: Tier
    ) -> None:
        self.in_flight -= tokens
        self.team_in_flight[team] -= tokens
        if tier == Tier.BATCH:
            self.batch_in_flight -= tokens
