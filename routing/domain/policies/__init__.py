"""Routing policies: pick the replica order for one request, with one signature.

Public surface: ``RoutingPolicy``, ``RouteRequest``, ``RouteDecision``,
``PolicyOptions``, ``DEFAULT_POLICY_OPTIONS``, ``register_policy``, ``POLICIES``,
``make_policy``, and the policy classes ``RoundRobinPolicy``,
``LeastTokensPolicy``, ``PrefixAffinityPolicy``, ``CacheAwarePolicy``.

Invariants:

- Every policy is a class with ``name: ClassVar[str]``, a classmethod
  ``from_options(options)``, a sync ``choose(req, nodes, now) -> RouteDecision`` and
  ``reset()``; nothing else is called by the gateway or the simulator. Both build
  their policies with ``make_policy(name, options)``, and ``PolicyOptions`` holds
  the platform's one set of defaults.
- ``nodes`` are already eligible (serving, heard from recently) and have unique
  replica ids. ``RouteDecision.candidates`` is a permutation of their ids: the
  choice first, then the fallbacks to retry on. No nodes gives no candidates.
- ``choose`` never reads a clock and is deterministic given the policy's state.
- Policies keep mutable state (a cursor, a ring), so hold one instance per pool
  (model, version) and per event loop; they are not thread-safe.
- ``POLICIES`` is filled by ``@register_policy`` while this package imports and is
  closed afterwards: registering later raises.
"""

from __future__ import annotations

from routing.domain.policies.base import (
    DEFAULT_POLICY_OPTIONS,
    POLICIES,
    PolicyOptions,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
    close_registry,
    make_policy,
    register_policy,
)
from routing.domain.policies.cache_aware import CacheAwarePolicy
from routing.domain.policies.least_tokens import LeastTokensPolicy
from routing.domain.policies.prefix_affinity import PrefixAffinityPolicy
from routing.domain.policies.round_robin import RoundRobinPolicy

__all__ = [
    "DEFAULT_POLICY_OPTIONS",
    "POLICIES",
    "CacheAwarePolicy",
    "LeastTokensPolicy",
    "PolicyOptions",
    "PrefixAffinityPolicy",
    "RoundRobinPolicy",
    "RouteDecision",
    "RouteRequest",
    "RoutingPolicy",
    "make_policy",
    "register_policy",
]

close_registry()
