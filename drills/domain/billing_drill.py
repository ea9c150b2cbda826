"""The billing drill's arithmetic: what the clients were told, what the platform
bills, and whether they agree (``manage.py billing_drill``).

Public surface: ``Figures``, ``Told``, ``Expected``, ``Line``, ``BillingReport``,
``expected_of``, ``compare``, ``cost_checks``, ``SOURCES``.

Every stream a client sent ends one of three ways:
- **complete**: its final event told the client its usage (prompt, cached and
  completion tokens). The bill must hold exactly those tokens.
- **cut**: the client closed it after a few chunks and was told nothing. The
  platform bills what it relayed until the cut (``routing.responses.FinalUsage.of``
  without the engine's usage chunk): the gateway's prompt count, no cached tokens,
  and the content events it forwarded less the role chunk. The client can only
  bound that: one request, no cached tokens, at least the tokens it read and at
  most ``max_tokens``; the prompt is the one a complete stream with the same
  messages was told (the gateway counts it the same way).
- **refused**: billed nothing, counted in ``rate_limited`` when a 429 (a team's
  limit) and in ``shed`` when a 503 (admission shed its tier, or no replica
  answered), each exactly: the drill sends a share of its streams at the batch
  tier, which a low ``PLATFORM_BATCH_CEILING`` sheds.

``compare`` puts each source the platform reads (the usage rows through the
report's JSON, its CSV, a team's ``/v1/organization/usage/completions``) beside
the told figures, per region and in total: a source must equal the others to the
token, and the told figures exactly where they are exact (the cut streams'
tokens inside their bounds). ``cost_checks`` recomputes each region's USD from the
report's own pools lines and token weights (``metering.domain.cost.allocate``'s
rule) and compares it with the USD the report bills.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

__all__ = [
    "SOURCES",
    "BillingReport",
    "CostCheck",
    "Expected",
    "Figures",
    "Line",
    "Told",
    "compare",
    "cost_checks",
    "expected_of",
]

# The platform's readings, in the table's order.
SOURCES = ("rows", "csv", "org")
TOTAL = "total"
# USD is rounded to 6 digits in the report; a sum of n rounded values may be off
# by n half-units.
USD_TOLERANCE = 1e-5

Outcome = Literal["complete", "cut", "refused"]


@dataclass(frozen=True, slots=True)
class Figures:
    """What one team used in one region, as a bill counts it."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    rate_limited: int = 0  # 429s
    shed: int = 0  # 503s

    def __add__(self, other: Figures) -> Figures:
        return Figures(
            *(getattr(self, f.name) + getattr(other, f.name) for f in fields(self))
        )

    def minus(self, other: Figures) -> Figures:
        return Figures(
            *(getattr(self, f.name) - getattr(other, f.name) for f in fields(self))
        )

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


FIGURE_FIELDS = tuple(f.name for f in fields(Figures))


@dataclass(frozen=True, slots=True)
class Told:
    """One stream as its client saw it."""

    team: str
    region: str
    outcome: Outcome
    prompt_tokens: int = 0  # complete: the final event's
    cached_tokens: int = 0
    completion_tokens: int = 0
    tokens_seen: int = 0  # cut: content chunks read before the cut
    max_tokens: int = 0
    status: int = 200


@dataclass(frozen=True, slots=True)
class Expected:
    """What the bill of one team in one region must hold: ``low`` <= bill <=
    ``high`` field by field (equal where the clients were told exactly)."""

    low: Figures = field(default_factory=Figures)
    high: Figures = field(default_factory=Figures)
    cut: int = 0

    def __add__(self, other: Expected) -> Expected:
        return Expected(
            self.low + other.low, self.high + other.high, self.cut + other.cut
        )

    def holds(self, bill: Figures) -> bool:
        return all(
            getattr(self.low, f) <= getattr(bill, f) <= getattr(self.high, f)
            for f in FIGURE_FIELDS
        )


