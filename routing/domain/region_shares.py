"""Each region's share of a team's limits, one contract across regions.

Public surface: ``RegionalLimits``, ``region_shares``, ``regional_limits``,
``demand_slot``, ``demand_slot_key``, ``shares_key``, ``DEFAULT_FIELD``.

A team's ``tokens_per_minute`` and ``max_concurrency`` on a model hold over every
region together. Each region keeps its own bucket on the hot path (its own Redis,
no cross-region call per request), sized to the region's share of the limit. The
share follows the region's recent part of the team's demand (tokens asked for,
admitted or refused, over a window) with a floor per region, so that a quiet
region can start and be seen asking; a region whose figures stopped arriving
(older than ``stale_after_s``) is lost and its part goes to the others. Shares
always sum to 1 over the regions a computation counts as live.

The region's control loop (``control.region_limits``) computes the shares every
few seconds from every region's figures in the control plane and writes them to
its Redis; the gateways size the bucket from them (``regional_limits``). The
bound this gives is in ``docs/platform-admins.md`` ("One limit across regions").

Redis layout (one region's Redis): the gateways add each charge's tokens to the
hash ``<prefix>:limit-demand:<slot>`` (field ``team:model``, a slot per
``slot_s`` seconds of unix time); the loop writes the hash
``<prefix>:limit-shares`` (field ``team:model`` -> share, and ``*`` for pairs
no region asked for lately). The shares have no expiry: with the control plane
down a region keeps its last ones.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "DEFAULT_FIELD",
    "RegionalLimits",
    "demand_slot",
    "demand_slot_key",
    "region_shares",
    "regional_limits",
    "shares_key",
]

# The shares hash's field for every pair that has none of its own.
DEFAULT_FIELD = "*"


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


def _tokens(value: float) -> float:
    return value if value > 0 and math.isfinite(value) else 0.0
