"""``manage.py autoscaling_drill --sim``: a 5%-a-minute ramp, a sudden doubling and a
day-shaped trace through fixed and autoscaled fleets in the fleet simulator; the
issue's targets and the seed's arithmetic are checked.

``--trace PATH`` replays a JSONL trace instead (a recorded one keeps its prefix
structure), ``--trace-rate-scale X`` at X times its conversations
(``drills.domain.recorded_trace.scale_trace``: "what if traffic doubles"),
through the fleets named by ``--fleets`` (``fixed`` only with
``--fixed-replicas``), and prints each fleet's replicas, GPU-hours, p95 TTFT,
minutes outside the target and prefix hit rate (no targets are checked)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from drills.domain.autoscaling_drill import (
    FLEETS,
    SHAPES,
    CaseOutcome,
    DrillOutcome,
    DrillScenario,
    run_drill,
    run_trace_case,
)
from drills.domain.fleet_config import FleetConfig
from drills.domain.overload import TIERS
from drills.domain.planned_fleet import FleetSize, region_peak_rps
from drills.domain.recorded_trace import scale_trace
from drills.domain.workload import check_block_size, read_trace, trace_arrivals
from drills.management.fleet_size import (
    add_scenario_argument,
    capacity_scenario,
    planned_fleet_size,
)
from drills.management.reports import add_result_arguments, write_result


class Command(BaseCommand):
    help = (
        "Replay a ramp of 5% a minute from half of peak to peak and a sudden "
        "doubling, each through a fixed fleet sized for peak, an autoscaled fleet "
        "with cold starts and one with a warm pool, plus a day-shaped trace; print "
        "time until new capacity serves, peak queue depth, sheds per tier, minutes "
        "outside the TTFT target and GPU-hours per case, and check the targets."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--sim",
            action="store_true",
            help="run in the fleet simulator (the only mode so far)",
        )
        parser.add_argument(
            "--peak-rps",
            type=float,
            help="requests/s at peak (default: the peak the capacity plan sizes a "
            "region for, regions_lost respected: 100 for the seed)",
        )
        parser.add_argument(
            "--plan-replicas",
            type=int,
            help="the plan fleet, instead of the capacity plan's for the peak "
            "(14 for the seed, prefill counted); the autoscaled max is twice it",
        )
        add_scenario_argument(parser)
        parser.add_argument(
            "--fixed-replicas",
            type=int,
            help="the reference fleet sized for peak (default: the smallest the "
            "autoscaler holds at a steady peak, probed)",
        )
        parser.add_argument(
            "--hold-minutes",
            type=float,
            default=10.0,
            help="minutes at peak after the ramp or the doubling",
        )
        parser.add_argument(
            "--before-minutes",
            type=float,
            default=2.0,
            help="measured minutes at half of peak before the change",
        )
        parser.add_argument("--warmup-minutes", type=float, default=3.0)
        parser.add_argument(
            "--day-hours",
            type=float,
            default=2.0,
            help="simulated hours the 24-hour day is compressed into",
        )
        parser.add_argument(
            "--warm-nodes",
            type=int,
            default=4,
            help="most nodes in the warm pool (the policy sizes it)",
        )
        parser.add_argument(
            "--warm-min",
            type=int,
            default=1,
            help="fewest nodes in the warm pool, however flat the trend",
        )
        parser.add_argument(
            "--cases", default=",".join(SHAPES), help="ramp, doubling, day"
        )
        parser.add_argument(
            "--fleets", default=",".join(FLEETS), help="plan, fixed, cold, warm"
        )
        parser.add_argument(
            "--trace",
            type=Path,
            help="replay this JSONL trace through the fleets instead of the cases",
        )
        parser.add_argument(
            "--trace-rate-scale",
            type=float,
            default=1.0,
            help="with --trace: X times the trace's conversations (clones)",
        )
        parser.add_argument("--profile", default="a100-8b")
        parser.add_argument("--seed", type=int, default=0)
        add_result_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        if not options["sim"]:
            raise CommandError(
                "only the simulated autoscaling drill exists so far: pass --sim"
            )
        from drills.experiment_plots import default_plot_path, plot_autoscaling
        from drills.fleet_settings import platform_fleet_config

        capacity, name = capacity_scenario(options["capacity_scenario"])
        peak_rps = options["peak_rps"] or region_peak_rps(capacity)
        size = planned_fleet_size(
            capacity,
            name,
            replicas=options["plan_replicas"],
            flag="--plan-replicas",
            peak_rps=options["peak_rps"],
        )
        try:
            scenario = DrillScenario(
                peak_rps=peak_rps,
                plan_replicas=size.replicas,
                fixed_replicas=options["fixed_replicas"],
                hold_s=options["hold_minutes"] * 60,
                before_s=options["before_minutes"] * 60,
                warmup_s=options["warmup_minutes"] * 60,
                day_hours=options["day_hours"],
                warm_nodes=options["warm_nodes"],
                warm_min=options["warm_min"],
            )
            config = platform_fleet_config(
                replicas=scenario.plan_replicas,
                profile=options["profile"],
                seed=options["seed"],
                admission=True,
            )
            started = time.process_time()
            if options["trace"] is not None:
                self._replay(config, scenario, options)
                return
            outcome = run_drill(
                config,
                scenario,
                shapes=_names(options["cases"]),
                fleets=_names(options["fleets"]),
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        cpu_s = time.process_time() - started
        plot = options["plot"] or default_plot_path("autoscaling_drill")
        plot_autoscaling(outcome, plot, title=_title(outcome, config))
        write_result(
            self.stdout,
            _as_json(outcome, config, size, cpu_s, plot),
            options["json"],
            lambda: self._print(outcome, config, size, cpu_s, plot),
        )
        if not outcome.passed:
            failed = [c.name for c in outcome.checks if not c.passed]
            raise CommandError(
                f"autoscaling targets missed: {', '.join(failed)} (see the checks)"
            )

    def _replay(
        self, config: FleetConfig, scenario: DrillScenario, options: dict[str, Any]
    ) -> None:
        """Replay the trace (scaled) through the named fleets and print them."""
        scale = options["trace_rate_scale"]
        try:
            trace = scale_trace(read_trace(options["trace"]), scale, seed=config.seed)
        except OSError as exc:
            raise CommandError(f"cannot read trace: {exc}") from None
        arrivals = list(trace_arrivals(trace))
        check_block_size(arrivals, config.block_size)
        fleets = [
            f
            for f in _names(options["fleets"])
            if f != "fixed" or scenario.fixed_replicas
        ]
        span = arrivals[-1].at if arrivals else 0.0
        self.stdout.write(
            f"Autoscaling drill (simulated), trace replay: {options['trace']} x{scale:g} "
            f"({len(arrivals):,} requests over {span:,.0f} s, "
            f"{len(arrivals) / max(span, 1e-9):,.1f} req/s); {config.profile}, "
            f"plan {scenario.plan_replicas} replicas, autoscaled "
            f"{scenario.pool.min_replicas}-{scenario.pool.max_replicas}"
        )
        self.stdout.write(
            f"{'fleet':<6} {'start':>5} {'peak':>5} {'mean':>6} {'p95 TTFT':>8} "
            f"{'min out':>8} {'hit rate':>8} {'GPU-h':>7} {'shed':>6}"
        )
        for fleet in fleets:
            row = run_trace_case(
                config,
                scenario,
                arrivals,
                fleet,
                replicas=scenario.fixed_replicas if fleet == "fixed" else None,
            )
            f = row.figures
            hit = row.result.summary()["prefix_hit_rate"]
            hours = row.result.duration_s / 3600
            self.stdout.write(
                f"{fleet:<6} {row.initial_replicas:>5} {f.peak_replicas:>5} "
                f"{f.gpu_hours / max(hours, 1e-9) / config.perf_profile.gpus:>6.1f} "
                f"{_s(f.ttft_p95_s):>8} {f'{f.minutes_outside}/{f.minutes}':>8} "
                f"{'-' if hit is None else f'{hit:.1%}':>8} {f.gpu_hours:>7.2f} "
                f"{sum(f.shed.values()):>6}"
            )

    def _print(
        self,
        outcome: DrillOutcome,
        config: FleetConfig,
        size: FleetSize,
        cpu_s: float,
        plot: Path,
    ) -> None:
        s = outcome.scenario
        pool = s.pool
        cold = s.cold_start
        fixed = "-" if outcome.fixed_replicas is None else outcome.fixed_replicas
        self.stdout.write(
            f"Autoscaling drill (simulated): {s.peak_rps:g} req/s at peak, "
            f"{config.profile}, {config.replica_tokens_in_flight:,} tokens in flight "
            f"a replica; fleets: plan {s.plan_replicas} ({size.source}), "
            f"fixed {fixed} (sized for peak at the target), autoscaled "
            f"{pool.min_replicas}-{pool.max_replicas} (scale up at "
            f"{pool.target_utilisation:.0%}, down under "
            f"{pool.scale_down_utilisation:.0%}, one per "
            f"{pool.scale_down_interval_s / 60:g} min); cold start "
            f"{cold.cold_s:g} s, warm start {cold.warm_s:g} s ({s.warm_min}-{s.warm_nodes} warm "
            f"nodes, sized by the trend {pool.warm_horizon_s / 60:g} min ahead); "
            f"simulated in {cpu_s:.1f} s of CPU"
        )
        self.stdout.write(
            f"ramp: x{s.start_factor:g} for {s.before_s / 60:g} min, then "
            f"{s.growth_per_minute:.0%} a minute to peak ({s.ramp_s / 60:.1f} min), "
            f"{s.hold_s / 60:g} min at peak; doubling: x{s.start_factor:g} to peak in "
            f"{s.doubling_s:g} s; day: 24 h in {s.day_hours:g} h, night at "
            f"x{s.night_factor:g}; each after a {s.warmup_s / 60:g} min warm-up"
        )
        self.stdout.write(
            "TTFT target: a minute is outside when the p95 TTFT of the interactive "
            f"and standard requests that arrived in it is over {s.ttft_target_s:g} s "
            "(no first token counts as over); times are from the change"
        )
        for shape in SHAPES:
            rows = [c for c in outcome.cases if c.case.shape == shape]
            if not rows:
                continue
            self.stdout.write("")
            self.stdout.write(f"Case: {shape}")
            self.stdout.write(
                f"{'fleet':<6} {'start':>5} {'peak':>5} {'starts':>9} "
                f"{'serves':>7} {'scaled':>7} {'back <1s':>8} {'peak q':>7} "
                f"{'503 i/s/b':>16} {'429 i/s/b':>14} {'outside':>9} "
                f"{'p95 TTFT':>8} {'GPU-h':>7} {'warm GPU-h':>10} {'drains':>8}"
            )
            self.stdout.write(
                f"{'':<6} {'repl':>5} {'repl':>5} {'(warm)':>9} {'s':>7} {'s':>7} "
                f"{'s':>8} {'req':>7} {'':>16} {'':>14} {'min':>9} {'s':>8} "
                f"{'':>7} {'':>10} {'(errors)':>8}"
            )
            for row in rows:
                self.stdout.write(_row(row))
        if outcome.days:
            self.stdout.write("")
            self.stdout.write("Day-shaped trace: GPU-hours against the pinned fleets")
            self.stdout.write(
                f"{'fleet':<6} {'against':<10} {'GPU-h':>7} {'warm':>6} {'ref GPU-h':>9} "
                f"{'fewer':>6} {'w/o warm':>8} {'outside':>7} {'ref out':>7} "
                f"{'batch 503':>9} {'ref 503':>8}"
            )
            for day in outcome.days:
                against = f"{day.reference} {day.reference_replicas}"
                self.stdout.write(
                    f"{day.fleet:<6} {against:<10} {day.gpu_hours:>7.1f} "
                    f"{day.warm_gpu_hours:>6.1f} {day.reference_gpu_hours:>9.1f} "
                    f"{day.saving:>6.0%} {day.replica_saving:>8.0%} "
                    f"{day.minutes_outside:>7} {day.reference_minutes_outside:>7} "
                    f"{day.batch_shed:>9} {day.reference_batch_shed:>8}"
                )
        a = outcome.arithmetic
        self.stdout.write("")
        self.stdout.write(
            f"Seed's arithmetic: a {a.cold_start_s:g} s cold start plans "
            f"{a.plan_min} min; scaling at {a.scale_at:.0%} with "
            f"{a.growth_per_minute:.0%} growth a minute leaves {a.scale_at:g} x "
            f"{a.growth:.2f} = {a.utilisation:.2f} of capacity in use when the "
            f"replica arrives (seed: 0.94); simulated starts {a.simulated_cold_start_s:g}"
            f" s cold, {a.simulated_warm_start_s:g} s warm"
        )
        self.stdout.write("")
        self.stdout.write("Checks (the issue's targets)")
        for check in outcome.checks:
            self.stdout.write(
                f"  {'PASS' if check.passed else 'FAIL'} {check.name}: {check.detail}"
            )
        self.stdout.write(f"plot: {plot}")


def _names(value: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in value.split(",") if name.strip())


def _row(row: CaseOutcome) -> str:
    f = row.figures
    shed = "/".join(str(f.shed[tier]) for tier in TIERS)
    limited = "/".join(str(f.rate_limited[tier]) for tier in TIERS)
    return (
        f"{row.case.fleet:<6} {row.initial_replicas:>5} {f.peak_replicas:>5} "
        f"{f'{f.starts} ({f.warm_starts})':>9} {_s(f.first_serving_s, 0):>7} "
        f"{_s(f.scaled_s, 0):>7} {_s(f.recovered_s, 0):>8} {f.peak_queue_depth:>7} "
        f"{shed:>16} {limited:>14} {f'{f.minutes_outside}/{f.minutes}':>9} "
        f"{_s(f.ttft_p95_s):>8} {f.gpu_hours:>7.2f} {f.warm_gpu_hours:>10.2f} "
        f"{f'{f.drains} ({f.drain_errors})':>8}"
    )


def _title(outcome: DrillOutcome, config: FleetConfig) -> str:
    s = outcome.scenario
    return (
        f"Autoscaling drill: {s.peak_rps:g} req/s at peak, {config.profile}, plan "
        f"{s.plan_replicas}, fixed {outcome.fixed_replicas or '-'} vs autoscaled "
        f"(cold {s.cold_start.cold_s:g} s, warm {s.cold_start.warm_s:g} s) "
        f"(seed {config.seed})"
    )


def _finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else value


def _as_json(
    outcome: DrillOutcome,
    config: FleetConfig,
    size: FleetSize,
    cpu_s: float,
    plot: Path,
) -> dict[str, Any]:
    s = outcome.scenario
    pool = s.pool
    cold = s.cold_start
    cases = []
    for row in outcome.cases:
        figures = row.figures.as_dict()
        # A p95 over requests of which more than 5% got no first token is infinite:
        # JSON has no infinity, so it is null (the minute counts as outside).
        figures["ttft_p95_s"] = _finite(row.figures.ttft_p95_s)
        cases.append(
            {
                "case": row.case.name,
                "shape": row.case.shape,
                "fleet": row.case.fleet,
                "initial_replicas": row.initial_replicas,
                **figures,
                "minute_ttft_p95_s": list(row.figures.series.ttft_p95_s),
            }
        )
    return {
        "passed": outcome.passed,
        "checks": [check.as_dict() for check in outcome.checks],
        "cases": cases,
        "day": [day.as_dict() for day in outcome.days],
        "seed_arithmetic": outcome.arithmetic.as_dict(),
        "scenario": {
            "peak_rps": s.peak_rps,
            "plan_replicas": s.plan_replicas,
            "plan_replicas_source": size.source,
            "fixed_replicas": outcome.fixed_replicas,
            "fixed_replicas_probed": s.fixed_replicas is None,
            "profile": config.profile,
            "policy": config.policy,
            "replica_tokens_in_flight": config.replica_tokens_in_flight,
            "start_factor": s.start_factor,
            "growth_per_minute": s.growth_per_minute,
            "ramp_s": s.ramp_s,
            "doubling_s": s.doubling_s,
            "warmup_s": s.warmup_s,
            "before_s": s.before_s,
            "hold_s": s.hold_s,
            "day_hours": s.day_hours,
            "night_factor": s.night_factor,
            "warm_nodes": s.warm_nodes,
            "warm_min": s.warm_min,
            "ttft_target_s": s.ttft_target_s,
            "cold_start_s": cold.cold_s,
            "warm_start_s": cold.warm_s,
            "autoscaling": {
                "min_replicas": pool.min_replicas,
                "max_replicas": pool.max_replicas,
                "target_utilisation": pool.target_utilisation,
                "scale_down_utilisation": pool.scale_down_utilisation,
                "stable_window_s": pool.stable_window_s,
                "panic_window_s": pool.panic_window_s,
                "panic_factor": pool.panic_factor,
                "scale_down_interval_s": pool.scale_down_interval_s,
            },
            "seed": config.seed,
        },
        "cpu_s": round(cpu_s, 2),
        "plot": str(plot),
    }


def _s(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if not math.isfinite(value):
        return "inf"
    return f"{value:.{digits}f}"