def expected_of(told: Iterable[Told]) -> dict[tuple[str, str], Expected]:
    """Return what each (team, region) must be billed for the streams ``told``.

    A cut stream's prompt is the one complete streams of its team were told (the
    drill sends every stream the same messages); without one, 0 to unbounded is
    all that can be said, so the caller should send complete streams too.
    """
    told = list(told)
    prompts = {t.prompt_tokens for t in told if t.outcome == "complete"}
    prompt_low = min(prompts, default=0)
    prompt_high = max(prompts, default=1 << 30)
    found: dict[tuple[str, str], Expected] = defaultdict(Expected)
    for t in told:
        if t.outcome == "complete":
            exact = Figures(1, t.prompt_tokens, t.cached_tokens, t.completion_tokens)
            add = Expected(exact, exact)
        elif t.outcome == "cut":
            add = Expected(
                Figures(1, prompt_low, 0, t.tokens_seen),
                Figures(1, prompt_high, 0, max(t.max_tokens, t.tokens_seen)),
                cut=1,
            )
        else:
            one = Figures(shed=1) if t.status == 503 else Figures(rate_limited=1)
            add = Expected(one, one)
        found[(t.team, t.region)] = found[(t.team, t.region)] + add
    return dict(found)


@dataclass(frozen=True, slots=True)
class Line:
    """One line of the table: a region (or the total), each source's figures, the
    told bounds, and each source's difference from them (0 inside the bounds)."""

    region: str
    told: Expected
    sources: dict[str, Figures]
    differences: dict[str, Figures]

    @property
    def passed(self) -> bool:
        zero = Figures()
        return all(d == zero for d in self.differences.values())

    def beyond_read(self, source: str) -> int:
        """Output tokens ``source`` bills past what the clients read: the cut
        streams' tokens the gateway relayed after their clients' last read (0
        without cut streams, when the rest is exact)."""
        return self.sources[source].output_tokens - self.told.low.output_tokens


def _outside(bill: Figures, told: Expected) -> Figures:
    """Return how far each field of ``bill`` is outside ``told``'s bounds."""
    values = []
    for f in FIGURE_FIELDS:
        n, lo, hi = getattr(bill, f), getattr(told.low, f), getattr(told.high, f)
        values.append(n - hi if n > hi else n - lo if n < lo else 0)
    return Figures(*values)


@dataclass(frozen=True, slots=True)
class CostCheck:
    """One region's USD: what the report bills the drill's teams, and what the cost
    model gives from the report's own pools lines and token weights."""

    region: str
    billed_usd: float
    model_usd: float
    gpu_usd: float
    teams_and_idle_usd: float

    @property
    def difference(self) -> float:
        return round(self.billed_usd - self.model_usd, 6)

    @property
    def passed(self) -> bool:
        return (
            abs(self.billed_usd - self.model_usd) <= USD_TOLERANCE
            and abs(self.gpu_usd - self.teams_and_idle_usd) <= USD_TOLERANCE
        )


@dataclass(frozen=True, slots=True)
class BillingReport:
    """The drill's lines (per region, then the total), the USD checks and the
    sources that disagree with each other."""

    lines: tuple[Line, ...]
    costs: tuple[CostCheck, ...]
    sources_apart: tuple[str, ...]
    streams: Mapping[str, int]

    @property
    def passed(self) -> bool:
        return (
            all(line.passed for line in self.lines)
            and all(c.passed for c in self.costs)
            and not self.sources_apart
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "streams": dict(self.streams),
            "lines": [
                {
                    "region": line.region,
                    "passed": line.passed,
                    "told_low": line.told.low.as_dict(),
                    "told_high": line.told.high.as_dict(),
                    "cut_streams": line.told.cut,
                    "output_beyond_read": {
                        name: line.beyond_read(name) for name in line.sources
                    },
                    **{
                        name: figures.as_dict()
                        for name, figures in line.sources.items()
                    },
                    "difference": {
                        name: d.as_dict() for name, d in line.differences.items()
                    },
                }
                for line in self.lines
            ],
            "usd": [
                {**asdict(c), "difference": c.difference, "passed": c.passed}
                for c in self.costs
            ],
            "sources_apart": list(self.sources_apart),
        }


