"""The overload drill: arrivals step past the pool's capacity with every tier.

Public surface: ``DEFAULT_TEAMS``, ``TIERS``, ``OverloadScenario``, ``TierRow``, ``StepRow``,
``Bins``, ``Check``, ``OverloadOutcome``, ``planned_capacity_rps``,
``run_overload``.

The seed's order under overload: "batch pauses first, then teams above their
guaranteed share get a 429, then standard requests queue. Interactive traffic
inside a guarantee is never shed." The fleet runs the gateway's tiered admission
(``routing.domain.admission.AdmissionQueue``) with ``FleetConfig(admission=True)``;
the arrival rate is ``capacity_rps`` times each factor in turn (``rate`` events),
each held for ``step_s`` after a warm-up at the first factor.

``capacity_rps`` (what x1.0 means) is the plan's figure by default
(``planned_capacity_rps``): replicas x the planned output tokens/s per replica
(the seed's 2,500) / answer tokens, 100 requests/s for the seed's 12 replicas. The
simulator's own knee may lie below it (prefill costs compute the output-token
count hides); the drill reports what happens, not what the plan hoped.

A request *waited* when it was routed later than it arrived (the admission queue
held it) or was shed from the queue; times of 429s and sheds are arrival times
(the gateway answers a 429 at once; a shed request is reported at the bin it
arrived in, like its TTFT).

The checks (``Check``), each judged on the measured window:

- ``batch_pauses_first``: the first batch request to wait or be shed arrived no
  later than the first 429 and the first standard or interactive request that
  waited or was shed.
- ``over_share_429_before_standard_queues``: the first 429 falls in a bin no later
  than the first bin in which a standard request waited or was shed. A full pool
  refuses over-share teams and queues the others at the same moment, so the order
  is judged per bin (``bin_s``), not per request.
- ``standard_shed_after_batch``: no standard request is shed before (in an earlier
  bin than) the first batch request is shed.
- ``interactive_inside_guarantee_never_shed``: interactive teams whose guaranteed
  share covers their part of the traffic at the highest factor
  (``guaranteed_share >= weight share x max factor``) see no 429 and no 503.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from drills.domain.fleet import FleetSim
from drills.domain.fleet_config import FleetConfig, FleetEvent
from drills.domain.fleet_result import FleetResult
from drills.domain.replica import FleetRequest
from drills.domain.timeline import (
    bin_starts,
    count_in_bins,
    max_in_bins,
    percentile_in_bins,
)
from drills.domain.workload import ChatWorkload, TeamSpec
from routing.domain.tiers import Tier
from simengine.domain.percentiles import percentile as nearest_rank

__all__ = [
    "DEFAULT_TEAMS",
    "TIERS",
    "Bins",
    "Check",
    "OverloadOutcome",
    "OverloadScenario",
    "StepRow",
    "TierRow",
    "planned_capacity_rps",
    "run_overload",
]

TIERS = tuple(tier.value for tier in Tier)
_EPSILON_S = 1e-9  # a request routed this much after it arrived did not wait

# Two teams per paid tier, one inside its guarantee and one above it, and a batch
# team with no guarantee. Weights are shares of the traffic; shares sum to 0.85.
# "chat" stays inside its guarantee with room to spare (0.20 x 1.6 = 0.32 of the
# planned rate against a 0.45 share): the pool's token capacity holds fewer
# requests/s than the plan's figure once answers slow down (see the module notes).
DEFAULT_TEAMS = (
    TeamSpec("chat", weight=0.20, tier="interactive", guaranteed_share=0.45),
    TeamSpec("assist", weight=0.15, tier="interactive", guaranteed_share=0.05),
    TeamSpec("api", weight=0.25, tier="standard", guaranteed_share=0.30),
    TeamSpec("reports", weight=0.15, tier="standard", guaranteed_share=0.05),
    TeamSpec("nightly", weight=0.25, tier="batch", guaranteed_share=0.0),
)


def planned_capacity_rps(
    replicas: int, replica_output_tokens_per_s: float, answer_tokens: int
) -> float:
    """Return the requests/s the plan says the pool serves (the seed: 100)."""
    if replicas < 1 or replica_output_tokens_per_s <= 0 or answer_tokens < 1:
        raise ValueError("replicas, tokens/s and answer tokens must be positive")
    return replicas * replica_output_tokens_per_s / answer_tokens


@dataclass(frozen=True, slots=True)
class OverloadScenario:
    """The arrival steps; ``workload``'s rate is replaced by ``capacity_rps``."""

    capacity_rps: float
    factors: tuple[float, ...] = (0.8, 1.0, 1.3, 1.6)
    step_s: float = 120.0
    warmup_s: float = 60.0
    bin_s: float = 10.0
    workload: ChatWorkload = field(
        default_factory=lambda: ChatWorkload(teams=DEFAULT_TEAMS)
    )

    def __post_init__(self) -> None:
        if self.capacity_rps <= 0 or not self.factors:
            raise ValueError("capacity_rps must be positive and factors not empty")
        if any(f <= 0 for f in self.factors):
            raise ValueError("factors must be positive")
        if self.step_s <= 0 or self.bin_s <= 0 or self.warmup_s < 0:
            raise ValueError("step_s and bin_s must be positive, warmup_s >= 0")

    @property
    def duration_s(self) -> float:
        return self.step_s * len(self.factors)

    def step_start_s(self, index: int) -> float:
        """Return when step ``index`` begins (simulated seconds from the start)."""
        return self.warmup_s + index * self.step_s

    def events(self) -> list[FleetEvent]:
        """Return the ``rate`` events: the first factor from 0, then each step."""
        events = [FleetEvent(at=0.0, kind="rate", factor=self.factors[0])]
        events.extend(
            FleetEvent(at=self.step_start_s(i), kind="rate", factor=factor)
            for i, factor in enumerate(self.factors)
            if i > 0
        )
        return events

    def inside_guarantee_teams(self) -> tuple[str, ...]:
        """Interactive teams whose guarantee covers their traffic at the peak."""
        teams = self.workload.teams
        total = sum(team.weight for team in teams)
        peak = max(self.factors)
        return tuple(
            team.name
            for team in teams
            if team.tier == Tier.INTERACTIVE.value
            and team.guaranteed_share >= team.weight / total * peak
        )


