"""Routing policies: pick the replica order for one request, with one signature.

Public surface: ``RoutingPolicy``, ``RouteRequest``, ``RouteDecision``,
``register_policy``, ``POLICIES``, ``make_policy``, and the policy classes
``RoundRobinPolicy``, ``LeastTokensPolicy``, ``PrefixAffinityPolicy``.

Invariants:

- Every policy is a class with ``name: ClassVar[str]``, a sync
  ``choose(req, nodes, now) -> RouteDecision`` and ``reset()``; nothing else is
  called by the gateway or the simulator.
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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeVar

from routing.domain.snapshot import NodeSnapshot

__all__ = [
    "POLICIES",
    "LeastTokensPolicy",
    "PrefixAffinityPolicy",
    "RoundRobinPolicy",
    "RouteDecision",
    "RouteRequest",
    "RoutingPolicy",
    "make_policy",
    "register_policy",
]


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy may know about a request; built by the gateway, never HTTP.

    ``request_tokens`` is prompt tokens plus ``max_tokens``: the most the request
    can add to a replica's tokens in flight.
    """

    model: str
    version: str
    routing_key: str
    team: str
    request_tokens: int


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """The replica ids to try, best first, and why.

    ``skipped_over_bound`` counts ring-preferred nodes passed over for load (always
    0 for policies without a ring); see ``PrefixAffinityPolicy`` for its exact
    meaning.
    """

    candidates: tuple[str, ...]
    policy: str
    skipped_over_bound: int = 0

    @property
    def chosen(self) -> str | None:
        """Return the first candidate, or None when there was no node."""
        return self.candidates[0] if self.candidates else None


class RoutingPolicy(Protocol):
    """Order eligible replicas for one request."""

    name: ClassVar[str]

    def choose(
        self, req: RouteRequest, nodes: Sequence[NodeSnapshot], now: float
    ) -> RouteDecision:
        """Return the candidates for ``req`` among ``nodes`` at time ``now``."""
        ...

    def reset(self) -> None:
        """Forget cursors and caches, as if freshly built."""
        ...


POLICIES: dict[str, type[RoutingPolicy]] = {}
_closed = False

_P = TypeVar("_P", bound=type[RoutingPolicy])


def register_policy(cls: _P) -> _P:
    """Add a policy class to ``POLICIES`` under its ``name``.

    Raises:
        RuntimeError: the registry is closed (this package finished importing).
        ValueError: the class has no ``name`` or the name is taken.
    """
    if _closed:
        raise RuntimeError(
            f"cannot register {cls.__name__}: the policy registry is closed; "
            "add the module to routing/domain/policies/__init__.py instead"
        )
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__name__} must set a non-empty name: ClassVar[str]")
    if name in POLICIES:
        raise ValueError(f"routing policy {name!r} is already registered")
    POLICIES[name] = cls
    return cls


def make_policy(name: str) -> RoutingPolicy:
    """Return a new instance of the policy registered as ``name``, with defaults.

    Raises:
        KeyError: no such policy; the message lists the known names.
    """
    factory: Callable[[], RoutingPolicy] | None = POLICIES.get(name)
    if factory is None:
        raise KeyError(
            f"unknown routing policy {name!r}; known: {', '.join(sorted(POLICIES))}"
        )
    return factory()


# Imported after the definitions above, which the modules use while registering.
from routing.domain.policies.least_tokens import LeastTokensPolicy  # noqa: E402
from routing.domain.policies.prefix_affinity import PrefixAffinityPolicy  # noqa: E402
from routing.domain.policies.round_robin import RoundRobinPolicy  # noqa: E402

_closed = True
