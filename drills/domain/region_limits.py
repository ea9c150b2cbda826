"""One team limit across two regions, in virtual time: the drill's simulation.

Public surface: ``RegionLimitsScenario``, ``RegionLimitsReport``, ``Check``,
``run_region_limits``.

Two regions, each with its bucket per team (``LimitTable``, sized by the region's
share as the gateway sizes it: ``AdmissionRequest.regional``), its gateways'
demand slots and shares (exchanged once a second), and its share tick
(``routing.domain.region_shares.share_tick``, the generator the live loop runs,
interpreted here over dicts) every ``interval_s``. Two teams at three times their
limit: ``both`` drives both regions (half each, then shifting to 90% east), ``one``
only east. At ``loss_at_s`` west is lost (its tick and gateways stop).

Measured against the issue's targets: over every minute after the first (a cold
bucket's burst is the same with one region), ``both`` is admitted at most 110% of
its limit; ``one`` at least 95%; after the loss, east holds ``both``'s whole limit
within 10 s.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from routing.domain.admission_control import AdmissionRequest
from routing.domain.limit_table import BucketTable
from routing.domain.region_shares import (
    BEAT_KEY,
    DEFAULT_FIELD,
    DemandRow,
    PublishDemand,
    ReadDemand,
    ShareOptions,
    demand_slot,
    share_tick,
)
from routing.domain.snapshot import LimitRecord
from routing.domain.tiers import Tier

__all__ = ["Check", "RegionLimitsReport", "RegionLimitsScenario", "run_region_limits"]

REGIONS = ("east", "west")
MODEL = "chat-7b"


@dataclass(frozen=True, slots=True)
class RegionLimitsScenario:
    """The drill's shape; the defaults are the platform's settings."""

    tokens_per_minute: int = 600_000  # the seed's demo team limit
    request_tokens: int = 2_000  # prompt + max_tokens of every request
    overdrive: float = 3.0  # demand over the limit
    shift_at_s: float = 120.0  # ``both`` moves to 90% east
    loss_at_s: float = 240.0  # west lost
    duration_s: float = 300.0
    step_s: float = 0.05
    exchange_s: float = 1.0  # gateways: demand out, shares in
    interval_s: float = 2.0  # each region's share tick
    options: ShareOptions = field(default_factory=ShareOptions)
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Check:
    """One target, what was measured, and whether it held."""

    name: str
    measured: float
    target: str
    passed: bool


@dataclass(frozen=True, slots=True)
class RegionLimitsReport:
    """Per-minute admitted fractions of the limit, shares over time, the checks."""

    both_minutes: list[tuple[float, float]]  # (minute's end s, admitted / limit)
    one_minutes: list[tuple[float, float]]
    shares: list[tuple[float, float, float, float]]  # (t, both east, both west, one)
    survivor_s: float
    checks: list[Check]

    @property
    def passed(self) -> bool:
        """Whether every target held."""
        return all(check.passed for check in self.checks)

    def as_dict(self) -> dict[str, object]:
        """Return every figure, for ``--json``."""
        return {
            "both_minutes": self.both_minutes,
            "one_minutes": self.one_minutes,
            "shares": self.shares,
            "survivor_s": self.survivor_s,
            "checks": [
                {
                    "name": c.name,
                    "measured": c.measured,
                    "target": c.target,
                    "passed": c.passed,
                }
                for c in self.checks
            ],
            "passed": self.passed,
        }


@dataclass
class _Region:
    name: str
    buckets: BucketTable = field(default_factory=BucketTable)
    slots: dict[int, dict[str, int]] = field(default_factory=dict)  # its Redis
    shares: dict[str, float] = field(default_factory=dict)  # its Redis
    seen: dict[str, float] = field(default_factory=dict)  # its gateways' copy
    unsent: dict[str, int] = field(default_factory=dict)
    is_up: bool = True


def run_region_limits(scenario: RegionLimitsScenario) -> RegionLimitsReport:
    """Run the scenario in virtual time; return the report."""
    rng = random.Random(scenario.seed)
    regions = {name: _Region(name) for name in REGIONS}
    plane: dict[tuple[str, str], DemandRow] = {}  # the control plane's rows
    limits = {
        team: LimitRecord(team, MODEL, scenario.tokens_per_minute, 10**6, 0.0)
        for team in ("both", "one")
    }
    rate_rps = (
        scenario.overdrive * scenario.tokens_per_minute / 60.0 / scenario.request_tokens
    )
    admitted: dict[str, list[tuple[float, int]]] = {"both": [], "one": []}
    shares: list[tuple[float, float, float, float]] = []
    steps = round(scenario.duration_s / scenario.step_s)
    tick_at = {"east": 0.0, "west": scenario.interval_s / 2}
    exchange_every = round(scenario.exchange_s / scenario.step_s)
    for i in range(steps):
        now = i * scenario.step_s
        if now >= scenario.loss_at_s:
            regions["west"].is_up = False
        east_part = 0.5 if now < scenario.shift_at_s else 0.9
        arrivals = [
            ("both", "east", rate_rps * east_part),
            ("both", "west", rate_rps * (1 - east_part)),
            ("one", "east", rate_rps),
        ]
        for team, name, rps in arrivals:
            region = regions[name]
            if region.is_up:
                for _ in range(_poisson(rng, rps * scenario.step_s)):
                    amount = _arrive(region, team, limits[team], scenario, now)
                    if amount:
                        admitted[team].append((now, amount))
        for region in regions.values():
            if region.is_up:
                _control(
                    region,
                    plane,
                    tick_at,
                    now,
                    scenario,
                    is_exchange=i % exchange_every == 0,
                )
        east = regions["east"].seen
        shares.append(
            (
                round(now, 3),
                _share(east, request_key("both")),
                _share(regions["west"].seen, request_key("both")),
                _share(east, request_key("one")),
            )
        )
    survivor_s = next(
        (
            t - scenario.loss_at_s
            for t, east, _, _ in shares
            if t >= scenario.loss_at_s and east >= 1.0
        ),
        float("inf"),
    )
    limit = scenario.tokens_per_minute
    both = _minutes(admitted["both"], limit, scenario.duration_s)
    one = _minutes(admitted["one"], limit, scenario.loss_at_s)
    every_s = round(1 / scenario.step_s)
    checks = _checks(both, one, survivor_s)
    return RegionLimitsReport(both, one, shares[::every_s], survivor_s, checks)


def _arrive(
    region: _Region,
    team: str,
    limit: LimitRecord,
    scenario: RegionLimitsScenario,
    now: float,
) -> int:
    """Charge one request to the team's bucket here; return the tokens admitted."""
    request = AdmissionRequest(
        team=team,
        model=MODEL,
        version="v1",
        tier=Tier.STANDARD,
        prompt_tokens=scenario.request_tokens // 2,
        max_tokens=scenario.request_tokens - scenario.request_tokens // 2,
        limit=limit,
        region_share=_share(region.seen, request_key(team)),
    )
    key = request.limit_key
    amount = request.charge_tokens
    region.unsent[key] = region.unsent.get(key, 0) + amount
    sized = request.regional(amount)
    charge = region.buckets.charge(
        key,
        capacity=sized.capacity,
        refill_per_s=sized.refill_per_s,
        amount=amount,
        now=now,
    )
    return amount if charge.allowed else 0


