"""The seed's isolation test at full scale, in the fleet simulator.

Public surface: ``NOISY_TEAM``, ``IsolationScenario``, ``IsolationRow``,
``IsolationOutcome``, ``team_arrivals``, ``run_isolation_sim``.

"One team sends 10 times its limit. Every other team's p95 TTFT must not move, and
only the noisy team may see 429s." The scenario runs twice through fresh fleets:
*baseline* (every team at its normal rate) and *noisy* (the noisy team sends
``flood_factor`` times its token limit from ``flood_start_s``, by default from the
start of the warm-up, so that the measured window sees the flood in steady state;
a later start puts the flood's first minute, when the team's full bucket lets a
minute of its tokens through at once, inside the window). The verdict is
``drills.domain.isolation.judge``, the same rule the live test uses: each quiet
team's p95 TTFT with the noise within ``tolerance`` of its baseline, no 429 or
other error for a quiet team, and the flood rate limited.

The comparison is paired: every team's arrivals come from its own random stream
(``team_arrivals``), so the quiet teams send exactly the same requests at exactly
the same times in both runs and only the noisy team's traffic differs. With one
stream for all teams (as ``FleetSim`` draws a workload), adding the flood would
reshuffle every quiet request and the p95s would differ by sampling noise alone.

Sizing: each team's demand is ``arrival_rate / teams`` requests per second of the
workload's shape, i.e. ``rate * (prompt_tokens + answer_tokens) * 60`` tokens per
minute after refunds. Quiet teams' limits are ``quiet_limit_headroom`` times their
demand (well within); the noisy team's limit is ``noisy_limit_headroom`` times its
normal demand, and under the flood it sends ``flood_factor`` times that limit.
Every team is standard tier with an equal guaranteed share (``1 / teams``); the
gateway's tiered admission runs as it does in production.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from drills.domain.fleet import FleetSim
from drills.domain.fleet_config import FleetConfig
from drills.domain.fleet_result import FleetResult
from drills.domain.isolation import Sample, TeamPhase, Verdict, judge, summarise
from drills.domain.workload import Arrival, ChatWorkload, Conversations, TeamSpec
from routing.domain.tiers import Tier

__all__ = [
    "NOISY_TEAM",
    "IsolationOutcome",
    "IsolationRow",
    "IsolationScenario",
    "run_isolation_sim",
    "team_arrivals",
]

NOISY_TEAM = "noisy"
# Conversation ids of team k start at k << _TEAM_SHIFT, so teams never share a prefix.
_TEAM_SHIFT = 32
# The HTTP status each simulated outcome would have been at the gateway.
_STATUS = {
    "ok": 200,
    "rate_limited": 429,
    "shed": 503,
    "no_replica": 503,
    "too_large": 400,
    "error": 502,
    "unfinished": 504,
}


@dataclass(frozen=True, slots=True)
class IsolationScenario:
    """Teams, limits and the flood; ``workload.arrival_rate`` is all teams' normal
    rate together (requests/s)."""

    teams: int = 5
    flood_factor: float = 10.0
    quiet_limit_headroom: float = 2.0
    noisy_limit_headroom: float = 1.0
    has_limits: bool = True
    flood_start_s: float = 0.0
    duration_s: float = 600.0
    warmup_s: float = 60.0
    tolerance: float = 0.10
    workload: ChatWorkload = field(default_factory=lambda: ChatWorkload(60.0))

    def __post_init__(self) -> None:
        if self.teams < 2:
            raise ValueError("the isolation test needs a noisy team and a quiet one")
        if self.flood_factor <= 0 or self.duration_s <= 0 or self.warmup_s < 0:
            raise ValueError(
                "flood_factor and duration_s must be positive, warmup_s not negative"
            )
        if self.flood_start_s < 0:
            raise ValueError("flood_start_s must not be negative")
        if self.quiet_limit_headroom <= 0 or self.noisy_limit_headroom <= 0:
            raise ValueError("limit headrooms must be positive")

    @property
    def team_rate(self) -> float:
        """Each team's normal arrival rate (requests/s)."""
        return self.workload.arrival_rate / self.teams

    @property
    def team_demand_tokens_per_minute(self) -> int:
        """Tokens a team's normal traffic costs per minute, after refunds."""
        w = self.workload
        return round(self.team_rate * (w.prompt_tokens + w.answer_tokens) * 60)

    @property
    def noisy_factor(self) -> float:
        """The noisy team's arrival rate under the flood over its normal rate."""
        return self.flood_factor * self.noisy_limit_headroom

    def team_specs(self) -> tuple[TeamSpec, ...]:
        """Return the quiet teams, then the noisy one (the last)."""
        demand = self.team_demand_tokens_per_minute
        share = 1.0 / self.teams

        def limit(headroom: float) -> int:
            return max(1, round(demand * headroom)) if self.has_limits else 0

        quiet = [
            TeamSpec(
                f"team-{index + 1}",
                tier=Tier.STANDARD.value,
                tokens_per_minute=limit(self.quiet_limit_headroom),
                guaranteed_share=share,
            )
            for index in range(self.teams - 1)
        ]
        noisy = TeamSpec(
            NOISY_TEAM,
            tier=Tier.STANDARD.value,
            tokens_per_minute=limit(self.noisy_limit_headroom),
            guaranteed_share=share,
        )
        return (*quiet, noisy)


