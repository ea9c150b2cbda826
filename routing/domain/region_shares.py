"""Each region's share of a team's limits, one contract across regions.

Public surface: ``RegionalLimits``, ``region_shares``, ``regional_limits``,
``ShareOptions``, ``DemandRow``, ``share_tick`` and its effects ``ReadDemand``,
``PublishDemand`` and ``WriteShares``, ``demand_slot``, ``demand_slot_key``,
``shares_key``, ``DEFAULT_FIELD``.

A team's ``tokens_per_minute`` and ``max_concurrency`` on a model hold over every
region together. Each region keeps its own bucket on the hot path (its own Redis,
no cross-region call per request), sized to the region's share of the limit. The
share follows the region's recent part of the team's demand (tokens asked for,
admitted or refused, over a window) with a floor per region, so that a quiet
region can start and be seen asking; a region whose figures stopped arriving
(older than ``stale_after_s``) is lost and its part goes to the others. Shares
always sum to 1 over the regions a computation counts as live.

The region's control loop computes the shares every few seconds from every
region's figures in the control plane and writes them to its Redis; the gateways
size the bucket from them (``regional_limits``). The loop is ``share_tick``, a
generator of effects (read the region's demand, publish it and read every
region's rows, write the shares) with two interpreters: ``control.region_limits``
(Redis and the ORM) and the drill (``drills.domain.region_limits``, virtual time).
The bound this gives is in ``docs/platform-admins.md`` ("One limit across regions").

Redis layout (one region's Redis): the gateways add each charge's tokens to the
hash ``<prefix>:limit-demand:<slot>`` (field ``team:model``, a slot per
``slot_s`` seconds of unix time); the loop writes the hash
``<prefix>:limit-shares`` (field ``team:model`` -> share, and ``*`` for pairs
no region asked for lately). The shares have no expiry: with the control plane
down a region keeps its last ones.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Mapping
from dataclasses import dataclass

__all__ = [
    "BEAT_KEY",
    "DEFAULT_FIELD",
    "DemandRow",
    "PublishDemand",
    "ReadDemand",
    "RegionalLimits",
    "ShareOptions",
    "WriteShares",
    "demand_slot",
    "demand_slot_key",
    "region_shares",
    "regional_limits",
    "share_tick",
    "shares_key",
]

# The shares hash's field for every pair that has none of its own.
DEFAULT_FIELD = "*"
# A region's beat row in the control plane (``DemandRow``): no key.
BEAT_KEY = ""


def demand_slot(now: float, slot_s: float) -> int:
    """Return the number of the demand slot holding unix time ``now``."""
    return math.floor(now / slot_s)


def demand_slot_key(prefix: str, slot: int) -> str:
    """Return the Redis key of one slot of a region's demand."""
    return f"{prefix}:limit-demand:{slot}"


def shares_key(prefix: str) -> str:
    """Return the Redis key of a region's shares of its teams' limits."""
    return f"{prefix}:limit-shares"


def region_shares(
    *,
    own_region: str,
    heard_at: Mapping[str, float],
    demand: Mapping[str, float],
    now: float,
    floor: float,
    stale_after_s: float,
) -> dict[str, float]:
    """Return each live region's share of one team's limit on one model.

    ``heard_at`` is when each region last published its figures (unix seconds);
    ``demand`` its tokens asked for over the window (absent: none). A region not
    heard within ``stale_after_s`` of ``now`` is lost and gets nothing; the own
    region is always live (it is the one computing). Each live region gets
    ``floor`` (at most an equal split) plus its part of the demand of the rest;
    without any demand, an equal split. The result sums to 1.

    Raises:
        ValueError: ``floor`` outside [0, 1] or ``stale_after_s`` not positive.
    """
    if not 0.0 <= floor <= 1.0:
        raise ValueError("floor must be between 0 and 1")
    if not stale_after_s > 0:
        raise ValueError("stale_after_s must be a positive number of seconds")
    live = sorted(
        {own_region}
        | {
            region
            for region, at in heard_at.items()
            if now - at <= stale_after_s and math.isfinite(at)
        }
    )
    if len(live) == 1:
        return {own_region: 1.0}
    n = len(live)
    base = min(floor, 1.0 / n)
    asked = {region: _tokens(demand.get(region, 0.0)) for region in live}
    total = sum(asked.values())
    if total <= 0:
        return {region: 1.0 / n for region in live}
    rest = 1.0 - n * base
    return {region: base + rest * asked[region] / total for region in live}