def _control(
    region: _Region,
    plane: dict[tuple[str, str], DemandRow],
    tick_at: dict[str, float],
    now: float,
    scenario: RegionLimitsScenario,
    *,
    is_exchange: bool,
) -> None:
    """A region's side of one step: its gateways' exchange, its share tick."""
    if is_exchange:
        _exchange(region, now, scenario.options.slot_s)
    if now + 1e-9 >= tick_at[region.name]:
        tick_at[region.name] += scenario.interval_s
        _tick(region, plane, now, scenario.options)


def _exchange(region: _Region, now: float, slot_s: float) -> None:
    """The gateways' exchange: demand noted since out, the shares in."""
    bucket = region.slots.setdefault(demand_slot(now, slot_s), {})
    for key, tokens in region.unsent.items():
        bucket[key] = bucket.get(key, 0) + tokens
    region.unsent = {}
    region.seen = dict(region.shares)


def _checks(
    both: list[tuple[float, float]], one: list[tuple[float, float]], survivor_s: float
) -> list[Check]:
    worst_both = max((f for end, f in both if end >= 120.0), default=0.0)
    least_one = min((f for end, f in one if end >= 120.0), default=0.0)
    return [
        Check(
            "both regions: admitted per minute / limit (max after the first minute)",
            round(worst_both, 4),
            "<= 1.10",
            worst_both <= 1.10,
        ),
        Check(
            "one region: admitted per minute / limit (min after the first minute)",
            round(least_one, 4),
            ">= 0.95",
            least_one >= 0.95,
        ),
        Check(
            "survivor holds the whole limit, s after the loss",
            round(survivor_s, 2),
            "<= 10",
            survivor_s <= 10.0,
        ),
    ]


def request_key(team: str) -> str:
    """Return the gateway's key of ``team``'s bucket on the drill's model."""
    return f"{team}:{MODEL}"


def _share(seen: Mapping[str, float], key: str) -> float:
    return seen.get(key, seen.get(DEFAULT_FIELD, 1.0))


def _tick(
    region: _Region,
    plane: dict[tuple[str, str], DemandRow],
    now: float,
    options: ShareOptions,
) -> None:
    """Drive one ``share_tick`` over the region's dicts and the control plane's."""
    tick = share_tick(region=region.name, now=now, options=options)
    reply: Mapping[str, int] | list[DemandRow] | None = None
    while True:
        try:
            effect = tick.send(reply)
        except StopIteration:
            return
        if isinstance(effect, ReadDemand):
            totals: dict[str, int] = {}
            for slot in range(effect.first_slot, effect.last_slot + 1):
                for key, tokens in region.slots.get(slot, {}).items():
                    totals[key] = totals.get(key, 0) + tokens
            reply = totals
        elif isinstance(effect, PublishDemand):
            for key in [k for (r, k) in plane if r == effect.region]:
                if key != BEAT_KEY and key not in effect.demand:
                    del plane[(effect.region, key)]
            for key, tokens in [(BEAT_KEY, 0), *effect.demand.items()]:
                plane[(effect.region, key)] = DemandRow(
                    effect.region, key, tokens, effect.heard_at
                )
            reply = list(plane.values())
        else:
            region.shares = dict(effect.shares)
            reply = None


def _minutes(
    admitted: list[tuple[float, int]], limit: int, end_s: float
) -> list[tuple[float, float]]:
    """Return the admitted tokens / limit over every minute ending each 10 s."""
    result = []
    end = 60.0
    while end <= end_s + 1e-9:
        tokens = sum(n for at, n in admitted if end - 60.0 <= at < end)
        result.append((end, round(tokens / limit, 4)))
        end += 10.0
    return result


def _poisson(rng: random.Random, mean: float) -> int:
    # Knuth's method: means here are well below 10 per step.
    limit, product, count = pow(2.718281828459045, -mean), rng.random(), 0
    while product > limit:
        product *= rng.random()
        count += 1
    return count