def _waited(request: FleetRequest) -> bool:
    if request.outcome == "shed":
        return True
    if request.routed_at is None:
        return request.outcome == "unfinished"
    return request.routed_at - request.arrived_at > _EPSILON_S


@dataclass(frozen=True, slots=True)
class TierRow:
    """One tier (or team) over the whole measured window."""

    name: str
    tier: str
    requests: int
    ok: int
    rate_limited: int
    shed: int
    other: int
    waited: int
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    wait_p95_s: float | None

    @classmethod
    def of(cls, name: str, tier: str, requests: Sequence[FleetRequest]) -> TierRow:
        ttfts = [r.ttft_s for r in requests if r.outcome == "ok" and r.ttft_s]
        waits = [
            r.routed_at - r.arrived_at for r in requests if r.routed_at is not None
        ]
        counts = {"ok": 0, "rate_limited": 0, "shed": 0}
        for request in requests:
            if request.outcome in counts:
                counts[request.outcome] += 1
        return cls(
            name=name,
            tier=tier,
            requests=len(requests),
            ok=counts["ok"],
            rate_limited=counts["rate_limited"],
            shed=counts["shed"],
            other=len(requests) - sum(counts.values()),
            waited=sum(1 for r in requests if _waited(r)),
            ttft_p50_s=nearest_rank(ttfts, 0.50),
            ttft_p95_s=nearest_rank(ttfts, 0.95),
            wait_p95_s=nearest_rank(waits, 0.95),
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "tier": self.tier,
            "requests": self.requests,
            "ok": self.ok,
            "rate_limited": self.rate_limited,
            "shed": self.shed,
            "other": self.other,
            "waited": self.waited,
            "ttft_p50_s": self.ttft_p50_s,
            "ttft_p95_s": self.ttft_p95_s,
            "wait_p95_s": self.wait_p95_s,
        }