def team_arrivals(
    workload: ChatWorkload,
    rates: Mapping[str, Sequence[tuple[float, float]]],
    duration_s: float,
    *,
    seed: int,
) -> list[Arrival]:
    """Return every team's arrivals over ``duration_s``, merged in time order.

    ``rates[team]`` is the team's schedule, ``(from_s, requests_per_s)`` pairs in
    time order starting at 0 (a team not named sends nothing). Each team arrives as
    a Poisson stream at its scheduled rate from its own generator (seeded by
    ``seed`` and its name) over its own users and conversations, so one team's
    arrivals do not depend on any other team's rate. Conversation ids are offset
    per team so that teams never share cached prefixes.
    """
    if duration_s <= 0:
        raise ValueError("duration_s must be positive")
    users = workload.team_users()
    merged: list[tuple[float, int, int, Arrival]] = []
    for index, team in enumerate(workload.teams):
        schedule = list(rates.get(team.name, ()))
        if not schedule:
            continue
        if any(b[0] < a[0] for a, b in itertools.pairwise(schedule)):
            raise ValueError(f"team {team.name}: the rate schedule is not in order")
        rng = random.Random(f"{seed}:{team.name}")
        conversations = Conversations(workload, rng)
        team_users = users[team.name]
        number = 0
        ends = [start for start, _ in schedule[1:]] + [duration_s]
        for (start, rate), end in zip(schedule, ends, strict=True):
            if rate <= 0:
                continue
            # Poisson arrivals are memoryless: each segment starts afresh.
            at = start + rng.expovariate(rate)
            while at < min(end, duration_s):
                user = team_users.start + rng.randrange(len(team_users))
                arrival = conversations.next_request(user, team, at)
                arrival = replace(
                    arrival,
                    conversation=(index << _TEAM_SHIFT) + arrival.conversation,
                )
                merged.append((at, index, number, arrival))
                number += 1
                at += rng.expovariate(rate)
    merged.sort(key=lambda item: item[:3])
    return [item[3] for item in merged]


@dataclass(frozen=True, slots=True)
class IsolationRow:
    """One team's figures in both runs; TTFTs in milliseconds."""

    team: str
    is_noisy: bool
    tokens_per_minute: int
    offered_tokens_per_minute_baseline: int
    offered_tokens_per_minute_noisy: int
    requests_baseline: int
    requests_noisy: int
    p95_ttft_ms_baseline: float | None
    p95_ttft_ms_noisy: float | None
    rate_limited_baseline: int
    rate_limited_noisy: int
    other_errors_baseline: int
    other_errors_noisy: int

    @property
    def p95_change(self) -> float | None:
        """Relative change of p95 TTFT under the noise (0.05 is 5% slower)."""
        if not self.p95_ttft_ms_baseline or self.p95_ttft_ms_noisy is None:
            return None
        return self.p95_ttft_ms_noisy / self.p95_ttft_ms_baseline - 1.0

    def as_dict(self) -> dict[str, object]:
        return {
            "team": self.team,
            "role": "noisy" if self.is_noisy else "quiet",
            "tokens_per_minute": self.tokens_per_minute,
            "offered_tokens_per_minute_baseline": self.offered_tokens_per_minute_baseline,
            "offered_tokens_per_minute_noisy": self.offered_tokens_per_minute_noisy,
            "requests_baseline": self.requests_baseline,
            "requests_noisy": self.requests_noisy,
            "ttft_p95_ms_baseline": self.p95_ttft_ms_baseline,
            "ttft_p95_ms_noisy": self.p95_ttft_ms_noisy,
            "ttft_p95_change": self.p95_change,
            "rate_limited_baseline": self.rate_limited_baseline,
            "rate_limited_noisy": self.rate_limited_noisy,
            "other_errors_baseline": self.other_errors_baseline,
            "other_errors_noisy": self.other_errors_noisy,
        }