@dataclass(frozen=True, slots=True)
class RegionalLimits:
    """What one region enforces of a team's limits on a model."""

    capacity: int
    refill_per_s: float
    max_concurrency: int


def regional_limits(
    *, tokens_per_minute: int, max_concurrency: int, share: float, amount: int
) -> RegionalLimits:
    """Return the region's part of the limits, for a charge of ``amount`` tokens.

    The bucket holds ``share`` of ``tokens_per_minute`` and refills at ``share``
    of its rate; it holds the request's whole charge if that is more (at most the
    team's limit), so a request the team's limit allows never becomes a 400 in a
    region with a small share (one such request per refill above the share, as in
    ``routing.domain.limit_share``). The concurrency cap is ``share`` of
    ``max_concurrency``, rounded down, at least 1. A share of 1 (or more, or not
    a number) is the team's whole limits, unchanged.
    """
    if not share < 1.0 or tokens_per_minute <= 0:
        return RegionalLimits(
            tokens_per_minute, tokens_per_minute / 60.0, max_concurrency
        )
    share = max(0.0, share)
    tokens = share * tokens_per_minute
    capacity = max(math.floor(tokens), min(amount, tokens_per_minute), 1)
    slots = (
        max(1, math.floor(max_concurrency * share + 1e-9))
        if max_concurrency > 0
        else max_concurrency
    )
    # Never a zero rate: a region at a zero share still refills, slowly.
    refill_per_s = max(tokens, 1.0) / 60.0
    return RegionalLimits(capacity, refill_per_s, slots)


@dataclass(frozen=True, slots=True)
class ShareOptions:
    """The tick's bounds (``PLATFORM_LIMIT_SHARES_*``)."""

    window_s: float = 30.0
    slot_s: float = 5.0
    floor: float = 0.04
    stale_after_s: float = 6.0


@dataclass(frozen=True, slots=True)
class DemandRow:
    """One region's demand on one key as the control plane holds it.

    The empty key is the region's beat: it is live while that row is fresh.
    """

    region: str
    limit_key: str
    demand_tokens: float
    heard_at: float


@dataclass(frozen=True, slots=True)
class ReadDemand:
    """Return the region's tokens asked per key in slots ``first_slot..last_slot``."""

    first_slot: int
    last_slot: int


@dataclass(frozen=True, slots=True)
class PublishDemand:
    """Publish the region's demand (and beat) at ``heard_at``; drop its other keys;
    answer with every region's rows."""

    region: str
    demand: Mapping[str, int]
    heard_at: float


@dataclass(frozen=True, slots=True)
class WriteShares:
    """Replace the region's shares (``shares_key``) with these."""

    shares: Mapping[str, float]


Effect = ReadDemand | PublishDemand | WriteShares
Tick = Generator[Effect, Mapping[str, int] | list[DemandRow] | None, dict[str, float]]


def share_tick(*, region: str, now: float, options: ShareOptions) -> Tick:
    """Run one tick of ``region``'s limit shares at unix time ``now``; return them.

    The shares written are one per key some live region asked for, and
    ``DEFAULT_FIELD`` for every other key. An effect that fails (Redis or the
    control plane away) ends the tick there: the shares stay as last written.
    """
    demand = yield ReadDemand(
        first_slot=demand_slot(now - options.window_s, options.slot_s),
        last_slot=demand_slot(now, options.slot_s),
    )
    assert isinstance(demand, Mapping)
    rows = yield PublishDemand(region=region, demand=dict(demand), heard_at=now)
    assert isinstance(rows, list)
    heard_at: dict[str, float] = {}
    by_key: dict[str, dict[str, float]] = {}
    for row in rows:
        if row.limit_key == BEAT_KEY:
            heard_at[row.region] = max(
                row.heard_at, heard_at.get(row.region, -math.inf)
            )
        elif now - row.heard_at <= options.stale_after_s:
            by_key.setdefault(row.limit_key, {})[row.region] = row.demand_tokens

    def share_of(asked: Mapping[str, float]) -> float:
        return region_shares(
            own_region=region,
            heard_at=heard_at,
            demand=asked,
            now=now,
            floor=options.floor,
            stale_after_s=options.stale_after_s,
        )[region]

    shares = {key: share_of(asked) for key, asked in sorted(by_key.items())}
    shares[DEFAULT_FIELD] = share_of({})
    yield WriteShares(shares)
    return shares


def _tokens(value: float) -> float:
    return value if value > 0 and math.isfinite(value) else 0.0
