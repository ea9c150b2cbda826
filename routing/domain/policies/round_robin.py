"""Round-robin: the baseline the seed's routing A/B compares against.

Public surface: ``RoundRobinPolicy``.
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

__all__ = ["RoundRobinPolicy"]


@register_policy
class RoundRobinPolicy:
    """Rotate through the nodes sorted by replica id, ignoring load and keys.

    Invariants: call k (counting from 0 after ``reset``) over an unchanged set of n
    nodes chooses the node at index ``k mod n`` of the sorted ids, so over many
    calls every node is chosen within one of every other. The fallbacks continue
    the rotation. When membership changes the cursor keeps counting, so the
    rotation stays even without restarting from the first id.
    """

    name: ClassVar[str] = "round_robin"

    def __init__(self) -> None:
        self._cursor = 0

    @classmethod
    def from_options(cls, options: PolicyOptions) -> RoundRobinPolicy:
        """Return a fresh policy; it has no options."""
        return cls()

    def reset(self) -> None:
        """Restart the rotation at the lowest replica id."""
        self._cursor = 0

    def choose(
        self, req: RouteRequest, nodes: Sequence[NodeSnapshot], now: float
    ) -> RouteDecision:
        """Return the ids rotated to start at the cursor; advance the cursor."""
        if not nodes:
            return RouteDecision(candidates=(), policy=self.name)
        ids = sorted(node.replica_id for node in nodes)
        start = self._cursor % len(ids)
        self._cursor += 1
        return RouteDecision(
            candidates=tuple(ids[start:] + ids[:start]), policy=self.name
        )
