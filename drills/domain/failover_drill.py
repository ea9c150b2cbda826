"""The failover game day in the fleet simulator: one of two regions is lost at
half load, its traffic moves to the survivor, and the drill measures the shift.

Public surface: ``FAILOVER_TEAMS``, ``BATCH_TEAM``, ``FailoverScenario``,
``PoolFigures``, ``SeriesPoint``, ``FailoverReport``, ``ShiftedLoad``,
``judge``, ``small_scenario``, ``planned_scenario``, ``run_failover_sim``.

The seed: "When a region fails, the load balancer moves traffic. Open streams
break and clients retry ... The survivor is at 100% with cold prefix caches, so it
sheds batch and scales up", and the game day: "Measure the time until errors
stop, interactive TTFT during the shift, and how much batch work was delayed".
The issue's targets: errors stop within the load balancer's health-check window;
on the survivor no interactive request inside its guarantee is shed.

The simulator has one region per ``FleetSim`` and one pool per run, so the two
regions are separate runs that share no state, each pool its own run:

- **region A** (the lost one): the capacity plan's chat replicas per region (14 for
  the seed, prefill counted: ``planned_scenario``) and 3 reasoning (70B) replicas, each pool at ``load_share`` (half) of its peak, no batch, no
  autoscaler. At ``loss_at_s`` every replica is lost at once (``lose_replica``):
  what was in flight fails (a request before its first token is retried on the
  region's other replicas, which are gone too). Requests keep arriving at A until
  the global load balancer notices, judged by its own rules: every ``inter_s``
  HAProxy asks A's ``/healthz``, whose verdict is the gateway's readiness rule
  (``routing.domain.readiness.judge_readiness``: A's gateway and control plane
  stay up, but its pools have no serving replica), and ``HealthCheck.observe``
  (``routing.domain.global_lb``, the rendered ``inter 2s fall 2``) takes A out
  after ``fall`` failed checks in a row. The checks' phase is the worst one: a
  check passed at the instant of the loss, so detection comes ``inter_s x fall``
  after it (4 s by default). Each request sent to A meanwhile finds no replica
  and fails at once. A's run stops at detection.
- **region B** (the survivor): the same pools at half load, with batch filling the
  chat pool's idle capacity (``drills.domain.batch_drill.JobSource``: the real
  batch scheduler, idle-only, its lines at the batch tier) and the platform's
  autoscaler on each pool (min the region's fleet: it is sized for the whole peak
  and never shrinks below it; max twice that; new replicas take the cold start of
  ``drills.domain.fleet_scaling.ColdStart``, 312 s for the 7B; with
  ``warm_nodes`` a start on a node that waits with the weights on disk takes
  44 s, the seed's "pulled onto the local disks ahead of time"). From the end of
  the window A's whole load arrives at B (``ShiftedLoad``, a ``RequestSource``):
  the same teams (so the same guarantees and limits), A's own users, whose
  conversations began on A, so their history is in no cache of B's.

Not modelled, on purpose: client retries. Every request that fails counts as
failed; a client retrying with backoff after the window would land on B and
succeed, so the failures here are what a client without retries sees (an upper
bound). A's batch jobs are not simulated (in life they resume on B from their
stored lines). The 70B pool's admission capacity is the plan's: 20 streams a
replica of ``reasoning_prompt_tokens + reasoning_answer_tokens`` tokens
(``reasoning_replica_tokens_in_flight``).

Errors are the user-facing failures of non-batch requests, in either region:
``error``, ``no_replica``, ``shed`` (503) and ``unfinished``; a 429 (a team above
its guaranteed share while the pool is full) is reported apart, as is batch, whose
waiting and shedding is the point. "Time until errors stop" runs from the loss to
the end of the last such request. A team counts as *inside its guarantee* when its
guaranteed share is at least its share of the traffic (``FAILOVER_TEAMS``: "chat"
is, "assist" is not). Admission never sheds a request it judges inside, but it
judges each request against the team's tokens in flight, so a survivor too small
for the shift answers the guaranteed team's requests 429 instead: the drill counts
every refusal (503 or 429) of a guaranteed team's interactive request as "shed
inside its guarantee" (the target: none), and the other interactive teams'
refusals as outside it. Batch work delayed: the batch output tokens
B made from the loss to the end of the run, against a second run of B's chat pool
with the same seed and no loss.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from batches.domain.scheduler import SchedulerSettings
from drills.domain.autoscaling_drill import pool_settings
from drills.domain.batch_drill import BatchJobSpec, BatchScenario, JobSource
from drills.domain.capacity_plan import Plan
from drills.domain.failover_trace import RegionTrace, ShiftedArrivals
from drills.domain.fleet import FleetSim
from drills.domain.fleet_config import FleetConfig, FleetEvent
from drills.domain.fleet_result import FleetResult
from drills.domain.fleet_scaling import ColdStart, FleetAutoscaling
from drills.domain.overload import Check
from drills.domain.replica import FleetRequest
from drills.domain.workload import Arrival, ChatWorkload, Conversations, TeamSpec
from routing.domain.global_lb import HealthCheck, ServerHealth
from routing.domain.readiness import Readiness, judge_readiness
from routing.domain.tiers import Tier
from simengine.domain.percentiles import percentile

__all__ = [
    "BATCH_TEAM",
    "FAILOVER_TEAMS",
    "FailoverReport",
    "FailoverScenario",
    "PoolFigures",
    "SeriesPoint",
    "ShiftedLoad",
    "judge",
    "planned_scenario",
    "run_failover_sim",
    "small_scenario",
    "with_trace",
]

# Each region's teams, in both pools. Weights are shares of the traffic; "chat"'s
# guarantee covers its whole share (inside), "assist"'s does not (outside).
FAILOVER_TEAMS = (
    TeamSpec("chat", weight=0.35, tier="interactive", guaranteed_share=0.45),
    TeamSpec("assist", weight=0.15, tier="interactive", guaranteed_share=0.05),
    TeamSpec("api", weight=0.35, tier="standard", guaranteed_share=0.30),
    TeamSpec("tools", weight=0.15, tier="standard", guaranteed_share=0.05),
)
BATCH_TEAM = TeamSpec("backfill", tier=Tier.BATCH.value, tokens_per_minute=3_000_000)
_FAILED = ("error", "no_replica", "shed", "unfinished")
# A's shifted users: far above the workload's user numbers (conversation ids are
# user << 20 | restarts, batch lines start at 1 << 44).
_SHIFTED_USER_OFFSET = 1 << 22
_BATCH_LINES = 10**7  # a job the run never finishes: batch always has work
_SETTLE_S = 60.0  # the autoscaler's first tick (the pools start with cold caches)
_CHECK = HealthCheck()  # the rendered haproxy.cfg's checks
# The lost region's snapshot is fresh (its control plane answers): any bound holds.
_MAX_SNAPSHOT_AGE_S = 10.0
# A region that passes its checks this long after a loss has a rule gone wrong.
_MAX_CHECKS = 10_000


@dataclass(frozen=True, slots=True)
class FailoverScenario:
    """Two regions, the loss and the load balancer (defaults: the seed's scale).

    ``peak_rps`` is the chat pool's whole peak (both regions' traffic: 100
    requests/s, the plan's); each region carries ``load_share`` of it. The
    reasoning pool's peak is ``reasoning_peak_streams`` streams of
    ``reasoning_stream_tokens_s`` (the plan's 60 x 20 tokens/s). Times are
    simulated seconds: ``warmup_s`` before the measured window, ``loss_at_s`` from
    the window's start, ``duration_s`` the whole window; ``shift_s`` after
    detection is "during the shift".
    """

    peak_rps: float = 100.0
    load_share: float = 0.5
    chat_replicas: int = 12
    reasoning_replicas: int = 3
    chat_profile: str = "a100-8b"
    reasoning_profile: str = "h100-70b-int8-tp2"
    reasoning_peak_streams: int = 60
    reasoning_stream_tokens_s: float = 20.0
    reasoning_prompt_tokens: int = 1200
    reasoning_history_tokens: int = 800
    reasoning_answer_tokens: int = 400
    reasoning_replica_tokens_in_flight: int = 32_000
    warmup_s: float = 120.0
    loss_at_s: float = 180.0
    duration_s: float = 780.0
    shift_s: float = 300.0
    check_inter_s: float = _CHECK.inter_s
    check_fall: int = _CHECK.fall
    batch_ceiling: float = 0.6
    batch_jobs: int = 8
    batch_team: TeamSpec = BATCH_TEAM
    scheduler: SchedulerSettings = field(
        default_factory=lambda: SchedulerSettings(escalate=False)
    )
    max_factor: float = 2.0
    warm_nodes: int = 0
    step_s: float = 10.0
    chat_cold_start: ColdStart = field(default_factory=ColdStart)
    reasoning_cold_start: ColdStart = field(
        default_factory=lambda: ColdStart(weights_gb=70.0)
    )
    teams: tuple[TeamSpec, ...] = FAILOVER_TEAMS
    chat_workload: ChatWorkload = field(default_factory=ChatWorkload)
    # A recorded trace as the chat pool's traffic (``with_trace``); None: the
    # chat workload at ``load_share`` of ``peak_rps``.
    chat_trace: RegionTrace | None = None
    # The tiers whose TTFT and refusals inside a guarantee the drill measures
    # (its "interactive" figures): interactive; with a trace, every tier the
    # trace has but batch (a trace of standard traffic is measured on that).
    measured_tiers: tuple[str, ...] = (Tier.INTERACTIVE.value,)

    def __post_init__(self) -> None:
        if self.peak_rps <= 0 or not 0 < self.load_share <= 1:
            raise ValueError("peak_rps must be positive, load_share in (0, 1]")
        if self.chat_replicas < 1 or self.reasoning_replicas < 0:
            raise ValueError("a region needs a chat replica; reasoning >= 0")
        if self.check_inter_s <= 0 or self.check_fall < 1:
            raise ValueError("check_inter_s must be positive and check_fall >= 1")
        if min(self.warmup_s, self.loss_at_s) < 0 or self.step_s <= 0:
            raise ValueError("warmup_s and loss_at_s >= 0, step_s positive")
        if not self.loss_at_s + self.window_s < self.duration_s:
            raise ValueError(
                "the loss and its detection window must end inside --duration"
            )
        if self.shift_s <= 0 or self.max_factor < 1:
            raise ValueError("shift_s must be positive and max_factor >= 1")
        if self.batch_jobs < 0 or self.warm_nodes < 0:
            raise ValueError("batch_jobs and warm_nodes must be >= 0")
        if not 0 < self.batch_ceiling <= 1:
            raise ValueError("batch_ceiling must be in (0, 1]")
        if self.batch_team.tier != Tier.BATCH.value:
            raise ValueError("the batch team must be in the batch tier")
        self._check_trace()

    def _check_trace(self) -> None:
        trace = self.chat_trace
        if trace is not None and self.warmup_s + self.duration_s > trace.span_s:
            raise ValueError(
                f"the trace spans {trace.span_s:.0f} s: the warm-up "
                f"({self.warmup_s:g} s) and --duration ({self.duration_s:g} s) "
                "must fit inside it"
            )

    @property
    def window_s(self) -> float:
        """The load balancer's health-check window: ``inter x fall``."""
        return self.health_check.window_s

    @property
    def loss_t(self) -> float:
        return self.warmup_s + self.loss_at_s

    @property
    def health_check(self) -> HealthCheck:
        """The global load balancer's checks, at the scenario's ``inter`` and
        ``fall``."""
        return HealthCheck(inter_s=self.check_inter_s, fall=self.check_fall)

    @property
    def detect_s(self) -> float:
        """Seconds from the loss until the load balancer takes the region out."""
        check = self.health_check
        health = ServerHealth()
        # Worst phase: the check at the instant of the loss ran just before it.
        for k in range(_MAX_CHECKS):
            at = k * check.inter_s
            health = check.observe(
                health, is_passed=self.lost_region_readiness(at).ready
            )
            if not health.is_up:
                return at
        raise ValueError("the lost region never failed its health checks")

    @property
    def detect_t(self) -> float:
        return self.loss_t + self.detect_s

    def lost_region_readiness(self, since_loss_s: float) -> Readiness:
        """What the lost region's ``/healthz`` says ``since_loss_s`` after the
        loss (at 0, just before it): its gateway, Redis and control plane are up;
        its pools' replicas are gone."""
        is_lost = since_loss_s > 0
        serving = {"chat": 0 if is_lost else self.chat_replicas}
        if self.reasoning_replicas:
            serving["reasoning"] = 0 if is_lost else self.reasoning_replicas
        return judge_readiness(
            has_snapshot=True,
            snapshot_age_s=0.0,
            control_plane_up=True,
            max_snapshot_age_s=_MAX_SNAPSHOT_AGE_S,
            redis="up",
            serving=serving,
        )

    @property
    def end_t(self) -> float:
        return self.warmup_s + self.duration_s

    def chat(self) -> ChatWorkload:
        """One region's chat traffic (``load_share`` of the peak)."""
        return replace(
            self.chat_workload,
            arrival_rate=self.peak_rps * self.load_share,
            teams=self.teams,
        )

    def reasoning(self) -> ChatWorkload:
        """One region's reasoning traffic: its share of the plan's streams, each
        lasting an answer at the plan's stream speed."""
        stream_s = self.reasoning_answer_tokens / self.reasoning_stream_tokens_s
        rps = self.reasoning_peak_streams * self.load_share / stream_s
        return ChatWorkload(
            arrival_rate=rps,
            prompt_tokens=self.reasoning_prompt_tokens,
            history_tokens=self.reasoning_history_tokens,
            answer_tokens=self.reasoning_answer_tokens,
            max_tokens=self.reasoning_answer_tokens,
            teams=self.teams,
        )

    def inside_teams(self) -> frozenset[str]:
        """Teams of the measured tiers (interactive) whose guarantee covers their
        share of the traffic."""
        total = sum(team.weight for team in self.teams)
        return frozenset(
            team.name
            for team in self.teams
            if team.tier in self.measured_tiers
            and team.guaranteed_share >= team.weight / total
        )


def planned_scenario(capacity: Plan, **overrides: Any) -> FailoverScenario:
    """The game day at the fleet the capacity plan sizes each region for.

    A region carries the whole peak when another is lost (the plan's
    ``regions_lost``), so each region's chat pool is the plan's
    ``chat_replicas_per_region_with_prefill`` (prefill counted, at the hit rate
    its cache model expects; 14 for the seed, not the 12 that decode alone
    needs) and its 70B pool ``big_replicas_per_region``; the chat peak is the
    plan's ``chat_requests_per_s`` and the 70B's its peak streams.
    """
    s = capacity.scenario
    values: dict[str, Any] = {
        "peak_rps": float(capacity["chat_requests_per_s"]),
        "chat_replicas": int(capacity["chat_replicas_per_region_with_prefill"]),
        "reasoning_replicas": int(capacity["big_replicas_per_region"]),
        "reasoning_peak_streams": int(s.big.peak_streams),
        "reasoning_stream_tokens_s": float(s.big.stream_tokens_per_s),
    }
    values.update(overrides)
    return FailoverScenario(**values)


def with_trace(scenario: FailoverScenario, trace: RegionTrace) -> FailoverScenario:
    """Return ``scenario`` with ``trace`` as its chat traffic
    (``drills.domain.failover_trace``): the traced teams and their guarantees in
    both pools, and its times fitted inside the trace where they do not fit (a
    quarter of it, at most the scenario's, warming up; the loss a third of the
    rest in; the shift at most what is left after detection)."""
    if trace.span_s <= 0:
        raise ValueError("the trace spans no time: its requests all arrive at once")
    s = scenario
    warmup, duration = s.warmup_s, s.duration_s
    loss_at, shift = s.loss_at_s, s.shift_s
    if warmup + duration > trace.span_s:
        warmup = min(warmup, trace.span_s / 4)
        duration = trace.span_s - warmup
        loss_at = min(loss_at, duration / 3)
        shift = min(shift, duration - loss_at - s.window_s)
    tiers = {team.tier for team in trace.teams} - {Tier.BATCH.value}
    return replace(
        s,
        chat_trace=trace,
        teams=trace.teams,
        measured_tiers=tuple(t.value for t in Tier if t.value in tiers),
        peak_rps=trace.rps,
        warmup_s=warmup,
        duration_s=duration,
        loss_at_s=loss_at,
        shift_s=max(shift, s.step_s),
    )


def small_scenario() -> FailoverScenario:
    """A scale a test runs in seconds: 2 chat and 1 reasoning replica a region,
    13 requests/s at peak, 40 s of warm-up, the loss 40 s in, 3 minutes measured,
    starts of 20 s."""
    quick = ColdStart(node_start_s=5.0, weights_gb=1.0, warmup_s=5.0)
    return FailoverScenario(
        peak_rps=13.0,
        chat_replicas=2,
        reasoning_replicas=1,
        reasoning_peak_streams=10,
        reasoning_replica_tokens_in_flight=16_000,
        warmup_s=40.0,
        loss_at_s=40.0,
        duration_s=180.0,
        shift_s=60.0,
        batch_jobs=1,
        batch_team=replace(BATCH_TEAM, tokens_per_minute=300_000),
        scheduler=SchedulerSettings(
            initial_window=2,
            max_window=8,
            min_observed_s=15.0,
            rate_window_s=15.0,
            escalate=False,
        ),
        chat_cold_start=quick,
        reasoning_cold_start=quick,
        step_s=5.0,
    )


class ShiftedLoad:
    """The lost region's traffic arriving at the survivor (a ``RequestSource``).

    From ``start_at`` on, Poisson at the workload's rate, the workload's teams by
    weight and a user of the team drawn uniformly; the users are the lost region's
    (numbers offset past the survivor's), each one turn into its conversation, so
    every first message on the survivor carries history that no cache there holds.
    Its requests are not retried (see the module docstring).
    """

    def __init__(self, workload: ChatWorkload, *, start_at: float, seed: int) -> None:
        self.workload = workload
        self.start_at = start_at
        self._rng = random.Random(f"{seed}:shifted")
        self._conversations = Conversations(workload, random.Random(f"{seed}:conv"))
        self._users = workload.team_users()
        self._teams = list(workload.teams)
        self._weights = [workload.team_rate(team) for team in self._teams]
        self._rate = sum(self._weights)
        for team in self._teams:
            for user in self._users[team.name]:
                self._conversations.next_request(_SHIFTED_USER_OFFSET + user, team, 0.0)
        self._next = start_at + self._rng.expovariate(self._rate)
        self.sent = 0

    def tick(self, now: float, send: Callable[[Arrival], FleetRequest]) -> float | None:
        if now >= self._next:
            team = self._rng.choices(self._teams, weights=self._weights)[0]
            users = self._users[team.name]
            user = users.start + self._rng.randrange(len(users))
            send(
                self._conversations.next_request(_SHIFTED_USER_OFFSET + user, team, now)
            )
            self.sent += 1
            self._next = now + self._rng.expovariate(self._rate)
        return self._next

    def ended(self, request: FleetRequest, retry_after_s: float | None) -> None:
        return None


# -- the report ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PoolFigures:
    """One pool on the survivor (and its TTFT before the loss in both regions).

    Replicas: serving at the loss, the most serving after it, and at the end;
    ``first_new_serving_s``: when the first replica the autoscaler started after
    the loss began serving, from the loss (None: none did). Hit rates are the
    prefix cache's (cached over cacheable history tokens, answered requests, by
    arrival) before the loss and in the shift window after detection.
    """

    pool: str
    profile: str
    replicas_before: int
    replicas_peak: int
    replicas_end: int
    first_new_serving_s: float | None
    interactive_ttft_p50_before_s: float | None
    interactive_ttft_p95_before_s: float | None
    interactive_ttft_p50_shift_s: float | None
    interactive_ttft_p95_shift_s: float | None
    hit_rate_before: float | None
    hit_rate_shift: float | None
    interactive_shed_inside: int
    inside_rate_limited: int
    interactive_shed_outside: int
    rate_limited: dict[str, int]

    def as_dict(self) -> dict[str, object]:
        return {
            "pool": self.pool,
            "profile": self.profile,
            "replicas_before": self.replicas_before,
            "replicas_peak": self.replicas_peak,
            "replicas_end": self.replicas_end,
            "first_new_serving_s": self.first_new_serving_s,
            "interactive_ttft_p50_before_s": self.interactive_ttft_p50_before_s,
            "interactive_ttft_p95_before_s": self.interactive_ttft_p95_before_s,
            "interactive_ttft_p50_shift_s": self.interactive_ttft_p50_shift_s,
            "interactive_ttft_p95_shift_s": self.interactive_ttft_p95_shift_s,
            "hit_rate_before": self.hit_rate_before,
            "hit_rate_shift": self.hit_rate_shift,
            "interactive_shed_inside_guarantee": self.interactive_shed_inside,
            "inside_guarantee_rate_limited": self.inside_rate_limited,
            "interactive_shed_outside_guarantee": self.interactive_shed_outside,
            "rate_limited_by_tier": dict(self.rate_limited),
        }


@dataclass(frozen=True, slots=True)
class SeriesPoint:
    """One step of the run: ``at`` seconds from the loss (the step's start)."""

    at: float
    errors: int
    interactive_ttft_p95_s: float | None
    replicas: dict[str, int]
    batch_tokens_s: float
    hit_rate: float | None

    def as_dict(self) -> dict[str, object]:
        return {
            "at_s": self.at,
            "errors": self.errors,
            "interactive_ttft_p95_s": self.interactive_ttft_p95_s,
            "replicas": dict(self.replicas),
            "batch_tokens_s": self.batch_tokens_s,
            "hit_rate": self.hit_rate,
        }


@dataclass(frozen=True, slots=True)
class FailoverReport:
    """What the game day measured, simulated or live (``mode``).

    Times are seconds from the loss. ``errors_stop_s`` is None when nothing
    failed. ``failed_by_cause``: ``in_flight_on_lost`` (running on the lost region
    at the loss), ``sent_to_lost`` (sent there before the load balancer noticed),
    ``on_survivor`` (failed or shed on the survivor). Batch: output tokens made
    from the loss to the end, and in the same window without a loss (None where
    not measured). ``pools`` is the chat pool first. ``scenario`` is what ran, as
    plain values (``after_loss_s``, the seconds measured after the loss, sets
    ``batch_delay_s``; the table reads ``pools``, ``load_share``, ``loss_at_s``,
    ``check_inter_s``, ``check_fall``, ``client_retries``, ``warm_nodes`` and
    ``seed`` from it where present).
    """

    mode: str
    window_s: float
    errors_stop_s: float | None
    requests_total: int
    requests_failed: int
    failed_by_cause: dict[str, int]
    rate_limited: int
    interactive_ttft_p50_before_s: float | None
    interactive_ttft_p95_before_s: float | None
    interactive_ttft_p50_shift_s: float | None
    interactive_ttft_p95_shift_s: float | None
    interactive_shed_inside: int
    inside_rate_limited: int
    interactive_shed_outside: int
    batch_tokens_shift: int | None
    batch_tokens_baseline: int | None
    batch_shed: int
    pools: tuple[PoolFigures, ...]
    series: tuple[SeriesPoint, ...]
    checks: tuple[Check, ...]
    scenario: dict[str, object]

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    @property
    def batch_tokens_delayed(self) -> int | None:
        """Batch output tokens not made because of the loss (by the run's end)."""
        if self.batch_tokens_shift is None or self.batch_tokens_baseline is None:
            return None
        return max(0, self.batch_tokens_baseline - self.batch_tokens_shift)

    @property
    def batch_delay_s(self) -> float | None:
        """The delayed tokens in seconds of the baseline's batch pace."""
        delayed, base = self.batch_tokens_delayed, self.batch_tokens_baseline
        span = self.scenario.get("after_loss_s")
        if delayed is None or not base or not isinstance(span, int | float):
            return None
        return delayed / (base / span)

    def as_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "passed": self.passed,
            "checks": [check.as_dict() for check in self.checks],
            "window_s": self.window_s,
            "errors_stop_s": self.errors_stop_s,
            "requests_total": self.requests_total,
            "requests_failed": self.requests_failed,
            "failed_by_cause": dict(self.failed_by_cause),
            "rate_limited": self.rate_limited,
            "interactive_ttft_p50_before_s": self.interactive_ttft_p50_before_s,
            "interactive_ttft_p95_before_s": self.interactive_ttft_p95_before_s,
            "interactive_ttft_p50_shift_s": self.interactive_ttft_p50_shift_s,
            "interactive_ttft_p95_shift_s": self.interactive_ttft_p95_shift_s,
            "interactive_shed_inside_guarantee": self.interactive_shed_inside,
            "inside_guarantee_rate_limited": self.inside_rate_limited,
            "interactive_shed_outside_guarantee": self.interactive_shed_outside,
            "batch_tokens_shift": self.batch_tokens_shift,
            "batch_tokens_baseline": self.batch_tokens_baseline,
            "batch_tokens_delayed": self.batch_tokens_delayed,
            "batch_delay_s": self.batch_delay_s,
            "batch_shed": self.batch_shed,
            "pools": [pool.as_dict() for pool in self.pools],
            "series": [point.as_dict() for point in self.series],
            "scenario": dict(self.scenario),
        }


def judge(report: FailoverReport) -> tuple[Check, ...]:
    """Return the issue's two targets judged on ``report`` (live or simulated)."""
    stop = report.errors_stop_s
    causes = ", ".join(f"{k} {v}" for k, v in report.failed_by_cause.items())
    return (
        Check(
            "errors_stop_within_window",
            stop is None or stop <= report.window_s + 1e-9,
            (
                "no request failed"
                if stop is None
                else f"the last failed request ended {stop:.1f} s after the loss"
            )
            + f" (target: within the health-check window, {report.window_s:g} s); "
            f"failed {report.requests_failed} of {report.requests_total} ({causes})",
        ),
        Check(
            "survivor_sheds_no_interactive_inside_guarantee",
            report.interactive_shed_inside == 0,
            f"interactive refused (503 or 429) on the survivor: "
            f"{report.interactive_shed_inside} inside their guarantee (target 0; "
            f"{report.interactive_shed_inside - report.inside_rate_limited} of them "
            f"503, {report.inside_rate_limited} 429), "
            f"{report.interactive_shed_outside} outside it; batch shed "
            f"{report.batch_shed}",
        ),
    )


# -- running -------------------------------------------------------------------------


@dataclass(slots=True)
class _Pool:
    name: str
    config: FleetConfig
    workload: ChatWorkload
    cold_start: ColdStart
    batch: bool
    trace: RegionTrace | None = None


def _pools(config: FleetConfig, s: FailoverScenario) -> list[_Pool]:
    chat = replace(
        config,
        admission=True,
        replicas=s.chat_replicas,
        profile=s.chat_profile,
        batch_ceiling=s.batch_ceiling,
        engine_scheduling="priority",
    )
    pools = [
        _Pool("chat", chat, s.chat(), s.chat_cold_start, batch=True, trace=s.chat_trace)
    ]
    if s.reasoning_replicas:
        reasoning = replace(
            chat,
            replicas=s.reasoning_replicas,
            profile=s.reasoning_profile,
            replica_tokens_in_flight=s.reasoning_replica_tokens_in_flight,
        )
        pools.append(
            _Pool(
                "reasoning",
                reasoning,
                s.reasoning(),
                s.reasoning_cold_start,
                batch=False,
            )
        )
    return pools


def _autoscaling(pool: _Pool, s: FailoverScenario) -> FleetAutoscaling:
    n = pool.config.replicas
    top = max(n, math.ceil(n * s.max_factor))
    settings = replace(pool_settings(n), min_replicas=n, max_replicas=top)
    return FleetAutoscaling(
        settings=settings,
        cold_start=pool.cold_start,
        warm_nodes=s.warm_nodes,
        gpu_budget=top * pool.config.perf_profile.gpus,
        first_tick_s=_SETTLE_S,
    )


def _job_source(pool: _Pool, s: FailoverScenario) -> JobSource | None:
    if not pool.batch or not s.batch_jobs:
        return None
    span_s = s.end_t + 60.0
    batch = BatchScenario(
        replicas=pool.config.replicas,
        day_hours=span_s / 3600.0,
        warmup_s=0.0,
        batch_ceiling=s.batch_ceiling,
        settings=s.scheduler,
        batch_teams=(s.batch_team,),
        jobs=tuple(
            BatchJobSpec(
                f"backfill-{i + 1}",
                s.batch_team.name,
                lines=_BATCH_LINES,
                submitted_h=0.0,
                deadline_h=24.0,
            )
            for i in range(s.batch_jobs)
        ),
    )
    return JobSource(batch, s.scheduler, batch.job_list())


def _run_lost(pool: _Pool, s: FailoverScenario) -> FleetResult:
    config = replace(pool.config, seed=pool.config.seed * 2 + 1)
    events = [FleetEvent(at=s.loss_t, kind="lose_replica", count=pool.config.replicas)]
    if pool.trace is not None:
        sim = FleetSim(
            config,
            arrivals=[a for a in pool.trace.lost if a.at < s.detect_t],
            teams=pool.trace.teams,
            events=events,
        )
    else:
        sim = FleetSim(config, pool.workload, events=events)
    return sim.run(s.loss_at_s + s.detect_s, warmup_s=s.warmup_s, drain_s=0.0)


def _run_survivor(
    pool: _Pool, s: FailoverScenario, *, shifted: bool
) -> tuple[FleetResult, ShiftedLoad | None]:
    config = replace(
        pool.config, seed=pool.config.seed * 2, autoscaling=_autoscaling(pool, s)
    )
    sources: list[JobSource | ShiftedLoad | ShiftedArrivals] = []
    jobs = _job_source(pool, s)
    if jobs is not None:
        sources.append(jobs)
    batch_teams = (s.batch_team,) if jobs is not None else ()
    if pool.trace is not None:
        if shifted:
            sources.append(ShiftedArrivals(pool.trace.lost, start_at=s.detect_t))
        sim = FleetSim(
            config,
            arrivals=pool.trace.survivor,
            teams=(*pool.trace.teams, *batch_teams),
            sources=sources,
        )
        return sim.run(s.duration_s, warmup_s=s.warmup_s, drain_s=60.0), None
    shift = None
    if shifted:
        shift = ShiftedLoad(pool.workload, start_at=s.detect_t, seed=config.seed)
        sources.append(shift)
    sim = FleetSim(config, pool.workload, teams=batch_teams, sources=sources)
    return sim.run(s.duration_s, warmup_s=s.warmup_s, drain_s=60.0), shift


def run_failover_sim(config: FleetConfig, scenario: FailoverScenario) -> FailoverReport:
    """Run both regions' pools, the loss and the shift, and judge the targets."""
    s = scenario
    runs = []
    baseline_batch: int | None = None
    for pool in _pools(config, s):
        lost = _run_lost(pool, s)
        survivor, _shift = _run_survivor(pool, s, shifted=True)
        if pool.batch and s.batch_jobs:
            base, _ = _run_survivor(pool, s, shifted=False)
            baseline_batch = _batch_tokens(base, s, s.loss_t, s.end_t)
        runs.append((pool, lost, survivor))
    return _report(s, runs, baseline_batch)


# -- measuring -----------------------------------------------------------------------


def _is_user(request: FleetRequest) -> bool:
    return request.tier != Tier.BATCH.value


def _ttfts(
    requests: Sequence[FleetRequest], lo: float, hi: float, tiers: Sequence[str]
) -> list[float]:
    return [
        r.ttft_s
        for r in requests
        if r.tier in tiers
        and r.outcome == "ok"
        and r.ttft_s is not None
        and lo <= r.arrived_at < hi
    ]


def _hit_rate(
    requests: Sequence[FleetRequest], block: int, lo: float, hi: float
) -> float | None:
    ok = [r for r in requests if r.outcome == "ok" and lo <= r.arrived_at < hi]
    cacheable = sum(r.cacheable_tokens(block) for r in ok)
    cached = sum(min(r.cached_tokens, r.cacheable_tokens(block)) for r in ok)
    return cached / cacheable if cacheable else None


def _batch_tokens(
    result: FleetResult, s: FailoverScenario, lo: float, hi: float
) -> int:
    return sum(
        r.output_tokens
        for r in result.requests
        if r.team == s.batch_team.name
        and r.outcome == "ok"
        and r.finished_at is not None
        and lo <= r.finished_at < hi
    )


def _replicas_at(result: FleetResult, at: float) -> int:
    serving = [sample.replicas for sample in result.samples if sample.at <= at]
    if serving:
        return serving[-1]
    return result.samples[0].replicas if result.samples else result.config.replicas


def _first_new_serving(result: FleetResult, loss_t: float) -> float | None:
    started = {
        text.split()[1]
        for at, text in result.events
        if at >= loss_t and text.endswith(("starting cold", "starting warm"))
    }
    for at, text in result.events:
        if at >= loss_t and text.endswith("serving") and text.split()[1] in started:
            return at - loss_t
    return None


def _pool_figures(
    pool: _Pool, lost: FleetResult, survivor: FleetResult, s: FailoverScenario
) -> PoolFigures:
    inside = s.inside_teams()
    before = _ttfts(lost.requests, s.warmup_s, s.loss_t, s.measured_tiers) + _ttfts(
        survivor.requests, s.warmup_s, s.loss_t, s.measured_tiers
    )
    shift = _ttfts(
        survivor.requests, s.detect_t, s.detect_t + s.shift_s, s.measured_tiers
    )
    after = [sample.replicas for sample in survivor.samples if sample.at >= s.loss_t]
    shed = [
        r
        for r in survivor.requests
        if r.tier in s.measured_tiers and r.outcome in ("shed", "rate_limited")
    ]
    limited = {tier.value: 0 for tier in Tier}
    for r in survivor.requests:
        if r.outcome == "rate_limited":
            limited[r.tier] += 1
    block = pool.config.block_size
    return PoolFigures(
        pool=pool.name,
        profile=pool.config.profile,
        replicas_before=_replicas_at(survivor, s.loss_t),
        replicas_peak=max(after, default=pool.config.replicas),
        replicas_end=after[-1] if after else pool.config.replicas,
        first_new_serving_s=_first_new_serving(survivor, s.loss_t),
        interactive_ttft_p50_before_s=percentile(before, 0.50),
        interactive_ttft_p95_before_s=percentile(before, 0.95),
        interactive_ttft_p50_shift_s=percentile(shift, 0.50),
        interactive_ttft_p95_shift_s=percentile(shift, 0.95),
        hit_rate_before=_hit_rate(survivor.requests, block, s.warmup_s, s.loss_t),
        hit_rate_shift=_hit_rate(
            survivor.requests, block, s.detect_t, s.detect_t + s.shift_s
        ),
        interactive_shed_inside=sum(r.team in inside for r in shed),
        inside_rate_limited=sum(
            r.team in inside and r.outcome == "rate_limited" for r in shed
        ),
        interactive_shed_outside=sum(r.team not in inside for r in shed),
        rate_limited=limited,
    )


def _series(
    s: FailoverScenario,
    runs: Sequence[tuple[_Pool, FleetResult, FleetResult]],
    failed: Sequence[FleetRequest],
) -> tuple[SeriesPoint, ...]:
    chat_pool, chat_lost, chat_survivor = runs[0]
    steps = math.ceil(s.duration_s / s.step_s)
    points = []
    for i in range(steps):
        lo = s.warmup_s + i * s.step_s
        hi = lo + s.step_s
        ttfts = _ttfts(chat_survivor.requests, lo, hi, s.measured_tiers)
        if lo < s.loss_t:
            ttfts += _ttfts(chat_lost.requests, lo, hi, s.measured_tiers)
        points.append(
            SeriesPoint(
                at=lo - s.loss_t,
                errors=sum(
                    r.finished_at is not None and lo <= r.finished_at < hi
                    for r in failed
                ),
                interactive_ttft_p95_s=percentile(ttfts, 0.95),
                replicas={
                    pool.name: _replicas_at(survivor, hi)
                    for pool, _lost, survivor in runs
                },
                batch_tokens_s=_batch_tokens(chat_survivor, s, lo, hi) / s.step_s,
                hit_rate=_hit_rate(
                    chat_survivor.requests, chat_pool.config.block_size, lo, hi
                ),
            )
        )
    return tuple(points)


def _report(
    s: FailoverScenario,
    runs: Sequence[tuple[_Pool, FleetResult, FleetResult]],
    baseline_batch: int | None,
) -> FailoverReport:
    causes = {"in_flight_on_lost": 0, "sent_to_lost": 0, "on_survivor": 0}
    failed: list[FleetRequest] = []
    total = rate_limited = batch_shed = 0
    for _pool, lost, survivor in runs:
        for r in lost.requests:
            total += 1
            if r.outcome in _FAILED:
                failed.append(r)
                if r.arrived_at < s.loss_t:
                    causes["in_flight_on_lost"] += 1
                else:
                    causes["sent_to_lost"] += 1
        for r in survivor.requests:
            if not _is_user(r):
                batch_shed += r.outcome == "shed" and r.arrived_at >= s.loss_t
                continue
            total += 1
            rate_limited += r.outcome == "rate_limited"
            if r.outcome in _FAILED:
                failed.append(r)
                causes["on_survivor"] += 1
    after = [
        r.finished_at
        for r in failed
        if r.finished_at is not None and r.finished_at >= s.loss_t
    ]
    pools = tuple(_pool_figures(pool, lost, surv, s) for pool, lost, surv in runs)
    chat = pools[0]
    chat_survivor = runs[0][2]
    has_batch = bool(s.batch_jobs)
    report = FailoverReport(
        mode="sim",
        window_s=s.window_s,
        errors_stop_s=max(after) - s.loss_t if after else None,
        requests_total=total,
        requests_failed=len(failed),
        failed_by_cause=causes,
        rate_limited=rate_limited,
        interactive_ttft_p50_before_s=chat.interactive_ttft_p50_before_s,
        interactive_ttft_p95_before_s=chat.interactive_ttft_p95_before_s,
        interactive_ttft_p50_shift_s=chat.interactive_ttft_p50_shift_s,
        interactive_ttft_p95_shift_s=chat.interactive_ttft_p95_shift_s,
        interactive_shed_inside=sum(p.interactive_shed_inside for p in pools),
        inside_rate_limited=sum(p.inside_rate_limited for p in pools),
        interactive_shed_outside=sum(p.interactive_shed_outside for p in pools),
        batch_tokens_shift=(
            _batch_tokens(chat_survivor, s, s.loss_t, s.end_t) if has_batch else None
        ),
        batch_tokens_baseline=baseline_batch,
        batch_shed=batch_shed,
        pools=pools,
        series=_series(s, runs, failed),
        checks=(),
        scenario=_scenario_dict(s, runs),
    )
    return replace(report, checks=judge(report))


def _scenario_dict(
    s: FailoverScenario, runs: Sequence[tuple[_Pool, FleetResult, FleetResult]]
) -> dict[str, object]:
    return {
        "regions": 2,
        "peak_rps": s.peak_rps,
        "load_share": s.load_share,
        "pools": {
            pool.name: {
                "replicas": pool.config.replicas,
                "profile": pool.config.profile,
                "rps_per_region": (
                    pool.workload.arrival_rate
                    if pool.trace is None
                    else len(pool.trace.survivor) / pool.trace.span_s
                ),
                "replica_tokens_in_flight": pool.config.replica_tokens_in_flight,
                "max_replicas": _autoscaling(pool, s).settings.max_replicas,
                "cold_start_s": pool.cold_start.cold_s,
                "warm_start_s": pool.cold_start.warm_s,
            }
            for pool, _lost, _survivor in runs
        },
        "warmup_s": s.warmup_s,
        "loss_at_s": s.loss_at_s,
        "duration_s": s.duration_s,
        "after_loss_s": s.duration_s - s.loss_at_s,
        "shift_s": s.shift_s,
        "check_inter_s": s.check_inter_s,
        "check_fall": s.check_fall,
        "batch_ceiling": s.batch_ceiling,
        "batch_jobs": s.batch_jobs,
        "warm_nodes": s.warm_nodes,
        "inside_guarantee_teams": sorted(s.inside_teams()),
        "measured_tiers": list(s.measured_tiers),
        "chat_trace": None
        if s.chat_trace is None
        else {
            "requests": s.chat_trace.requests,
            "span_s": s.chat_trace.span_s,
            "rps": s.chat_trace.rps,
            "lost_region_requests": len(s.chat_trace.lost),
            "teams": len(s.chat_trace.teams),
        },
        "client_retries": False,
        "seed": runs[0][0].config.seed if runs else 0,
    }
