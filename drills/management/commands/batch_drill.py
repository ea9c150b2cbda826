"""``manage.py batch_drill [--sim]``: batch jobs fill a region's idle capacity on a
day-shaped trace in the fleet simulator, paced by the platform's batch scheduler;
USD per million tokens, utilisation, interactive p95 TTFT and deadlines, with and
without batch and with idle-only scheduling (``drills.domain.batch_drill``)."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from batches.domain.guard import BatchGuard
from batches.domain.scheduler import SchedulerSettings
from drills.domain.batch_drill import (
    CASES,
    BatchDrillOutcome,
    BatchScenario,
    CaseResult,
    CeilingPoint,
    JobOutcome,
    run_batch_drill,
    small_scenario,
    sweep_ceilings,
)
from drills.domain.capacity_plan import Scenario
from drills.domain.fleet_config import FleetConfig
from drills.domain.planned_fleet import SEED_NAME, FleetSize
from drills.domain.replica import SCHEDULING_POLICIES
from drills.management.fleet_size import planned_fleet_size
from drills.management.reports import add_result_arguments, write_result

_COLOURS = {
    "interactive": "#1f77b4",
    "deadline": "#2ca02c",
    "idle_only": "#ff7f0e",
    "deadline_fcfs": "#9467bd",
}


class Command(BaseCommand):
    help = (
        "Run one region's day (interactive chat at half load on average) three "
        "times in the fleet simulator: without batch, with batch jobs paced by the "
        "batch scheduler's deadline policy, and with the same jobs on idle capacity "
        "only; print USD per million tokens, utilisation, interactive p95 TTFT and "
        "the jobs' deadlines, and check the issue's targets."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--sim",
            action="store_true",
            help="run in the fleet simulator (the default and only mode)",
        )
        parser.add_argument(
            "--small",
            action="store_true",
            help="a scale a test runs in seconds: 2 replicas, the day in 12 minutes",
        )
        parser.add_argument(
            "--replicas",
            type=int,
            help="the region's chat replicas (default: the capacity plan's for the "
            "seed, 14)",
        )
        parser.add_argument(
            "--day-hours",
            type=float,
            help="simulated hours the 24-hour day is compressed into (default 1)",
        )
        parser.add_argument(
            "--mean-load",
            type=float,
            help="the day's mean interactive output, share of the seed's 12 "
            "replicas' full 2,500 tokens/s each (default 0.5: half load)",
        )
        parser.add_argument(
            "--night-factor",
            type=float,
            help="the night's load as a share of the day's peak (default 0.5)",
        )
        parser.add_argument(
            "--batch-ceiling",
            type=float,
            help="admit batch below this share of the pool's capacity (default: "
            "PLATFORM_BATCH_CEILING)",
        )
        parser.add_argument(
            "--max-window",
            type=int,
            help="the scheduler's most lines in flight per job (default: "
            "PLATFORM_BATCH_MAX_WINDOW)",
        )
        parser.add_argument(
            "--backfill-jobs",
            type=int,
            help="day-long bulk jobs submitted at midnight (default 10 for 12 "
            "replicas, in proportion: 12 on the plan's 14)",
        )
        parser.add_argument(
            "--engine-scheduling",
            choices=SCHEDULING_POLICIES,
            help="the replicas' engine scheduling policy (vLLM's "
            "--scheduling-policy; default priority: the tier's rank)",
        )
        parser.add_argument(
            "--cases",
            help=f"{', '.join(CASES)} (default: all; deadline_fcfs only when the "
            "engines are not fcfs anyway)",
        )
        parser.add_argument(
            "--ceilings",
            help="comma-separated batch ceilings, e.g. 0.5,0.6,0.7,0.9: instead of "
            "the cases, run the day without batch once and the deadline case at "
            "each ceiling; print USD/M and the interactive p95 TTFT ratio per "
            "ceiling (no checks)",
        )
        parser.add_argument(
            "--no-guard",
            action="store_true",
            help="run without the batch guard (batches.domain.guard): the engines' "
            "priority queue only, batch unbounded in KV and prefill, no forecast",
        )
        parser.add_argument(
            "--guard-kv-share",
            type=float,
            help="the guard's most of a replica's KV cache batch may hold "
            "(default: PLATFORM_BATCH_GUARD_KV_SHARE)",
        )
        parser.add_argument(
            "--guard-prefill-tokens",
            type=int,
            help="the guard's most batch prefill tokens an engine step takes "
            "(default: PLATFORM_BATCH_GUARD_PREFILL_TOKENS)",
        )
        parser.add_argument(
            "--guard-backoff",
            help="FROM,TO: batch's window falls from all at FROM to none at TO of "
            "the pool's capacity in forecast interactive demand (default: "
            "PLATFORM_BATCH_GUARD_BACKOFF_FROM and _TO)",
        )
        parser.add_argument(
            "--guard-raised-share",
            type=float,
            help="the share of its window a job raised for its deadline keeps under "
            "the back-off (default: PLATFORM_BATCH_GUARD_RAISED_SHARE)",
        )
        parser.add_argument("--profile", default="a100-8b")
        parser.add_argument("--seed", type=int, default=0)
        add_result_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        from django.conf import settings

        from drills.experiment_plots import default_plot_path
        from drills.fleet_settings import platform_fleet_config

        scenario = small_scenario() if options["small"] else BatchScenario()
        if options["small"] and options["replicas"] is None:
            n = scenario.replicas
            size = FleetSize(n, f"the small scale's {n}", is_planned=False)
        else:
            # The flag's, or the capacity plan's for the seed.
            size = planned_fleet_size(
                Scenario(), SEED_NAME, replicas=options["replicas"]
            )
        overrides: dict[str, Any] = {
            name: options[name]
            for name in (
                "day_hours",
                "mean_load",
                "night_factor",
                "batch_ceiling",
                "engine_scheduling",
                "backfill_jobs",
            )
            if options[name] is not None
        }
        try:
            # The live runner's settings; the small scale keeps its own.
            scheduler = (
                scenario.settings
                if options["small"]
                else _live_scheduler(settings, settings.PLATFORM_BATCH_MAX_WINDOW)
            )
            window = options["max_window"]
            if window is not None:
                scheduler = replace(
                    scheduler,
                    initial_window=min(scheduler.initial_window, window),
                    max_window=window,
                )
            scenario = replace(
                scenario,
                settings=scheduler,
                guard=None if options["no_guard"] else _guard(options),
                replicas=size.replicas,
                **overrides,
            )
            config = platform_fleet_config(
                profile=options["profile"], seed=options["seed"], admission=True
            )
            wall0, cpu0 = time.monotonic(), time.process_time()
            if options["ceilings"] is not None:
                self._sweep(config, scenario, options, wall0, cpu0)
                return
            names = _names(options["cases"]) if options["cases"] is not None else None
            outcome = run_batch_drill(config, scenario, cases=names)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        timing = {
            "wall_s": round(time.monotonic() - wall0, 1),
            "cpu_s": round(time.process_time() - cpu0, 1),
        }
        plot = options["plot"] or default_plot_path("batch_drill")
        plot_batch_drill(outcome, plot, title=_title(outcome, config))
        write_result(
            self.stdout,
            _as_json(outcome, config, timing, plot, size),
            options["json"],
            lambda: self._print(outcome, config, timing, plot, size),
        )
        if not outcome.passed:
            failed = [c.name for c in outcome.checks if not c.passed]
            raise CommandError(
                f"batch targets missed: {', '.join(failed)} (see the checks)"
            )

    def _sweep(
        self,
        config: FleetConfig,
        scenario: BatchScenario,
        options: dict[str, Any],
        wall0: float,
        cpu0: float,
    ) -> None:
        try:
            ceilings = [float(v) for v in _names(options["ceilings"])]
        except ValueError:
            raise ValueError(
                f"--ceilings: numbers, comma-separated; got {options['ceilings']!r}"
            ) from None
        base, points = sweep_ceilings(config, scenario, ceilings)
        cpu_s = round(time.process_time() - cpu0, 1)
        wall_s = round(time.monotonic() - wall0, 1)
        data = {
            "interactive": {
                "usd_per_m_tokens": base.usd_per_m,
                "utilisation": base.utilisation,
                "interactive_ttft_p95_s": base.ttft_p95_s,
            },
            "ceilings": [point.as_dict() for point in points],
            "engine_scheduling": scenario.engine_scheduling,
            "ttft_ratio_target": scenario.ttft_ratio_target,
            "day_hours": scenario.day_hours,
            "seed": config.seed,
            "cpu_s": cpu_s,
            "wall_s": wall_s,
        }
        write_result(
            self.stdout,
            data,
            options["json"],
            lambda: self._print_sweep(config, scenario, base, points, cpu_s, wall_s),
        )

    def _print_sweep(
        self,
        config: FleetConfig,
        scenario: BatchScenario,
        base: CaseResult,
        points: tuple[CeilingPoint, ...],
        cpu_s: float,
        wall_s: float,
    ) -> None:
        write = self.stdout.write
        write(
            f"Batch ceiling sweep (simulated): the deadline case on {scenario.replicas}"
            f" x {config.profile}, engine scheduling {scenario.engine_scheduling}, "
            f"24 h in {scenario.day_hours:g} h, seed {config.seed}; without batch: "
            f"USD/M {_f(base.usd_per_m, 3)}, interactive p95 {_ms(base.ttft_p95_s)} ms; "
            f"{cpu_s:g} s of CPU ({wall_s:g} s wall)"
        )
        write(
            f"{'ceiling':>7} {'USD/M':>6} {'util':>5} {'i p95':>6} {'x a':>6} "
            f"{'within':>6} {'met/missed':>10}"
        )
        for p in points:
            within = p.ttft_ratio is not None and p.ttft_ratio <= (
                scenario.ttft_ratio_target
            )
            write(
                f"{p.batch_ceiling:>7g} {_f(p.usd_per_m, 3):>6} {p.utilisation:>5.2f} "
                f"{_ms(p.ttft_p95_s):>6} {_f(p.ttft_ratio, 3):>6} "
                f"{'yes' if within else 'no':>6} {f'{p.met}/{p.missed}':>10}"
            )

    def _print(
        self,
        outcome: BatchDrillOutcome,
        config: FleetConfig,
        timing: dict[str, float],
        plot: Path,
        size: FleetSize,
    ) -> None:
        s = outcome.scenario
        w = s.settings
        write = self.stdout.write
        write(
            f"Batch drill (simulated): one region of {s.replicas} x {config.profile} "
            f"({size.source}; the other region is identical and independent: same "
            f"figures, twice the GPU-hours and tokens); interactive chat at "
            f"{s.mean_load:g} of {s.load_replicas} replicas' full "
            f"{s.load_replicas * s.tokens_per_s:,.0f} output tokens/s on average over "
            f"the day (peak {outcome.peak_rps:.1f} requests/s, night at "
            f"x{s.night_factor:g} of it), 24 h compressed into {s.day_hours:g} h; "
            f"batch ceiling {outcome.batch_ceiling:g}; batch lane "
            f"{config.batch_lane:g}; " + _guard_text(s.guard) + "; engine scheduling "
            f"{s.engine_scheduling} (deadline_fcfs: fcfs); scheduler window "
            f"{w.initial_window}-{w.max_window}, judged after "
            f"{w.min_observed_s:g} + {w.rate_window_s:g} s, safety x{w.safety:g}; "
            f"seed {config.seed}; {timing['cpu_s']:g} s of CPU "
            f"({timing['wall_s']:g} s wall)"
        )
        write(
            f"USD/M: GPU-hours x {s.usd_per_gpu_hour:.2f} over the output tokens "
            f"made in the day (interactive and batch; the seed counts output "
            f"tokens), {s.full_usd_per_m:.3f} when full; utilisation: those tokens "
            f"over {s.tokens_per_s:,.0f} a replica; in flight: admission's tokens in "
            "flight over the pool's capacity"
        )
        write("")
        write(
            f"{'case':<13} {'GPU-h':>6} {'USD/M':>6} {'util':>5} {'in flight':>9} "
            f"{'i p50':>6} {'i p95':>6} {'x a':>6} {'i refused':>9} "
            f"{'batch Mtok':>10} {'lines':>8} {'met/missed':>10} {'at risk':>7} "
            f"{'worst min p95':>13} {'preempted':>9}"
        )
        for case in outcome.cases:
            write(_row(outcome, case))
        for case in outcome.cases:
            if not case.jobs:
                continue
            write("")
            write(f"Jobs, {case.case} (times are day-hours)")
            write(
                f"{'job':<11} {'lines':>7} {'done':>7} {'submit':>6} {'due':>6} "
                f"{'finished':>8} {'met':>4} {'raised':>6} {'at risk':>7} "
                f"{'refused':>7}  at risk because"
            )
            for job in case.jobs:
                write(_job_row(s, job))
        write("")
        write("Checks (the issue's targets)")
        for check in outcome.checks:
            write(
                f"  {'PASS' if check.passed else 'FAIL'} {check.name}: {check.detail}"
            )
        write(f"plot: {plot}")


def _live_scheduler(settings: Any, window: int) -> SchedulerSettings:
    """The live runner's scheduler settings, with ``window`` as its max."""
    return SchedulerSettings(
        initial_window=min(settings.PLATFORM_BATCH_INITIAL_WINDOW, window),
        max_window=window,
        min_observed_s=settings.PLATFORM_BATCH_MIN_OBSERVED_S,
        rate_window_s=settings.PLATFORM_BATCH_RATE_WINDOW_S,
    )


