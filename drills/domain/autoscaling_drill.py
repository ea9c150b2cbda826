"""The autoscaling drill: a ramp, a sudden doubling and a day, through the fleet
simulator with the platform's autoscaler.

Public surface: ``SHAPES``, ``FLEETS``, ``DrillScenario``, ``Case``, ``CaseOutcome``,
``DayComparison``, ``DrillOutcome``, ``SeedArithmetic``,
``pool_settings``, ``seed_arithmetic``, ``load_factor``, ``settled_replicas``,
``run_drill``, ``run_trace_case``.

``run_trace_case`` replays arrivals instead of a load shape (a recorded trace,
scaled by ``drills.domain.recorded_trace.scale_trace`` for "what if traffic
doubles") through one of the fleets, the same autoscaler and the same figures; a
trace's time is real time (no day compression), its teams are its own.

The seed: "Replay a ramp of 5% per minute and a sudden doubling. Record time until
new capacity serves, peak queue depth, requests shed per tier and minutes outside
the TTFT target." Every case runs the seed's workload as the overload drill does
(``drills.domain.overload.DEFAULT_TEAMS``: interactive, standard and batch teams,
tiered admission on) at ``peak_rps`` (100 requests/s, the plan's peak) times a
load factor, through four fleets:

- **fixed**, the reference: a fleet sized for the peak at the pool's own target,
  the smallest the policy holds at a steady peak (``settled_replicas`` at 1.0; 17
  at the seed's scale), or ``fixed_replicas``; the autoscaler runs pinned (min =
  max), so it only logs;
- **plan**: fixed at the capacity plan's size for one region's peak
  (``plan_replicas``: ``drills.domain.planned_fleet``, prefill counted, 14 for the
  seed; the seed's decode-only 12 run past their knee with its 1,200-token
  prompts, see docs/fleet-simulator.md). It is reported beside the reference, so
  that the day's saving can be read against both;
- **autoscaled, cold**: every new replica takes the seed's cold start (312 s);
- **autoscaled, warm pool**: idle nodes wait with the weights on disk, a start on
  one takes 44 s (``drills.domain.fleet_scaling``); the idle nodes are GPUs that
  are up, billed with the fleet. How many is the policy's (``warm_nodes`` in its
  decision): the demand's trend one cold start ahead, at least ``warm_min`` (the
  seed's "warm minimum" against a spike no trend foretells) and at most
  ``warm_nodes``.

The pool's settings (``pool_settings``) are the seed's thresholds and pace, from 1
to twice the plan's fleet. An autoscaled fleet starts at the smallest size the
policy holds at the starting load (``settled_replicas``: probed with short runs),
and warms up for ``warmup_s`` (the policy's window fills) before the measured
window.

The cases (``load_factor``): **ramp**, 5% a minute compounding (the seed's
"1.05^6") from half of peak to peak, then ``hold_s`` at peak; **doubling**, from
half of peak to peak within ``doubling_s`` (one minute), then ``hold_s``: a region
runs at half of peak and doubles when the other region fails ("each region must
carry the whole peak alone"), so this doubling stays inside the fleet sized for
peak; **day**, a day-shaped trace (night at 20% of peak,
a half-cosine rise from 06:00 to 12:00, peak until 16:00, a half-cosine fall to
22:00) compressed into ``day_hours`` simulated hours. Compression scales the day's
shape only: requests, cold starts and the policy's windows run in real time; the
pace of scale-downs (``scale_down_interval_s``) is divided by the same factor, so
that it keeps its ratio to the day's fall (at 10 minutes a replica, a compressed
evening could not shed what a real one does). Load changes as ``rate`` events every
``step_s``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from drills.domain.capacity_plan import Scenario, plan
from drills.domain.fleet import FleetSim
from drills.domain.fleet_config import FleetConfig, FleetEvent
from drills.domain.fleet_result import FleetResult
from drills.domain.fleet_scaling import ColdStart, FleetAutoscaling
from drills.domain.overload import DEFAULT_TEAMS, Check
from drills.domain.planned_fleet import fleet_size, region_peak_rps
from drills.domain.scaling_figures import CaseFigures, measure_case
from drills.domain.workload import Arrival, ChatWorkload
from models_registry.domain.autoscaler import ScalingSettings

__all__ = [
    "FLEETS",
    "SHAPES",
    "Case",
    "CaseOutcome",
    "DayComparison",
    "DrillOutcome",
    "DrillScenario",
    "SeedArithmetic",
    "load_factor",
    "pool_settings",
    "run_drill",
    "run_trace_case",
    "seed_arithmetic",
    "settled_replicas",
]

SHAPES = ("ramp", "doubling", "day")
FLEETS = ("plan", "fixed", "cold", "warm")
_PINNED = ("plan", "fixed")
_SAVING_TARGET = 0.25
_RECOVERY_TARGET_S = 120.0
# A fleet starts empty, every conversation's first turn missing the prefix cache:
# the autoscaler's first tick waits this long (a user's 40 s between messages and
# more), and a settling probe measures one stable window after it.
_SETTLE_S = 60.0
_PROBE_S = 120.0


def pool_settings(plan_replicas: int) -> ScalingSettings:
    """The pool's autoscaling settings in the drill (the operator's choice): the
    seed's thresholds and pace, up to twice the plan's fleet."""
    return ScalingSettings(
        min_replicas=1,
        max_replicas=2 * plan_replicas,
        target_utilisation=0.7,
        scale_down_utilisation=0.5,
        stable_window_s=60.0,
        panic_window_s=6.0,
        panic_factor=2.0,
        scale_down_interval_s=600.0,
    )


@dataclass(frozen=True, slots=True)
class DrillScenario:
    """The drill's load, fleets and target (defaults: the seed's scale).

    ``peak_rps`` is the peak one region carries and ``plan_replicas`` the capacity
    plan's fleet for it (the plan fleet, and half the pool's max), both the seed's
    plan's by default (100 requests/s, 14 replicas); ``fixed_replicas`` the
    reference fleet (None: the size the policy holds at a steady peak).
    """

    peak_rps: float = field(default_factory=lambda: region_peak_rps(Scenario()))
    plan_replicas: int = field(default_factory=lambda: fleet_size(Scenario()).replicas)
    fixed_replicas: int | None = None
    start_factor: float = 0.5
    growth_per_minute: float = 0.05
    doubling_s: float = 60.0
    warmup_s: float = 180.0
    before_s: float = 120.0
    hold_s: float = 600.0
    day_hours: float = 2.0
    night_factor: float = 0.2
    warm_nodes: int = 4
    warm_min: int = 1
    step_s: float = 5.0
    ttft_target_s: float = 1.0
    settings: ScalingSettings | None = None  # None: pool_settings(plan_replicas)
    cold_start: ColdStart = field(default_factory=ColdStart)
    workload: ChatWorkload = field(
        default_factory=lambda: ChatWorkload(teams=DEFAULT_TEAMS)
    )

    def __post_init__(self) -> None:
        if self.peak_rps <= 0 or self.plan_replicas < 1:
            raise ValueError("peak_rps and plan_replicas must be positive")
        if self.fixed_replicas is not None and self.fixed_replicas < 1:
            raise ValueError("fixed_replicas must be positive (or None: probed)")
        if not 0 < self.start_factor < 1 or not 0 < self.night_factor < 1:
            raise ValueError("start_factor and night_factor must be in (0, 1)")
        if self.growth_per_minute <= 0 or self.doubling_s <= 0:
            raise ValueError("growth_per_minute and doubling_s must be positive")
        if min(self.warmup_s, self.before_s, self.hold_s) < 0:
            raise ValueError("warm-up, before and hold times must be >= 0")
        if self.day_hours <= 0 or self.step_s <= 0:
            raise ValueError("day_hours and step_s must be positive")
        if not 0 <= self.warm_min <= self.warm_nodes:
            raise ValueError("warm_min must be between 0 and warm_nodes")

    @property
    def pool(self) -> ScalingSettings:
        return self.settings or pool_settings(self.plan_replicas)

    @property
    def ramp_s(self) -> float:
        """How long 5% a minute takes from the start factor to peak."""
        return (
            60.0
            * math.log(1 / self.start_factor)
            / math.log(1 + self.growth_per_minute)
        )

    @property
    def compression(self) -> float:
        """Day-hours per simulated hour."""
        return 24.0 / self.day_hours

    @property
    def change_s(self) -> float:
        """When the ramp or the doubling begins (simulated seconds)."""
        return self.warmup_s + self.before_s

    def duration_s(self, shape: str) -> float:
        """The measured window of a case, after the warm-up."""
        if shape == "ramp":
            return self.before_s + self.ramp_s + self.hold_s
        if shape == "doubling":
            return self.before_s + self.doubling_s + self.hold_s
        return self.day_hours * 3600.0


def load_factor(scenario: DrillScenario, shape: str, at: float) -> float:
    """Return the share of peak arriving at simulated second ``at``."""
    s = scenario
    if shape == "day":
        day_hour = max(0.0, at - s.warmup_s) * s.compression / 3600.0 % 24.0
        low = s.night_factor
        if 6.0 <= day_hour < 12.0:
            return low + (1 - low) * (1 - math.cos(math.pi * (day_hour - 6) / 6)) / 2
        if 12.0 <= day_hour < 16.0:
            return 1.0
        if 16.0 <= day_hour < 22.0:
            return low + (1 - low) * (1 + math.cos(math.pi * (day_hour - 16) / 6)) / 2
        return low
    since = at - s.change_s
    if since < 0:
        return s.start_factor
    if shape == "ramp":
        growth = math.pow(1 + s.growth_per_minute, since / 60)
        return min(1.0, s.start_factor * growth)
    return min(1.0, s.start_factor + (1 - s.start_factor) * since / s.doubling_s)


def _rate_events(
    scenario: DrillScenario, shape: str, factor: Callable[[float], float]
) -> list[FleetEvent]:
    end = scenario.warmup_s + scenario.duration_s(shape)
    events, last = [], -1.0
    for index in range(math.ceil(end / scenario.step_s) + 1):
        at = index * scenario.step_s
        value = round(factor(at), 6)
        if value != last:
            events.append(FleetEvent(at=at, kind="rate", factor=value))
            last = value
    return events


@dataclass(frozen=True, slots=True)
class Case:
    """One run: a load shape through one fleet."""

    shape: str  # ramp | doubling | day
    fleet: str  # plan | fixed | cold | warm

    @property
    def name(self) -> str:
        return f"{self.shape}/{self.fleet}"


@dataclass(frozen=True, slots=True)
class CaseOutcome:
    """A case, the fleet it started with, its figures and its run."""

    case: Case
    initial_replicas: int
    figures: CaseFigures
    result: FleetResult


def _autoscaling(
    scenario: DrillScenario,
    case: Case,
    settings: ScalingSettings,
    replicas: int,
    *,
    gpus_per_replica: int,
) -> FleetAutoscaling:
    if case.fleet in _PINNED:
        settings = replace(
            settings, min_replicas=replicas, max_replicas=replicas, warm_floor=0
        )
    if case.fleet == "warm":
        settings = replace(
            settings,
            warm_nodes_min=scenario.warm_min,
            warm_nodes_max=scenario.warm_nodes,
        )
    if case.shape == "day" and case.fleet not in _PINNED:
        settings = replace(
            settings,
            scale_down_interval_s=settings.scale_down_interval_s / scenario.compression,
        )
    return FleetAutoscaling(
        settings=settings,
        cold_start=scenario.cold_start,
        warm_nodes=scenario.warm_min if case.fleet == "warm" else 0,
        # The region's GPUs: room for the pool's largest size, in GPUs.
        gpu_budget=settings.max_replicas * gpus_per_replica,
        first_tick_s=_SETTLE_S,
    )


def settled_replicas(
    config: FleetConfig, scenario: DrillScenario, factor: float
) -> int:
    """Return the smallest fleet at which the policy asks for no more replicas at
    a steady ``factor`` of peak: from the plan's size scaled to the load, one more
    at a time, each probed for ``_PROBE_S`` with the autoscaler pinned."""
    settings = scenario.pool
    n = max(settings.min_replicas, math.ceil(factor * scenario.plan_replicas))
    # The cases' own traffic: the peak's users, sending at ``factor`` of its rate.
    workload = replace(scenario.workload, arrival_rate=scenario.peak_rps)
    events = [FleetEvent(at=0.0, kind="rate", factor=round(factor, 6))]
    while n < settings.max_replicas:
        pinned = replace(settings, min_replicas=n, max_replicas=n, warm_floor=0)
        sim = FleetSim(
            replace(config, replicas=n, autoscaling=FleetAutoscaling(settings=pinned)),
            workload,
            events=events,
        )
        sim.run(_PROBE_S - _SETTLE_S, warmup_s=_SETTLE_S, drain_s=0.0)
        assert sim.scaler is not None
        needed = max(
            (
                t.decision.signals["needed"]
                for t in sim.scaler.log.ticks
                if t.decision.at >= _SETTLE_S
            ),
            default=0.0,
        )
        if needed <= n:
            return n
        n += 1
    return n


def _run_case(
    config: FleetConfig, scenario: DrillScenario, case: Case, replicas: int
) -> CaseOutcome:
    autoscaling = _autoscaling(
        scenario,
        case,
        scenario.pool,
        replicas,
        gpus_per_replica=config.perf_profile.gpus,
    )
    sim = FleetSim(
        replace(config, admission=True, replicas=replicas, autoscaling=autoscaling),
        replace(scenario.workload, arrival_rate=scenario.peak_rps),
        events=_rate_events(
            scenario, case.shape, lambda at: load_factor(scenario, case.shape, at)
        ),
    )
    result = sim.run(scenario.duration_s(case.shape), warmup_s=scenario.warmup_s)
    figures = measure_case(
        result,
        change_s=None if case.shape == "day" else scenario.change_s,
        replica_tokens_in_flight=config.replica_tokens_in_flight,
        ttft_target_s=scenario.ttft_target_s,
    )
    return CaseOutcome(case, replicas, figures, result)


def run_trace_case(
    config: FleetConfig,
    scenario: DrillScenario,
    arrivals: Sequence[Arrival],
    fleet: str,
    *,
    replicas: int | None = None,
) -> CaseOutcome:
    """Replay ``arrivals`` through ``fleet`` (``FLEETS``) from ``replicas``
    (default the plan's), measured after a warm-up of at most a quarter of the
    trace (``scenario.warmup_s`` at most).

    Raises:
        ValueError: an unknown fleet or no arrivals.
    """
    if fleet not in FLEETS:
        raise ValueError(f"fleets are {', '.join(FLEETS)}; got {fleet!r}")
    if not arrivals:
        raise ValueError("the trace has no requests")
    case = Case("trace", fleet)
    n = replicas or scenario.plan_replicas
    autoscaling = _autoscaling(
        scenario, case, scenario.pool, n, gpus_per_replica=config.perf_profile.gpus
    )
    span = max(a.at for a in arrivals)
    warmup = min(scenario.warmup_s, span / 4)
    sim = FleetSim(
        replace(config, admission=True, replicas=n, autoscaling=autoscaling),
        arrivals=arrivals,
    )
    result = sim.run(max(span - warmup, 1.0), warmup_s=warmup)
    figures = measure_case(
        result,
        change_s=None,
        replica_tokens_in_flight=config.replica_tokens_in_flight,
        ttft_target_s=scenario.ttft_target_s,
    )
    return CaseOutcome(case, n, figures, result)


@dataclass(frozen=True, slots=True)
class SeedArithmetic:
    """The seed's sum: scaling at ``scale_at`` with a ``plan_min``-minute start and
    ``growth`` a minute leaves ``utilisation`` of capacity in use on arrival."""

    scale_at: float
    growth_per_minute: float
    cold_start_s: float
    plan_min: int
    growth: float
    utilisation: float
    warm_start_s: float
    simulated_cold_start_s: float
    simulated_warm_start_s: float

    @property
    def passed(self) -> bool:
        return round(self.utilisation, 2) == 0.94

    def as_dict(self) -> dict[str, object]:
        return {
            "scale_at": self.scale_at,
            "growth_per_minute": self.growth_per_minute,
            "cold_start_s": self.cold_start_s,
            "plan_min": self.plan_min,
            "growth": self.growth,
            "utilisation_on_arrival": self.utilisation,
            "warm_start_s": self.warm_start_s,
            "simulated_cold_start_s": self.simulated_cold_start_s,
            "simulated_warm_start_s": self.simulated_warm_start_s,
            "passed": self.passed,
        }


def seed_arithmetic(cold_start: ColdStart) -> SeedArithmetic:
    """Return the capacity plan's autoscaling figures (the seed's 0.94)."""
    scenario = Scenario()
    figures = plan(scenario)
    cold = scenario.cold_start
    return SeedArithmetic(
        scale_at=cold.scale_at,
        growth_per_minute=cold.growth_per_minute,
        cold_start_s=float(figures["cold_start_s"]),
        plan_min=int(figures["cold_start_plan_min"]),
        growth=float(figures["load_growth_during_cold_start"]),
        utilisation=float(figures["utilisation_when_capacity_arrives"]),
        warm_start_s=float(figures["warm_start_s"]),
        simulated_cold_start_s=cold_start.cold_s,
        simulated_warm_start_s=cold_start.warm_s,
    )


@dataclass(frozen=True, slots=True)
class DayComparison:
    """An autoscaled fleet's day against a pinned one (``reference``: fixed or plan)."""

    fleet: str
    reference: str
    reference_replicas: int
    gpu_hours: float
    warm_gpu_hours: float
    reference_gpu_hours: float
    minutes_outside: int
    reference_minutes_outside: int
    batch_shed: int
    reference_batch_shed: int

    @property
    def saving(self) -> float:
        """Share of the reference's GPU-hours the fleet did without."""
        return 1 - self.gpu_hours / self.reference_gpu_hours

    @property
    def replica_saving(self) -> float:
        """The same, not counting the warm pool's idle nodes."""
        return 1 - (self.gpu_hours - self.warm_gpu_hours) / self.reference_gpu_hours

    @property
    def passed(self) -> bool:
        return (
            self.saving >= _SAVING_TARGET
            and self.minutes_outside <= self.reference_minutes_outside
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "fleet": self.fleet,
            "reference": self.reference,
            "reference_replicas": self.reference_replicas,
            "gpu_hours": self.gpu_hours,
            "warm_gpu_hours": self.warm_gpu_hours,
            "reference_gpu_hours": self.reference_gpu_hours,
            "saving": self.saving,
            "replica_saving": self.replica_saving,
            "minutes_outside": self.minutes_outside,
            "reference_minutes_outside": self.reference_minutes_outside,
            "batch_shed": self.batch_shed,
            "reference_batch_shed": self.reference_batch_shed,
            "passed": self.passed,
        }


