"""``manage.py failover_drill [--sim]``: the failover game day. One of two regions
is lost; the report gives the time until errors stop, interactive TTFT during the
shift, batch work delayed and requests failed, and checks the issue's targets.

``--sim`` runs it in the fleet simulator at the seed's scale
(``drills.domain.failover_drill``); without it the live drill runs
(``drills.failover_live.run_live``: HAProxy, two regions, the load generator).
Both give a ``FailoverReport``, printed, plotted and written the same way.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from drills.domain.capacity_plan import Scenario, plan
from drills.domain.failover_drill import (
    FailoverReport,
    planned_scenario,
    run_failover_sim,
    small_scenario,
    with_trace,
)
from drills.domain.failover_trace import RegionTrace, split_regions
from drills.management.fleet_size import capacity_scenario
from drills.management.reports import add_result_arguments, write_result


class Command(BaseCommand):
    help = (
        "Lose one of two regions at half load and move its traffic to the "
        "survivor: print the time until errors stop, interactive TTFT before and "
        "during the shift, batch work delayed and requests failed, and check the "
        "targets (errors stop within the health-check window; no interactive "
        "request inside its guarantee shed). --sim: in the fleet simulator."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--sim",
            action="store_true",
            help="run in the fleet simulator (two regions, each of the capacity "
            "plan's fleet for a region: 14 chat + 3 reasoning replicas for the "
            "seed); without it, the live drill",
        )
        parser.add_argument(
            "--small",
            action="store_true",
            help="(--sim) a scale a test runs in seconds: 2 chat + 1 reasoning "
            "replica a region",
        )
        parser.add_argument(
            "--loss-at",
            type=float,
            help="seconds into the measured window when the region is lost "
            "(sim default 180)",
        )
        parser.add_argument(
            "--duration",
            type=float,
            help="measured seconds in all, the loss inside them (sim default 780)",
        )
        parser.add_argument(
            "--check-inter",
            type=float,
            help="the load balancer's health-check interval, s (default 2, "
            "HAProxy's inter)",
        )
        parser.add_argument(
            "--check-fall",
            type=int,
            help="failed checks before a region is down (default 2, HAProxy's fall)",
        )
        parser.add_argument(
            "--warm-nodes",
            type=int,
            help="(--sim) nodes per pool on the survivor waiting with the weights "
            "on disk: a start on one takes 44 s, not 312 (default 0)",
        )
        parser.add_argument(
            "--scenario",
            type=Path,
            help="(--sim) capacity-plan scenario file (YAML or JSON, as "
            "capacity_plan's): the fleet is the plan's for it (default the seed)",
        )
        parser.add_argument(
            "--chat-replicas",
            type=int,
            help="(--sim) chat replicas a region instead of the plan's",
        )
        parser.add_argument(
            "--trace",
            type=Path,
            help="(--sim) a recorded trace (export_traffic's JSON lines) as the chat "
            "pool's traffic: each conversation in one region, the traced teams "
            "guaranteed their share with a quarter to spare; the window fitted "
            "inside the trace",
        )
        parser.add_argument(
            "--trace-rate-scale",
            type=float,
            default=1.0,
            help="with --trace: X times the trace's conversations (clones)",
        )
        parser.add_argument("--seed", type=int, default=0)
        add_result_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        from drills.experiment_plots import default_plot_path

        wall0, cpu0 = time.monotonic(), time.process_time()
        report = _run_sim(options) if options["sim"] else _run_live_drill(options)
        timing = {
            "wall_s": round(time.monotonic() - wall0, 1),
            "cpu_s": round(time.process_time() - cpu0, 1),
        }
        plot = options["plot"] or default_plot_path("failover_drill")
        plot_failover(report, plot)
        data = {**report.as_dict(), **timing, "plot": str(plot)}
        write_result(
            self.stdout,
            data,
            options["json"],
            lambda: print_report(self.stdout.write, report, timing, plot),
        )
        if not report.passed:
            failed = [c.name for c in report.checks if not c.passed]
            raise CommandError(
                f"failover targets missed: {', '.join(failed)} (see the checks)"
            )


def _run_sim(options: dict[str, Any]) -> FailoverReport:
    from drills.fleet_settings import platform_fleet_config

    names = {
        "loss_at": "loss_at_s",
        "duration": "duration_s",
        "check_inter": "check_inter_s",
        "check_fall": "check_fall",
        "warm_nodes": "warm_nodes",
        "chat_replicas": "chat_replicas",
    }
    overrides = {
        field: options[name]
        for name, field in names.items()
        if options.get(name) is not None
    }
    try:
        scenario = (
            small_scenario()
            if options["small"]
            else planned_scenario(plan(_capacity_scenario(options.get("scenario"))))
        )
        config = platform_fleet_config(seed=options["seed"], admission=True)
        if options.get("trace") is not None:
            trace = _region_trace(options, config.block_size)
            scenario = with_trace(scenario, trace)
        scenario = replace(scenario, **overrides)
        return run_failover_sim(config, scenario)
    except ValueError as exc:
        raise CommandError(str(exc)) from None


def _region_trace(options: dict[str, Any], block_size: int) -> RegionTrace:
    """The trace, scaled, as arrivals split between the two regions."""
    from drills.domain.recorded_trace import scale_trace
    from drills.domain.workload import check_block_size, read_trace, trace_arrivals

    scale = options["trace_rate_scale"]
    if not scale > 0:
        raise ValueError("--trace-rate-scale must be positive")
    try:
        trace = scale_trace(read_trace(options["trace"]), scale, seed=options["seed"])
    except OSError as exc:
        raise ValueError(f"cannot read trace: {exc}") from None
    arrivals = list(trace_arrivals(trace))
    check_block_size(arrivals, block_size)
    return split_regions(arrivals, seed=options["seed"])


def _capacity_scenario(path: Path | None) -> Scenario:
    """The capacity plan's scenario: the seed's, or the file's."""
    return capacity_scenario(path)[0]