def _guard(options: dict[str, Any]) -> BatchGuard:
    """The live guard's settings (the runner's), with the command's overrides."""
    from batches.knobs import guard_settings

    guard = guard_settings()
    if options["guard_kv_share"] is not None:
        guard = replace(guard, kv_share=options["guard_kv_share"])
    if options["guard_prefill_tokens"] is not None:
        guard = replace(guard, prefill_tokens=options["guard_prefill_tokens"])
    if options["guard_backoff"] is not None:
        try:
            low, high = (float(v) for v in options["guard_backoff"].split(","))
        except ValueError:
            raise ValueError(
                f"--guard-backoff: FROM,TO; got {options['guard_backoff']!r}"
            ) from None
        guard = replace(guard, backoff_from=low, backoff_to=high)
    if options["guard_raised_share"] is not None:
        guard = replace(guard, raised_share=options["guard_raised_share"])
    return guard


def _guard_text(guard: BatchGuard | None) -> str:
    if guard is None:
        return "no batch guard"
    return (
        f"batch guard: KV share {guard.kv_share:g}, {guard.prefill_tokens} batch "
        f"prefill tokens a step ({guard.prefill_beside_interactive} beside an "
        f"interactive prompt), back-off {guard.backoff_from:g}-"
        f"{guard.backoff_to:g} of capacity {guard.horizon_s:g} s ahead (a job "
        f"raised for its deadline keeps {guard.raised_share:g} of its window)"
    )