def compare(
    told: Sequence[Told],
    sources: Mapping[str, Mapping[tuple[str, str], Figures]],
    *,
    regions: Sequence[str],
    teams: Sequence[str],
    costs: Sequence[CostCheck] = (),
) -> BillingReport:
    """Compare each source with the told figures, per region and in total.

    ``sources`` maps a source's name to its figures per (team, region). A source
    must also equal every other source per team and region, to the token.
    """
    expected = expected_of(told)
    keys = sorted(
        {(team, region) for team in teams for region in regions}
        | {k for k in expected if k[0] in teams}
    )
    # Each team's bill in each region is held to its own bounds, then the
    # differences are added up: one region's slack (a cut stream's) never hides
    # another's excess.
    outside = {
        name: {
            k: _outside(f.get(k, Figures()), expected.get(k, Expected())) for k in keys
        }
        for name, f in sources.items()
    }
    lines = []
    for region in [*regions, TOTAL]:
        mine = [k for k in keys if region in (TOTAL, k[1])]
        lines.append(
            Line(
                region=region,
                told=sum((expected.get(k, Expected()) for k in mine), Expected()),
                sources={
                    name: sum((f.get(k, Figures()) for k in mine), Figures())
                    for name, f in sources.items()
                },
                differences={
                    name: sum((by[k] for k in mine), Figures())
                    for name, by in outside.items()
                },
            )
        )
    apart = []
    names = list(sources)
    for name in names[1:]:
        for key in keys:
            a = sources[names[0]].get(key, Figures())
            b = sources[name].get(key, Figures())
            if a != b:
                apart.append(f"{name} != {names[0]} for {key[0]} in {key[1]}")
    counts: dict[str, int] = defaultdict(int)
    for t in told:
        counts[t.outcome] += 1
        if t.outcome == "refused":
            counts[f"refused_{t.status}"] += 1
    return BillingReport(
        lines=tuple(lines),
        costs=tuple(costs),
        sources_apart=tuple(apart),
        streams={"sent": len(told), **counts},
    )


def cost_checks(report: Mapping[str, Any], teams: Sequence[str]) -> list[CostCheck]:
    """Recompute each region's USD for ``teams`` from a usage report's JSON.

    Per model and region: the pools' USD (GPU-hours at the region's price) and
    capacity (serving hours times tokens a second); the teams carry the used part,
    ``usd * min(1, W / capacity)``, split by weighted tokens (``W`` all teams'),
    the rest is idle. Assumes one version per model and region in the window, as
    the drill's platform has.
    """
    weights = report["weights"]
    by_region = report.get("gpu_hour_usd_by_region") or {}
    default = float(report["gpu_hour_usd"])
    pool_usd: dict[tuple[str, str], float] = defaultdict(float)
    capacity: dict[tuple[str, str], float] = defaultdict(float)
    region_gpu: dict[str, float] = defaultdict(float)
    for pool in report["pools"]:
        key = (pool["model"], pool["region"])
        price = float(by_region.get(pool["region"], default))
        usd = pool["gpu_hours"] * price
        pool_usd[key] += usd
        region_gpu[pool["region"]] += pool["usd"]
        capacity[key] += (
            pool["serving_replica_hours"] * 3600 * pool["tokens_per_s_per_replica"]
        )
    weight: dict[tuple[str, str], float] = defaultdict(float)
    team_weight: dict[tuple[str, str, str], float] = defaultdict(float)
    for row in report["data"]:
        w = (
            weights["prompt"] * (row["prompt_tokens"] - row["cached_tokens"])
            + weights["cached"] * row["cached_tokens"]
            + weights["output"] * row["output_tokens"]
        )
        weight[(row["model"], row["region"])] += w
        team_weight[(row["team"], row["model"], row["region"])] += w
    billed: dict[str, float] = defaultdict(float)
    modelled: dict[str, float] = defaultdict(float)
    for row in report["data"]:
        if row["team"] in teams:
            billed[row["region"]] += row["usd"]
    for (team, model, region), w in team_weight.items():
        if team not in teams or w <= 0:
            continue
        total = weight[(model, region)]
        cap = capacity[(model, region)]
        busy = min(1.0, total / cap) if cap > 0 else 1.0
        modelled[region] += pool_usd[(model, region)] * busy * w / total
    accounted: dict[str, float] = defaultdict(float)
    for row in [*report["data"], *report["idle"]]:
        accounted[row["region"]] += row["usd"]
    regions = sorted(set(billed) | set(modelled) | set(region_gpu))
    return [
        CostCheck(
            region=r,
            billed_usd=round(billed[r], 6),
            model_usd=round(modelled[r], 6),
            gpu_usd=round(region_gpu[r], 6),
            teams_and_idle_usd=round(accounted[r], 6),
        )
        for r in regions
    ]