def _run_live_drill(options: dict[str, Any]) -> FailoverReport:
    try:
        from drills.failover_live import run_live  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        raise CommandError("live drill not available: pass --sim") from None
    report: FailoverReport = run_live(**options)
    return report


# -- the report (shared by both modes) ------------------------------------------------


def print_report(
    write: Any, report: FailoverReport, timing: dict[str, float], plot: Path
) -> None:
    """Write the report's table through ``write`` (one line a call)."""
    sc = report.scenario
    pools = sc.get("pools")
    fleet = (
        ", ".join(
            f"{name} {p['replicas']} x {p['profile']}"
            for name, p in pools.items()
            if isinstance(p, dict)
        )
        if isinstance(pools, dict)
        else "-"
    )
    write(
        f"Failover drill ({'simulated' if report.mode == 'sim' else report.mode}): "
        f"two regions of {fleet}, each at {sc.get('load_share', '-')} of the "
        f"peak; one lost {sc.get('loss_at_s', '-')} s into the window; "
        f"health-check window {report.window_s:g} s (inter "
        f"{sc.get('check_inter_s', '-')} s x fall {sc.get('check_fall', '-')}); "
        f"client retries {'on' if sc.get('client_retries') else 'off'}; warm "
        f"nodes {sc.get('warm_nodes', '-')}; seed "
        f"{sc.get('seed', '-')}; {timing['cpu_s']:g} s of CPU "
        f"({timing['wall_s']:g} s wall)"
    )
    trace = sc.get("chat_trace")
    if isinstance(trace, dict):
        tiers = sc.get("measured_tiers")
        measured = ", ".join(map(str, tiers)) if isinstance(tiers, list) else "-"
        write(
            f"Chat traffic: a recorded trace, {trace['requests']:,} requests over "
            f"{trace['span_s']:,.0f} s ({trace['rps']:,.1f} req/s in both regions; "
            f"{trace['lost_region_requests']:,} in the lost one's conversations), "
            f"{trace['teams']} traced teams each guaranteed its share with a quarter "
            f"to spare; the 'interactive' figures are of the tiers "
            f"{measured}; window "
            f"{sc.get('warmup_s', 0):.0f} s of warm-up and "
            f"{sc.get('duration_s', 0):.0f} s measured"
        )
    write("")
    stop = report.errors_stop_s
    causes = report.failed_by_cause
    rows = [
        ("errors stop after the loss", "-" if stop is None else f"{stop:.1f} s"),
        ("health-check window", f"{report.window_s:g} s"),
        (
            "requests failed / total",
            f"{report.requests_failed} / {report.requests_total}",
        ),
        *((f"  failed: {cause}", str(n)) for cause, n in causes.items()),
        ("rate limited (429) on the survivor", str(report.rate_limited)),
        (
            "interactive TTFT p50 / p95 before",
            f"{_ms(report.interactive_ttft_p50_before_s)} / "
            f"{_ms(report.interactive_ttft_p95_before_s)} ms",
        ),
        (
            "interactive TTFT p50 / p95 during the shift",
            f"{_ms(report.interactive_ttft_p50_shift_s)} / "
            f"{_ms(report.interactive_ttft_p95_shift_s)} ms",
        ),
        (
            "interactive refused inside (429 of it) / outside guarantee",
            f"{report.interactive_shed_inside} ({report.inside_rate_limited}) / "
            f"{report.interactive_shed_outside}",
        ),
        ("batch shed on the survivor", str(report.batch_shed)),
        (
            "batch output tokens after the loss / no loss",
            f"{_n(report.batch_tokens_shift)} / {_n(report.batch_tokens_baseline)}",
        ),
        (
            "batch work delayed",
            f"{_n(report.batch_tokens_delayed)} tokens "
            f"({_f(report.batch_delay_s, 0)} s of its usual pace)",
        ),
    ]
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        write(f"{label:<{width}}  {value}")
    write("")
    write(
        f"{'pool':<10} {'repl before':>11} {'peak':>5} {'end':>4} {'new at':>7} "
        f"{'p95 before':>10} {'p95 shift':>9} {'hit before':>10} {'hit shift':>9} "
        f"{'refused in/out':>14} {'429 i/s':>8}"
    )
    for pool in report.pools:
        new = pool.first_new_serving_s
        limited = pool.rate_limited
        shed = f"{pool.interactive_shed_inside}/{pool.interactive_shed_outside}"
        refused = f"{limited.get('interactive', 0)}/{limited.get('standard', 0)}"
        write(
            f"{pool.pool:<10} {pool.replicas_before:>11} {pool.replicas_peak:>5} "
            f"{pool.replicas_end:>4} {'-' if new is None else f'{new:.0f} s':>7} "
            f"{_ms(pool.interactive_ttft_p95_before_s):>7} ms "
            f"{_ms(pool.interactive_ttft_p95_shift_s):>6} ms "
            f"{_pct(pool.hit_rate_before):>10} {_pct(pool.hit_rate_shift):>9} "
            f"{shed:>14} {refused:>8}"
        )
    write("")
    write("Checks (the issue's targets)")
    for check in report.checks:
        write(f"  {'PASS' if check.passed else 'FAIL'} {check.name}: {check.detail}")
    write(f"plot: {plot}")