def _names(value: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in value.split(",") if name.strip())


def _row(outcome: BatchDrillOutcome, case: CaseResult) -> str:
    ratio = outcome.ttft_ratio(case.case)
    at_risk = sum(job.at_risk_s is not None for job in case.jobs)
    jobs = f"{case.met}/{case.missed}" if case.jobs else "-"
    return (
        f"{case.case:<13} {case.gpu_hours:>6.1f} {_f(case.usd_per_m, 3):>6} "
        f"{case.utilisation:>5.2f} {case.in_flight_utilisation:>9.2f} "
        f"{_ms(case.ttft_p50_s):>6} {_ms(case.ttft_p95_s):>6} "
        f"{_f(ratio, 3):>6} {case.interactive_refused:>9} "
        f"{case.batch_output_tokens / 1e6:>10.1f} {case.batch_lines:>8} "
        f"{jobs:>10} {at_risk if case.jobs else '-':>7} "
        f"{_ms(case.worst_minute_p95_s):>13} {case.preemptions:>9}"
    )


def _job_row(s: BatchScenario, job: JobOutcome) -> str:
    def hour(at: float | None) -> str:
        return "-" if at is None else f"{at / s.hour_s:.1f}"

    return (
        f"{job.name:<11} {job.lines:>7} {job.finished_lines:>7} "
        f"{hour(job.submitted_s):>6} {hour(job.deadline_s):>6} "
        f"{hour(job.finished_s):>8} {'yes' if job.met else 'NO':>4} "
        f"{hour(job.escalated_s):>6} "
        f"{hour(job.at_risk_s):>7} {job.refused:>7}  {job.at_risk_reason or '-'}"
    )