@dataclass(frozen=True, slots=True)
class IsolationOutcome:
    """Both runs, one row per team, and the seed's verdict."""

    scenario: IsolationScenario
    teams: tuple[TeamSpec, ...]
    rows: tuple[IsolationRow, ...]
    verdict: Verdict
    baseline: FleetResult
    noisy: FleetResult


def _offered_tokens_per_minute(
    arrivals: Sequence[Arrival], team: str, start_s: float, end_s: float
) -> int:
    tokens = sum(
        a.prompt_tokens + a.max_tokens
        for a in arrivals
        if a.team == team and start_s <= a.at < end_s
    )
    return round(tokens * 60 / (end_s - start_s))


def run_isolation_sim(
    config: FleetConfig, scenario: IsolationScenario, *, seed: int | None = None
) -> IsolationOutcome:
    """Run the baseline and the flood through fresh fleets and judge them.

    ``seed`` (default ``config.seed``) seeds the arrivals; the fleet's replicas use
    ``config.seed``.
    """
    seed = config.seed if seed is None else seed
    specs = scenario.team_specs()
    workload = replace(scenario.workload, teams=specs)
    total_s = scenario.warmup_s + scenario.duration_s
    window = (scenario.warmup_s, total_s)
    rate = scenario.team_rate
    normal = {spec.name: [(0.0, rate)] for spec in specs}
    flood_rate = rate * scenario.noisy_factor
    if scenario.flood_start_s > 0:
        noisy_schedule = [(0.0, rate), (scenario.flood_start_s, flood_rate)]
    else:
        noisy_schedule = [(0.0, flood_rate)]
    flood = {**normal, NOISY_TEAM: noisy_schedule}
    samples: list[Sample] = []
    results: dict[str, FleetResult] = {}
    offered: dict[str, dict[str, int]] = {}
    for phase, rates in (("baseline", normal), ("noisy", flood)):
        arrivals = team_arrivals(workload, rates, total_s, seed=seed)
        sim = FleetSim(config, arrivals=arrivals, teams=specs)
        result = sim.run(scenario.duration_s, warmup_s=scenario.warmup_s)
        results[phase] = result
        offered[phase] = {
            spec.name: _offered_tokens_per_minute(arrivals, spec.name, *window)
            for spec in specs
        }
        samples.extend(
            Sample(
                team=request.team,
                phase=phase,
                status=_STATUS[request.outcome],
                ttft_s=request.ttft_s,
            )
            for request in result.requests
        )
    summary = summarise(samples)
    verdict = judge(summary, noisy_team=NOISY_TEAM, tolerance=scenario.tolerance)
    by_key: dict[tuple[str, str], TeamPhase] = {
        (row.team, row.phase): row for row in summary
    }
    empty = TeamPhase("", "", 0, 0, 0, 0, None, None)
    rows = []
    for spec in specs:
        base = by_key.get((spec.name, "baseline"), empty)
        loud = by_key.get((spec.name, "noisy"), empty)
        rows.append(
            IsolationRow(
                team=spec.name,
                is_noisy=spec.name == NOISY_TEAM,
                tokens_per_minute=spec.tokens_per_minute,
                offered_tokens_per_minute_baseline=offered["baseline"][spec.name],
                offered_tokens_per_minute_noisy=offered["noisy"][spec.name],
                requests_baseline=base.requests,
                requests_noisy=loud.requests,
                p95_ttft_ms_baseline=base.p95_ttft_ms,
                p95_ttft_ms_noisy=loud.p95_ttft_ms,
                rate_limited_baseline=base.rate_limited,
                rate_limited_noisy=loud.rate_limited,
                other_errors_baseline=base.other_errors,
                other_errors_noisy=loud.other_errors,
            )
        )
    return IsolationOutcome(
        scenario=scenario,
        teams=specs,
        rows=tuple(rows),
        verdict=verdict,
        baseline=results["baseline"],
        noisy=results["noisy"],
    )