def plot_failover(report: FailoverReport, path: Path) -> Path:
    """Per step, from the loss: errors, interactive p95 TTFT, the survivor's
    replicas per pool, its batch output tokens/s and prefix-cache hit rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = report.series
    at = [p.at for p in series]
    fig, axes = plt.subplots(5, 1, figsize=(11, 13), sharex=True, layout="constrained")
    errors_ax, ttft_ax, replicas_ax, batch_ax, hit_ax = axes
    errors_ax.bar(at, [p.errors for p in series], width=_step(at), align="edge")
    errors_ax.set(title="Failed requests (per step, by end)")
    ttft_ax.plot(
        at,
        [
            math.nan if p.interactive_ttft_p95_s is None else p.interactive_ttft_p95_s
            for p in series
        ],
    )
    ttft_ax.set(title="Interactive p95 TTFT (s, by arrival)", ylim=(0, None))
    pools = sorted({name for p in series for name in p.replicas})
    for name in pools:
        replicas_ax.step(at, [p.replicas.get(name, 0) for p in series], label=name)
    replicas_ax.set(title="Survivor's serving replicas", ylim=(0, None))
    replicas_ax.legend(fontsize=8)
    batch_ax.plot(at, [p.batch_tokens_s for p in series])
    batch_ax.set(title="Survivor's batch output tokens/s", ylim=(0, None))
    hit_ax.plot(at, [math.nan if p.hit_rate is None else p.hit_rate for p in series])
    hit_ax.set(
        title="Survivor's prefix-cache hit rate (chat)",
        ylim=(0, 1.05),
        xlabel="seconds from the loss",
    )
    for ax in axes:
        ax.axvline(0, color="red", linestyle=":")
        ax.axvline(report.window_s, color="grey", linestyle=":")
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"Failover drill ({report.mode}): region lost at 0 s, detected at "
        f"{report.window_s:g} s"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _step(at: list[float]) -> float:
    return at[1] - at[0] if len(at) > 1 else 1.0


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _n(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _f(value: float | None, digits: int) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"