@dataclass(frozen=True, slots=True)
class DrillOutcome:
    """Every case, the day's comparisons, the seed's sum and the targets.

    ``fixed_replicas`` is the reference fleet's size (None when it did not run).
    """

    scenario: DrillScenario
    fixed_replicas: int | None
    cases: tuple[CaseOutcome, ...]
    days: tuple[DayComparison, ...]
    arithmetic: SeedArithmetic
    checks: tuple[Check, ...]

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    def case(self, shape: str, fleet: str) -> CaseOutcome | None:
        return next((c for c in self.cases if c.case == Case(shape, fleet)), None)


def run_drill(
    config: FleetConfig,
    scenario: DrillScenario,
    *,
    shapes: tuple[str, ...] = SHAPES,
    fleets: tuple[str, ...] = FLEETS,
) -> DrillOutcome:
    """Run every case (``shapes`` x ``fleets``) and judge the targets on those run.

    Raises ``ValueError`` for an unknown shape or fleet.
    """
    unknown = sorted(({*shapes} - {*SHAPES}) | ({*fleets} - {*FLEETS}))
    if unknown or not shapes or not fleets:
        raise ValueError(
            f"cases are {', '.join(SHAPES)} and fleets {', '.join(FLEETS)}; "
            f"got {', '.join(unknown) or 'none'}"
        )
    config = replace(config, admission=True)
    fixed = None
    if "fixed" in fleets:
        fixed = scenario.fixed_replicas or settled_replicas(config, scenario, 1.0)
    scaled = {"cold", "warm"} & {*fleets}
    start = night = scenario.plan_replicas
    if scaled and {"ramp", "doubling"} & {*shapes}:
        start = settled_replicas(config, scenario, scenario.start_factor)
    if scaled and "day" in shapes:
        night = settled_replicas(config, scenario, scenario.night_factor)
    sizes = {"plan": scenario.plan_replicas, "fixed": fixed or 0}
    cases = [
        _run_case(
            config,
            scenario,
            Case(shape, fleet),
            sizes.get(fleet) or (night if shape == "day" else start),
        )
        for shape in SHAPES
        if shape in shapes
        for fleet in FLEETS
        if fleet in fleets
    ]
    days = tuple(
        _compare_day(c, reference)
        for reference in cases
        if reference.case.shape == "day" and reference.case.fleet in _PINNED
        for c in cases
        if c.case.shape == "day" and c.case.fleet not in _PINNED
    )
    arithmetic = seed_arithmetic(scenario.cold_start)
    outcome = DrillOutcome(scenario, fixed, tuple(cases), days, arithmetic, ())
    return replace(outcome, checks=tuple(_checks(outcome)))


