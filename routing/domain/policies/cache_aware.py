"""Cache-aware routing: send a prompt where its blocks already are, unless that
replica's prefill queue makes it slower than computing them elsewhere.

Public surface: ``CacheAwarePolicy``.
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
from routing.domain.policies.prefix_affinity import PrefixAffinityPolicy
from routing.domain.snapshot import NodeSnapshot

__all__ = ["CacheAwarePolicy"]


@register_policy
class CacheAwarePolicy:
    """Score replicas by the prompt tokens they hold and the prefill they owe.

    For each node ``i`` (``hit_i`` from ``req.cached_tokens``, ``p`` the prompt)::

        pending_i = prefill_tokens_in_flight_i + (p - hit_i)

    is the prefill the node must do before this request's first token: a proxy for
    its expected TTFT that counts both its queue and this prompt's uncached part.

    1. Without an index (``req.cached_tokens is None``) or when no node holds any
       of the prompt, this is ``PrefixAffinityPolicy`` exactly (conversation
       affinity with the seed's 125% bound).
    2. Otherwise the *warm* node is one holding the most prompt tokens: the
       conversation's ring owner when it is among them (its cache is at least as
       good), else the one of them with the least ``pending``.
    3. The warm node takes the request unless it is past either bound, then the
       node with the least ``pending`` (among those within the load ceiling, if
       any) does:

       - **prefill gap**: ``pending_warm - min_i pending_i > prefill_gap_tokens``.
         The tokens a replica prefills per second times the TTFT the platform
         lets a warm replica's queue cost (``PolicyOptions``); past it, waiting
         for the warm cache costs more than computing the prompt cold.
       - **load ceiling**: ``tokens_in_flight_warm + r > cache_load_factor *
         average`` (floored like prefix affinity's bound, ``r`` the request's
         tokens): decode work and KV memory, which prefill does not measure.

    Candidates after the choice are ordered by ``pending`` (ties in ring order),
    so a retry goes to the next fastest first token. ``skipped_over_bound`` is 0
    when the warm node took the request, 1 when a bound sent it elsewhere, and
    prefix affinity's value on the fallback path.
    """

    name: ClassVar[str] = "cache_aware"

    def __init__(
        self,
        options: PolicyOptions = DEFAULT_POLICY_OPTIONS,
    ) -> None:
        self.options = options
        self._affinity = PrefixAffinityPolicy.from_options(options)

    @classmethod
    def from_options(cls, options: PolicyOptions) -> CacheAwarePolicy:
        """Return a fresh policy with ``options``' bounds."""
        return cls(options)

    def reset(self) -> None:
        """Drop the ring (and its memoised walks)."""
        self._affinity.reset()

    def choose(
        self, req: RouteRequest, nodes: Sequence[NodeSnapshot], now: float
    ) -> RouteDecision:
        """Return the warm node unless a bound sends the request elsewhere."""
        fallback = self._affinity.choose(req, nodes, now)
        cached = req.cached_tokens
        if cached is None or not nodes:
            return RouteDecision(
                candidates=fallback.candidates,
                policy=self.name,
                skipped_over_bound=fallback.skipped_over_bound,
            )
        prompt = max(req.prompt_tokens, 0)
        hits = {
            node.replica_id: min(cached.get(node.replica_id, 0), prompt)
            for node in nodes
        }
        best_hit = max(hits.values())
        if best_hit <= 0:
            return RouteDecision(
                candidates=fallback.candidates,
                policy=self.name,
                skipped_over_bound=fallback.skipped_over_bound,
            )
        order = self._affinity.ring.order(req.routing_key)
        position = {rid: i for i, rid in enumerate(order)}
        by_id = {node.replica_id: node for node in nodes}
        pending = {
            rid: by_id[rid].prefill_tokens_in_flight + prompt - hit
            for rid, hit in hits.items()
        }

        def rank(rid: str) -> tuple[int, int]:
            return pending[rid], position[rid]

        owner = order[0]
        if hits[owner] == best_hit:
            warm = owner
        else:
            warm = min((rid for rid in order if hits[rid] == best_hit), key=rank)

        request_tokens = max(req.request_tokens, 0)
        total = request_tokens + sum(node.tokens_in_flight for node in nodes)
        ceiling = max(
            self.options.cache_load_factor * total / len(nodes),
            request_tokens,
            self.options.min_bound_tokens,
        )

        def within(rid: str) -> bool:
            return by_id[rid].tokens_in_flight + request_tokens <= ceiling

        fastest = min(order, key=rank)
        too_slow = pending[warm] - pending[fastest] > self.options.prefill_gap_tokens
        if not too_slow and within(warm):
            chosen, skipped = warm, 0
        else:
            room = [rid for rid in order if within(rid)]
            chosen = min(room, key=rank) if room else fastest
            skipped = 0 if chosen == warm else 1
        rest = sorted((rid for rid in order if rid != chosen), key=rank)
        return RouteDecision(
            candidates=(chosen, *rest), policy=self.name, skipped_over_bound=skipped
        )
