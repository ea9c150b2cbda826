"""A recorded trace as the failover drill's chat traffic ("what if we lose a
region", replayed on what the platform served).

Public surface: ``GUARANTEE_HEADROOM``, ``RegionTrace``, ``trace_teams``,
``split_regions``, ``ShiftedArrivals``.

- **Regions.** Each conversation lives in one region, as a global load balancer
  with sticky sessions keeps it: a seeded coin per conversation (stream) sends
  it to the region that is lost or to the survivor, so each region carries
  about half of the trace, with its own conversations' history in its own
  caches and the shared prefixes (a system prompt, a document) in both.
- **Teams.** A trace knows its teams only by their salted hashes and their tier,
  not their limits. Each traced team gets a guarantee covering its share of the
  trace's tokens (prompt plus ``max_tokens``, what admission counts) with a
  quarter to spare (``GUARANTEE_HEADROOM``), as an admin sizes guarantees from
  recorded usage: so every interactive team is *inside* its guarantee, and the
  drill's target (no interactive request inside its guarantee refused on the
  survivor) covers all interactive traffic.
- **The shift** (``ShiftedArrivals``, a ``RequestSource``): from the load
  balancer's detection on, the lost region's arrivals reach the survivor at
  their recorded times, their conversations' history in no cache there. Until
  then they reach the lost region (its run stops at detection).
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from drills.domain.replica import FleetRequest
from drills.domain.workload import Arrival, TeamSpec

__all__ = [
    "GUARANTEE_HEADROOM",
    "RegionTrace",
    "ShiftedArrivals",
    "split_regions",
    "trace_teams",
]

GUARANTEE_HEADROOM = 1.25


@dataclass(frozen=True, slots=True)
class RegionTrace:
    """The chat pool's arrivals, split between the two regions.

    ``lost`` and ``survivor`` are each region's own arrivals over the whole
    trace (the lost region's after detection are the shift); ``teams`` the
    traced teams with their guarantees; ``span_s`` the last arrival's time.
    """

    lost: tuple[Arrival, ...]
    survivor: tuple[Arrival, ...]
    teams: tuple[TeamSpec, ...]
    span_s: float

    @property
    def requests(self) -> int:
        return len(self.lost) + len(self.survivor)

    @property
    def rps(self) -> float:
        """Both regions' requests per second over the trace."""
        return self.requests / self.span_s if self.span_s > 0 else 0.0


def trace_teams(
    arrivals: Sequence[Arrival], *, headroom: float = GUARANTEE_HEADROOM
) -> tuple[TeamSpec, ...]:
    """Return each team of ``arrivals`` (its name as traced), weighted by its
    share of the trace's tokens, with the tier most of its requests have and a
    guarantee of ``headroom`` times that share (at most the whole pool).

    Raises ``ValueError`` for no arrivals or a headroom below 1.
    """
    if not arrivals:
        raise ValueError("the trace has no requests")
    if headroom < 1.0:
        raise ValueError("headroom must be at least 1")
    tokens: Counter[str] = Counter()
    tiers: defaultdict[str, Counter[str]] = defaultdict(Counter)
    for arrival in arrivals:
        tokens[arrival.team] += arrival.prompt_tokens + arrival.max_tokens
        tiers[arrival.team][arrival.tier] += 1
    total = sum(tokens.values())
    return tuple(
        TeamSpec(
            name,
            weight=tokens[name] / total,
            tier=tiers[name].most_common(1)[0][0],
            guaranteed_share=min(1.0, headroom * tokens[name] / total),
        )
        for name in sorted(tokens)
    )


def split_regions(
    arrivals: Sequence[Arrival], *, seed: int, headroom: float = GUARANTEE_HEADROOM
) -> RegionTrace:
    """Split ``arrivals`` (in time order) between the lost region and the
    survivor, a seeded coin per conversation."""
    rng = random.Random(f"{seed}:regions")
    region: dict[int, bool] = {}
    lost: list[Arrival] = []
    survivor: list[Arrival] = []
    for arrival in arrivals:
        is_lost = region.get(arrival.conversation)
        if is_lost is None:
            is_lost = region[arrival.conversation] = rng.random() < 0.5
        (lost if is_lost else survivor).append(arrival)
    return RegionTrace(
        lost=tuple(lost),
        survivor=tuple(survivor),
        teams=trace_teams(arrivals, headroom=headroom),
        span_s=arrivals[-1].at if arrivals else 0.0,
    )


class ShiftedArrivals:
    """The lost region's recorded arrivals reaching the survivor from
    ``start_at`` on, each at its own time (a ``RequestSource``); not retried."""

    def __init__(self, arrivals: Sequence[Arrival], *, start_at: float) -> None:
        self._arrivals = [a for a in arrivals if a.at >= start_at]
        self._next = 0
        self.sent = 0

    def tick(self, now: float, send: Callable[[Arrival], FleetRequest]) -> float | None:
        while self._next < len(self._arrivals):
            arrival = self._arrivals[self._next]
            if arrival.at > now:
                return arrival.at
            send(arrival)
            self.sent += 1
            self._next += 1
        return None

    def ended(self, request: FleetRequest, retry_after_s: float | None) -> None:
        return None
