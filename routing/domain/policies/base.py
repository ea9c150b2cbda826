"""What every routing policy shares: the request, the decision, the options, the
protocol, and the registry the policy modules fill.

Public surface: ``RoutingPolicy``, ``RouteRequest``, ``RouteDecision``,
``PolicyOptions``, ``DEFAULT_POLICY_OPTIONS``, ``register_policy``, ``POLICIES``,
``make_policy``, ``close_registry``.

The policy modules import this one and the package imports them, so none of them
imports the package (``routing.domain.policies``), which re-exports it all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, Self, TypeVar

from routing.domain.snapshot import NodeSnapshot

__all__ = [
    "DEFAULT_POLICY_OPTIONS",
    "POLICIES",
    "PolicyOptions",
    "RouteDecision",
    "RouteRequest",
    "RoutingPolicy",
    "close_registry",
    "make_policy",
    "register_policy",
]


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy may know about a request; built by the gateway, never HTTP.

    ``request_tokens`` is prompt tokens plus ``max_tokens``: the most the request
    can add to a replica's tokens in flight. ``prompt_tokens`` is the prompt alone.
    ``cached_tokens`` maps a replica id to how many leading prompt tokens the pool's
    prefix index says that replica holds (a replica left out holds none); None
    when the pool has no index (no KV events), so cache-aware routing falls back
    to conversation affinity.
    """

    model: str
    version: str
    routing_key: str
    team: str
    request_tokens: int
    prompt_tokens: int = 0
    cached_tokens: Mapping[str, int] | None = None


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


@dataclass(frozen=True, slots=True)
class PolicyOptions:
    """What the platform lets an operator tune about routing, with its defaults.

    ``load_factor`` is prefix affinity's bound over the pool average (the seed's
    125%). ``min_bound_tokens`` is the floor under that bound: below it no replica
    counts as overloaded, so light traffic keeps its affinity (about 15% of a 7B
    replica's tokens in flight). ``PLATFORM_AFFINITY_MIN_BOUND_TOKENS`` and the fleet
    simulator default to these values; policies without a bound ignore both.
    ``ring_choices`` limits prefix affinity's walk (0: the whole ring).
    """

    load_factor: float = 1.25
    min_bound_tokens: int = 16_384
    # How many nodes prefix affinity tries in ring order before it takes the least
    # loaded; 0: the whole ring (every key's overflow has a fixed order of homes).
    # 1 (the owner, else the least loaded) measured best: routing_ab at the seed's
    # peak, docs/fleet-simulator.md.
    ring_choices: int = 1
    # Cache-aware routing (``CacheAwarePolicy``). How many more tokens a warm
    # replica may owe in prefill than the fastest replica before a prompt leaves
    # its cache: prefill speed x the TTFT a cache may cost. An H100 running a 7B
    # model prefills about 40,000 tokens/s beside its decodes (the h100-8b
    # profile's c_tok, 0.022 ms a token, with attention on top), and a quarter of
    # the seed's 1 s TTFT target is 0.25 s: about 10,000 tokens; 8,192 keeps
    # some margin for the other gateways' requests not yet counted.
    prefill_gap_tokens: int = 8_192
    # Its ceiling on a warm replica's tokens in flight over the pool average
    # (decode work and KV memory, which prefill does not see); floored by
    # ``min_bound_tokens`` like prefix affinity's bound.
    cache_load_factor: float = 1.5

    def __post_init__(self) -> None:
        if not self.load_factor >= 1.0:
            raise ValueError("load_factor must be at least 1.0")
        if self.min_bound_tokens < 0:
            raise ValueError("min_bound_tokens must not be negative")
        if self.ring_choices < 0:
            raise ValueError("ring_choices must not be negative")
        if self.prefill_gap_tokens < 0:
            raise ValueError("prefill_gap_tokens must not be negative")
        if not self.cache_load_factor >= 1.0:
            raise ValueError("cache_load_factor must be at least 1.0")


DEFAULT_POLICY_OPTIONS: PolicyOptions = PolicyOptions()


class RoutingPolicy(Protocol):
    """Order eligible replicas for one request."""

    name: ClassVar[str]

    @classmethod
    def from_options(cls, options: PolicyOptions) -> Self:
        """Return a fresh policy configured by ``options``."""
        ...

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
            "import its module in routing/domain/policies/__init__.py instead"
        )
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__name__} must set a non-empty name: ClassVar[str]")
    if name in POLICIES:
        raise ValueError(f"routing policy {name!r} is already registered")
    POLICIES[name] = cls
    return cls


def make_policy(name: str, options: PolicyOptions | None = None) -> RoutingPolicy:
    """Return a new instance of the policy registered as ``name``.

    ``options`` default to ``DEFAULT_POLICY_OPTIONS``, the platform's defaults.

    Raises:
        KeyError: no such policy; the message lists the known names.
    """
    cls = POLICIES.get(name)
    if cls is None:
        raise KeyError(
            f"unknown routing policy {name!r}; known: {', '.join(sorted(POLICIES))}"
        )
    return cls.from_options(options or DEFAULT_POLICY_OPTIONS)


def close_registry() -> None:
    """Refuse registrations from now on (the package calls it once it has imported
    every policy module)."""
    global _closed
    _closed = True
