"""Least tokens in flight: balance on work, not on connections.

Public surface: ``LeastTokensPolicy``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from routing.domain.policies.base import (
    PolicyOptions,
    RouteDecision,
    RouteRequest,
    register_policy,
)
from routing.domain.snapshot import NodeSnapshot

__all__ = ["LeastTokensPolicy"]


@register_policy
class LeastTokensPolicy:
    """Order nodes by ascending ``tokens_in_flight``; ignore the routing key.

    Invariants: the chosen node has the minimum tokens in flight, and candidates
    are sorted by tokens in flight. Exact ties are broken by a rotation over the
    nodes sorted by replica id that advances once per call, so a pool of idle
    replicas (all 0, and other gateways' counts are up to a second stale) does
    not send every request to the same first id.
    """

    name: ClassVar[str] = "least_tokens"

    def __init__(self) -> None:
        self._cursor = 0

    @classmethod
    def from_options(cls, options: PolicyOptions) -> LeastTokensPolicy:
        """Return a fresh policy; it has no options."""
        return cls()

    def reset(self) -> None:
        """Restart the tie-break rotation at the lowest replica id."""
        self._cursor = 0

    def choose(
        self, req: RouteRequest, nodes: Sequence[NodeSnapshot], now: float
    ) -> RouteDecision:
        """Return ids by ascending load, ties rotating; advance the cursor."""
        if not nodes:
            return RouteDecision(candidates=(), policy=self.name)
        ordered = sorted(nodes, key=_replica_id)
        n = len(ordered)
        start = self._cursor % n
        self._cursor += 1
        ranked = sorted(
            range(n),
            key=lambda i: (ordered[i].tokens_in_flight, (i - start) % n),
        )
        return RouteDecision(
            candidates=tuple(ordered[i].replica_id for i in ranked), policy=self.name
        )


def _replica_id(node: NodeSnapshot) -> str:
    return node.replica_id
