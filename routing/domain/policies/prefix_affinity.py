"""Prefix affinity with bounded load: a conversation returns to its warm replica.

Public surface: ``PrefixAffinityPolicy``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from routing.domain.policies.base import (
    DEFAULT_POLICY_OPTIONS,
    PolicyOptions,
    RouteDecision,
    RouteRequest,
    register_policy,
)
from routing.domain.ring import DEFAULT_VNODES, HashRing
from routing.domain.snapshot import NodeSnapshot

__all__ = ["PrefixAffinityPolicy"]


@register_policy
class PrefixAffinityPolicy:
    """Walk the hash ring from the routing key; take the first node within the bound.

    The bound, exactly (``r`` is ``max(req.request_tokens, 0)``, ``n`` the number
    of nodes, loads are ``tokens_in_flight``)::

        avg   = (sum(loads) + r) / n            # pool average once r is placed
        bound = max(load_factor * avg, r, min_bound_tokens)
        node is within the bound  iff  node.tokens_in_flight + r <= bound

    ``load_factor * avg`` is the seed's "125% of the pool average". The ``max``
    with ``r`` lets any *idle* node take a request (the weighted form of the
    ceiling in Mirrokni et al.'s bounded-load hashing: every node can hold at least
    one request); without it an idle pool of n >= 2 would put every node over the
    bound, and the ring owner must win when everything is idle.
    ``min_bound_tokens`` is a floor below which no replica counts as overloaded:
    at low traffic every replica has room, and moving a conversation off its warm
    replica only because the others are idler costs its prefix hits. Built with
    ``from_options`` (as the gateway and the simulator do) both come from
    ``PolicyOptions``; the constructor's own defaults are the bare rule, with no
    floor.

    Invariants:

    - The chosen node is within the bound whenever any node is (any of the first
      ``ring_choices`` in ring order, when that is not 0). When none is, the least
      loaded node is chosen, ties going to the earlier node in ring order.
    - ``candidates`` is the chosen node, then every other node in ring order (the
      skipped, hot ones first: they still hold the warmest caches for a retry).
    - ``skipped_over_bound`` is the chosen node's position in ring order when it
      was within the bound (0: the owner took it), and ``n`` exactly when every
      node was over the bound.
    - The ring is rebuilt only when the set of replica ids changes, and then only
      the new ids are hashed.
    """

    name: ClassVar[str] = "prefix_affinity"

    def __init__(
        self,
        load_factor: float = DEFAULT_POLICY_OPTIONS.load_factor,
        vnodes: int = DEFAULT_VNODES,
        min_bound_tokens: int = 0,
        ring_choices: int = 0,
    ) -> None:
        # PolicyOptions checks the tunables; the bare rule has no floor.
        PolicyOptions(
            load_factor=load_factor,
            min_bound_tokens=min_bound_tokens,
            ring_choices=ring_choices,
        )
        self.load_factor = load_factor
        self.min_bound_tokens = min_bound_tokens
        self.ring_choices = ring_choices
        self.vnodes = vnodes
        self._ring = HashRing((), vnodes)

    @classmethod
    def from_options(cls, options: PolicyOptions) -> PrefixAffinityPolicy:
        """Return a fresh policy with ``options``' bound and floor."""
        return cls(
            load_factor=options.load_factor,
            min_bound_tokens=options.min_bound_tokens,
            ring_choices=options.ring_choices,
        )

    @property
    def ring(self) -> HashRing:
        """Return the ring over the nodes of the last call."""
        return self._ring

    def reset(self) -> None:
        """Drop the ring (and its memoised walks)."""
        self._ring = HashRing((), self.vnodes)

    def choose(
        self, req: RouteRequest, nodes: Sequence[NodeSnapshot], now: float
    ) -> RouteDecision:
        """Return the first node in ring order within the bound, then the rest."""
        if not nodes:
            return RouteDecision(candidates=(), policy=self.name)
        by_id = {node.replica_id: node for node in nodes}
        self._ring = self._ring.with_nodes(frozenset(by_id))
        order = self._ring.order(req.routing_key)

        request_tokens = max(req.request_tokens, 0)
        total = request_tokens
        for node in by_id.values():
            total += node.tokens_in_flight
        bound = max(
            self.load_factor * (total / len(by_id)),
            request_tokens,
            self.min_bound_tokens,
        )

        walk = order[: self.ring_choices] if self.ring_choices else order
        for position, replica_id in enumerate(walk):
            if by_id[replica_id].tokens_in_flight + request_tokens <= bound:
                chosen, skipped = replica_id, position
                break
        else:
            # min() keeps the first of equal loads, so ties follow ring order.
            chosen = min(order, key=lambda rid: by_id[rid].tokens_in_flight)
            skipped = len(order)

        if chosen == order[0]:
            candidates = order
        else:
            candidates = (chosen, *(rid for rid in order if rid != chosen))
        return RouteDecision(
            candidates=candidates, policy=self.name, skipped_over_bound=skipped
        )