def _compare_day(case: CaseOutcome, reference: CaseOutcome) -> DayComparison:
    return DayComparison(
        fleet=case.case.fleet,
        reference=reference.case.fleet,
        reference_replicas=reference.initial_replicas,
        gpu_hours=case.figures.gpu_hours,
        warm_gpu_hours=case.figures.warm_gpu_hours,
        reference_gpu_hours=reference.figures.gpu_hours,
        minutes_outside=case.figures.minutes_outside,
        reference_minutes_outside=reference.figures.minutes_outside,
        batch_shed=case.figures.shed["batch"],
        reference_batch_shed=reference.figures.shed["batch"],
    )


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} s"


def _checks(outcome: DrillOutcome) -> list[Check]:
    s = outcome.scenario
    a = outcome.arithmetic
    checks = [
        Check(
            "seed_arithmetic",
            a.passed,
            f"{a.scale_at:g} x (1 + {a.growth_per_minute:g})^{a.plan_min} = "
            f"{a.scale_at:g} x {a.growth:.2f} = {a.utilisation:.2f} (seed: 0.94)",
        )
    ]
    warm = outcome.case("doubling", "warm")
    if warm is not None:
        f = warm.figures
        context = (
            f"; the first new replica served {_s(f.first_serving_s)} after the "
            f"doubling began, the fleet reached {f.peak_replicas} replicas "
            f"{_s(f.scaled_s)} after it; peak queue {f.peak_queue_depth}"
        )
        checks.append(
            Check(
                "doubling_warm_sheds_no_interactive",
                f.shed["interactive"] == 0,
                f"interactive: {f.shed['interactive']} shed (503) of "
                f"{f.tier_requests['interactive']}; "
                f"{f.rate_limited['interactive']} answered 429 (teams over their "
                f"guaranteed share while the pool was full){context}",
            )
        )
        recovered = f.recovered_s
        checks.append(
            Check(
                "doubling_warm_ttft_back_within_2_min",
                recovered is not None and recovered <= _RECOVERY_TARGET_S,
                (
                    "p95 TTFT (interactive + standard, per 10 s) never over "
                    f"{s.ttft_target_s:g} s"
                    if not recovered
                    else f"p95 TTFT (interactive + standard, per 10 s) last over "
                    f"{s.ttft_target_s:g} s until {recovered:.0f} s after the "
                    f"doubling began (target: {_RECOVERY_TARGET_S:.0f} s); "
                    f"{f.minutes_outside} of {f.minutes} minutes outside"
                )
                + context,
            )
        )
    for fleet in ("cold", "warm"):
        ramp = outcome.case("ramp", fleet)
        if ramp is not None:
            f = ramp.figures
            checks.append(
                Check(
                    f"ramp_{fleet}_no_minute_outside",
                    f.minutes_outside == 0,
                    f"{f.minutes_outside} of {f.minutes} minutes with p95 TTFT over "
                    f"{s.ttft_target_s:g} s{_minutes_over(ramp, s)}; utilisation "
                    "when each new replica came: "
                    + (
                        ", ".join(f"{u:.2f}" for u in f.arrival_utilisation)
                        or "none came"
                    )
                    + f" (the seed's sum: {a.utilisation:.2f})",
                )
            )
    for day in outcome.days:
        if day.reference != "fixed":
            continue
        plan = next(
            (d for d in outcome.days if d.fleet == day.fleet and d.reference == "plan"),
            None,
        )
        detail = (
            f"{day.gpu_hours:.1f} GPU-hours (warm pool {day.warm_gpu_hours:.1f}) "
            f"against {day.reference_gpu_hours:.1f} for the fixed "
            f"{day.reference_replicas} ({_fewer(day.saving)}, "
            f"{_fewer(day.replica_saving)} without the warm pool; target "
            f"{_SAVING_TARGET:.0%}); minutes outside the target "
            f"{day.minutes_outside} against {day.reference_minutes_outside}"
        )
        if plan is not None:
            detail += (
                f"; against the plan's {plan.reference_replicas}: "
                f"{plan.reference_gpu_hours:.1f} GPU-hours ({_fewer(plan.saving)}), "
                f"which shed {plan.reference_batch_shed} batch requests to "
                f"{plan.batch_shed}"
            )
        checks.append(Check(f"day_{day.fleet}_saves_25_percent", day.passed, detail))
    return checks


def _fewer(saving: float) -> str:
    return f"{saving:.0%} fewer" if saving >= 0 else f"{-saving:.0%} more"


def _minutes_over(case: CaseOutcome, scenario: DrillScenario) -> str:
    series = case.figures.series
    over = [
        f"{at - scenario.change_s:+.0f} s: "
        + (f"{p:.2f} s" if p < 1e3 else "over 5% got no first token")
        for at, p in zip(series.minute_s, series.ttft_p95_s, strict=True)
        if p is not None and p > scenario.ttft_target_s
    ]
    if not over:
        return ""
    more = f" and {len(over) - 6} more" if len(over) > 6 else ""
    return f" (minutes from the ramp's start: {'; '.join(over[:6])}{more})"