def _title(outcome: BatchDrillOutcome, config: FleetConfig) -> str:
    s = outcome.scenario
    return (
        f"Batch drill: one region, {s.replicas} x {config.profile}, interactive at "
        f"{s.mean_load:g} of {s.load_replicas}'s full on average, batch ceiling {outcome.batch_ceiling:g},"
        f" window {s.settings.max_window} (seed {config.seed})"
    )


def _as_json(
    outcome: BatchDrillOutcome,
    config: FleetConfig,
    timing: dict[str, float],
    plot: Path,
    size: FleetSize,
) -> dict[str, Any]:
    s = outcome.scenario
    w = s.settings
    cases = []
    for case in outcome.cases:
        figures = case.as_dict()
        figures["interactive_ttft_ratio"] = outcome.ttft_ratio(case.case)
        cases.append(figures)
    return {
        "passed": outcome.passed,
        "checks": [check.as_dict() for check in outcome.checks],
        "cases": cases,
        "scenario": {
            "regions_simulated": 1,
            "regions": 2,
            "replicas": s.replicas,
            "replicas_source": size.source,
            "load_replicas": s.load_replicas,
            "profile": config.profile,
            "tokens_per_s": s.tokens_per_s,
            "usd_per_gpu_hour": s.usd_per_gpu_hour,
            "full_usd_per_m_tokens": s.full_usd_per_m,
            "mean_load": s.mean_load,
            "night_factor": s.night_factor,
            "peak_rps": outcome.peak_rps,
            "day_hours": s.day_hours,
            "warmup_s": s.warmup_s,
            "batch_ceiling": outcome.batch_ceiling,
            "batch_lane": config.batch_lane,
            "engine_scheduling": s.engine_scheduling,
            "ttft_ratio_target": s.ttft_ratio_target,
            "usd_per_m_target": s.usd_per_m_target,
            "minute_p95_target_s": s.minute_p95_target_s,
            "guard": None if s.guard is None else asdict(s.guard),
            "scheduler": {
                "initial_window": w.initial_window,
                "max_window": w.max_window,
                "safety": w.safety,
                "min_observed_s": w.min_observed_s,
                "rate_window_s": w.rate_window_s,
            },
            "batch_teams": {
                team.name: team.tokens_per_minute for team in s.batch_teams
            },
            "seed": config.seed,
        },
        **timing,
        "plot": str(plot),
    }