@dataclass(frozen=True, slots=True)
class StepRow:
    """One tier during one arrival step."""

    step: int
    factor: float
    offered_rps: float
    tier: str
    requests: int
    rate_limited: int
    shed: int
    ttft_p95_s: float | None
    max_queued: int

    def as_dict(self) -> dict[str, object]:
        return {
            "step": self.step,
            "factor": self.factor,
            "offered_rps": self.offered_rps,
            "tier": self.tier,
            "requests": self.requests,
            "rate_limited": self.rate_limited,
            "shed": self.shed,
            "ttft_p95_s": self.ttft_p95_s,
            "max_queued": self.max_queued,
        }


@dataclass(frozen=True, slots=True)
class Bins:
    """Per ``bin_s`` bin: the factor in force and, per tier, what happened to the
    requests that arrived in it (``served``: answered in full)."""

    starts_s: tuple[float, ...]
    factors: tuple[float, ...]
    queued_max: dict[str, list[int]]
    served: dict[str, list[int]]
    rate_limited: dict[str, list[int]]
    shed: dict[str, list[int]]
    ttft_p95_s: dict[str, list[float | None]]

    def as_dict(self) -> dict[str, object]:
        return {
            "start_s": list(self.starts_s),
            "factor": list(self.factors),
            "queued_max": self.queued_max,
            "served": self.served,
            "rate_limited": self.rate_limited,
            "shed": self.shed,
            "ttft_p95_s": self.ttft_p95_s,
        }


@dataclass(frozen=True, slots=True)
class Check:
    """One rule of the seed's order, judged on the run."""

    name: str
    passed: bool
    detail: str

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "passed": self.passed, "detail": self.detail}


@dataclass(frozen=True, slots=True)
class OverloadOutcome:
    """The run and everything the drill reports about it."""

    scenario: OverloadScenario
    tiers: tuple[TierRow, ...]
    teams: tuple[TierRow, ...]
    steps: tuple[StepRow, ...]
    bins: Bins
    checks: tuple[Check, ...]
    result: FleetResult

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)


def run_overload(config: FleetConfig, scenario: OverloadScenario) -> OverloadOutcome:
    """Step the arrivals past capacity through a fleet with tiered admission."""
    config = replace(config, admission=True)
    workload = replace(scenario.workload, arrival_rate=scenario.capacity_rps)
    sim = FleetSim(config, workload, events=scenario.events())
    result = sim.run(scenario.duration_s, warmup_s=scenario.warmup_s)
    team_tier = {team.name: team.tier for team in workload.teams}
    requests = result.requests
    by_tier = {tier: [r for r in requests if r.tier == tier] for tier in TIERS}
    tiers = tuple(TierRow.of(tier, tier, by_tier[tier]) for tier in TIERS)
    teams = tuple(
        TierRow.of(name, tier, [r for r in requests if r.team == name])
        for name, tier in team_tier.items()
    )
    start, end = result.started_at, result.ended_at
    bins = _bins(scenario, result, by_tier, start, end)
    return OverloadOutcome(
        scenario=scenario,
        tiers=tiers,
        teams=teams,
        steps=tuple(_steps(scenario, result, by_tier)),
        bins=bins,
        checks=tuple(_checks(scenario, by_tier, teams, start)),
        result=result,
    )


def _factor_at(scenario: OverloadScenario, at: float) -> float:
    index = int((at - scenario.warmup_s) // scenario.step_s)
    return scenario.factors[max(0, min(index, len(scenario.factors) - 1))]


def _bins(
    scenario: OverloadScenario,
    result: FleetResult,
    by_tier: dict[str, list[FleetRequest]],
    start: float,
    end: float,
) -> Bins:
    size = scenario.bin_s
    starts = bin_starts(start, end, size)

    def times(tier: str, outcome: str) -> list[float]:
        return [r.arrived_at for r in by_tier[tier] if r.outcome == outcome]

    queued_max = {
        tier: [
            int(v or 0)
            for v in max_in_bins(
                ((s.at, float(s.queued.get(tier, 0))) for s in result.samples),
                start,
                end,
                size,
            )
        ]
        for tier in TIERS
    }
    return Bins(
        starts_s=tuple(starts),
        factors=tuple(_factor_at(scenario, at) for at in starts),
        queued_max=queued_max,
        served={
            tier: count_in_bins(times(tier, "ok"), start, end, size) for tier in TIERS
        },
        rate_limited={
            tier: count_in_bins(times(tier, "rate_limited"), start, end, size)
            for tier in TIERS
        },
        shed={
            tier: count_in_bins(times(tier, "shed"), start, end, size) for tier in TIERS
        },
        ttft_p95_s={
            tier: percentile_in_bins(
                (
                    (r.arrived_at, r.ttft_s)
                    for r in by_tier[tier]
                    if r.outcome == "ok" and r.ttft_s is not None
                ),
                start,
                end,
                size,
                0.95,
            )
            for tier in TIERS
        },
    )


def _steps(
    scenario: OverloadScenario,
    result: FleetResult,
    by_tier: dict[str, list[FleetRequest]],
) -> list[StepRow]:
    rows = []
    for index, factor in enumerate(scenario.factors):
        lo = scenario.step_start_s(index)
        hi = lo + scenario.step_s
        samples = [s for s in result.samples if lo <= s.at < hi]
        for tier in TIERS:
            requests = [r for r in by_tier[tier] if lo <= r.arrived_at < hi]
            ttfts = [r.ttft_s for r in requests if r.outcome == "ok" and r.ttft_s]
            rows.append(
                StepRow(
                    step=index + 1,
                    factor=factor,
                    offered_rps=scenario.capacity_rps * factor,
                    tier=tier,
                    requests=len(requests),
                    rate_limited=sum(
                        1 for r in requests if r.outcome == "rate_limited"
                    ),
                    shed=sum(1 for r in requests if r.outcome == "shed"),
                    ttft_p95_s=nearest_rank(ttfts, 0.95),
                    max_queued=max((s.queued.get(tier, 0) for s in samples), default=0),
                )
            )
    return rows


def _checks(
    scenario: OverloadScenario,
    by_tier: dict[str, list[FleetRequest]],
    teams: Sequence[TierRow],
    start: float,
) -> list[Check]:
    def first(
        tiers: Sequence[str], keep: Callable[[FleetRequest], bool]
    ) -> float | None:
        return min(
            (r.arrived_at for tier in tiers for r in by_tier[tier] if keep(r)),
            default=None,
        )

    def is_429(r: FleetRequest) -> bool:
        return r.outcome == "rate_limited"

    def is_shed(r: FleetRequest) -> bool:
        return r.outcome == "shed"

    def label(at: float | None) -> str:
        return "never" if at is None else f"{at:.2f} s"

    def bin_of(at: float) -> int:
        return int((at - start) // scenario.bin_s)

    batch = first(["batch"], _waited)
    first_429 = first(TIERS, is_429)
    paid_wait = first(["standard", "interactive"], _waited)
    standard_wait = first(["standard"], _waited)
    batch_shed = first(["batch"], is_shed)
    standard_shed = first(["standard"], is_shed)
    checks = []

    later = [t for t in (first_429, paid_wait) if t is not None]
    checks.append(
        Check(
            "batch_pauses_first",
            passed=not later or (batch is not None and batch <= min(later)),
            detail=(
                f"first batch wait/shed at {label(batch)}, first 429 at "
                f"{label(first_429)}, first interactive/standard wait at "
                f"{label(paid_wait)}"
            ),
        )
    )
    checks.append(
        Check(
            "over_share_429_before_standard_queues",
            passed=standard_wait is None
            or (first_429 is not None and bin_of(first_429) <= bin_of(standard_wait)),
            detail=(
                f"first 429 at {label(first_429)}, first standard wait at "
                f"{label(standard_wait)} (judged per {scenario.bin_s:g} s bin)"
            ),
        )
    )
    checks.append(
        Check(
            "standard_shed_after_batch",
            passed=standard_shed is None
            or (batch_shed is not None and bin_of(batch_shed) <= bin_of(standard_shed)),
            detail=(
                f"first batch shed at {label(batch_shed)}, first standard shed at "
                f"{label(standard_shed)}"
            ),
        )
    )
    inside = scenario.inside_guarantee_teams()
    refused = {
        row.name: row.rate_limited + row.shed for row in teams if row.name in inside
    }
    checks.append(
        Check(
            "interactive_inside_guarantee_never_shed",
            passed=bool(inside) and not any(refused.values()),
            detail=(
                ", ".join(f"{name}: {n} refused" for name, n in refused.items())
                or "no interactive team sized inside its guarantee"
            ),
        )
    )
    return checks