def plot_batch_drill(outcome: BatchDrillOutcome, path: Path, *, title: str) -> Path:
    """Per case over the day: utilisation (with the offered interactive load),
    USD per million tokens (the seed's 0.28 full and 0.56 half busy dotted) and the
    interactive p95 TTFT; and each job's window from submission to deadline, with
    when it finished (a dot), was raised to standard (a triangle) and was reported
    at risk (a cross), per case with jobs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = outcome.scenario
    fig, axes = plt.subplots(2, 2, figsize=(14, 9), layout="constrained")
    (util_ax, usd_ax), (ttft_ax, jobs_ax) = axes
    width = 24.0 / max(1, len(outcome.cases[0].series.day_h)) if outcome.cases else 1
    for case in outcome.cases:
        series = case.series
        hours = [h + width / 2 for h in series.day_h]
        colour = _COLOURS.get(case.case, "black")
        util_ax.plot(hours, series.utilisation, color=colour, label=case.case)
        usd_ax.plot(
            hours,
            [math.nan if v is None else v for v in series.usd_per_m],
            color=colour,
            label=case.case,
        )
        ttft_ax.plot(
            hours,
            [math.nan if v is None else v * 1000 for v in series.ttft_p95_s],
            color=colour,
            label=case.case,
        )
    if outcome.cases:
        first = outcome.cases[0].series
        peak_share = s.mean_load / (sum(first.load) / len(first.load))
        util_ax.plot(
            [h + width / 2 for h in first.day_h],
            [f * peak_share for f in first.load],
            color="grey",
            linestyle=":",
            label="offered interactive",
        )
    util_ax.set(
        title="Utilisation (output tokens / 2,500 a replica)",
        xlabel="day-hour",
        xlim=(0, 24),
        ylim=(0, None),
    )
    usd_ax.axhline(s.full_usd_per_m, color="grey", linestyle=":")
    usd_ax.axhline(2 * s.full_usd_per_m, color="grey", linestyle=":")
    usd_ax.set(
        title="USD per million output tokens",
        xlabel="day-hour",
        xlim=(0, 24),
        ylim=(0, 3 * s.full_usd_per_m),
    )
    ttft_ax.set(
        title="Interactive p95 TTFT (ms, by arrival)",
        xlabel="day-hour",
        xlim=(0, 24),
        ylim=(0, None),
    )
    with_jobs = [case for case in outcome.cases if case.jobs]
    labels: list[str] = []
    for k, case in enumerate(with_jobs):
        colour = _COLOURS.get(case.case, "black")
        for j, job in enumerate(case.jobs):
            y = j * (len(with_jobs) + 1) + k
            if k == 0:
                labels.append(job.name)
            hour = s.hour_s
            jobs_ax.plot(
                [job.submitted_s / hour, job.deadline_s / hour],
                [y, y],
                color=colour,
                linewidth=3,
                alpha=0.35,
            )
            if job.finished_s is not None:
                jobs_ax.plot(job.finished_s / hour, y, "o", color=colour)
            if job.escalated_s is not None:
                jobs_ax.plot(job.escalated_s / hour, y, "^", color=colour)
            if job.at_risk_s is not None:
                jobs_ax.plot(job.at_risk_s / hour, y, "x", color="red")
    if with_jobs:
        step = len(with_jobs) + 1
        jobs_ax.set_yticks(
            [j * step + (len(with_jobs) - 1) / 2 for j in range(len(labels))],
            labels,
        )
    jobs_ax.invert_yaxis()
    jobs_ax.set(
        title="Jobs: submitted to due; finished o, raised ^, at risk x",
        xlabel="day-hour",
        xlim=(0, 24),
    )
    for ax in (util_ax, usd_ax, ttft_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _f(value: float | None, digits: int) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"
