"""``manage.py rollout_drill``: a broken, a good and a slow version through the
rollout plan over the seed's traffic in the fleet simulator; the rollout's own
guards and plan decide (``drills.domain.rollout_drill``)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from drills.domain.fleet_config import FleetConfig
from drills.domain.rollout_drill import (
    SCENARIO_NAMES,
    SCENARIOS,
    DrillOutcome,
    RolloutDrillSettings,
    ScenarioOutcome,
    run_drill,
    simulate_traffic,
)
from drills.management.reports import add_result_arguments, write_result
from rollouts.domain.guards import GUARD_NAMES, GuardResult, GuardThresholds, PlanError
from rollouts.domain.plan import DEFAULT_PLAN, RolloutPlan, parse_plan


class Command(BaseCommand):
    help = (
        "Roll out a version with a broken chat template (caught at canary 1%), a "
        "good one (shadow to live) and one with a 30% slower TTFT (the TTFT guard) "
        "over the seed's traffic in the fleet simulator, with the platform's own "
        "split, sticky versions, guards and plan; print the time to detection, the "
        "conversations that saw the candidate and the guards that tripped."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--scenario",
            default="all",
            help=f"{', '.join(SCENARIO_NAMES)} or all (comma-separated)",
        )
        parser.add_argument(
            "--streams",
            type=int,
            default=1000,
            help="concurrent 7B streams at peak (the seed's 1,000: 100 requests/s)",
        )
        parser.add_argument(
            "--replicas",
            type=int,
            help="the live fleet (default: the capacity plan's for one region at "
            "the streams' rate: 14 at 1,000)",
        )
        parser.add_argument(
            "--window-minutes",
            type=float,
            help="minutes the fleet simulator runs; a longer replay cycles them "
            "(default: the whole replay of a plan that never holds)",
        )
        parser.add_argument(
            "--plan",
            type=Path,
            help="a rollout plan as JSON (the API's shape; default: the default plan)",
        )
        parser.add_argument("--profile", default="a100-8b")
        parser.add_argument("--seed", type=int, default=0)
        add_result_arguments(parser)
        parser.add_argument(
            "--live",
            action="store_true",
            help="run bad, good and slow live at small scale instead: a gateway, a "
            "node agent, simulated replicas and the platform's own guard tick "
            "(drills.rollout_live); --scenario picks among them",
        )
        parser.add_argument(
            "--sequential-check",
            action="store_true",
            help="issue 38: a version refusing every answer, one 0.6 points worse "
            "on errors and a good one, over --seeds seeds each, on the 7B at 100 "
            "and 1,000 streams and the 70B at its peak (drills.domain."
            "sequential_check); a plot of time to decision against traffic",
        )
        parser.add_argument(
            "--seeds", type=int, default=20, help="sequential check: seeds per cell"
        )
        parser.add_argument(
            "--horizon-hours",
            type=float,
            default=8.0,
            help="sequential check: how long a rollout may hold before it counts "
            "as undecided",
        )
        parser.add_argument(
            "--guard-seconds",
            type=float,
            default=2.0,
            help="live: the guard period (beat's is a minute)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        from drills.experiment_plots import default_plot_path
        from drills.fleet_settings import platform_fleet_config

        if options["live"]:
            self._live(options)
            return
        if options["sequential_check"]:
            from drills.management.sequential_report import run_sequential_command

            run_sequential_command(self.stdout, options, plan=_plan(options["plan"]))
            return

        names = _scenarios(options["scenario"])
        plan = _plan(options["plan"])
        window = options["window_minutes"]
        try:
            settings = RolloutDrillSettings(
                streams=options["streams"],
                replicas=options["replicas"],
                window_s=None if window is None else window * 60,
                plan=plan,
                seed=options["seed"],
            )
            config = platform_fleet_config(
                profile=options["profile"], seed=options["seed"]
            )
            wall0, cpu0 = time.monotonic(), time.process_time()
            traffic = simulate_traffic(config, settings)
            simulated_s = time.monotonic() - wall0
            outcome = run_drill(config, settings, scenarios=names, traffic=traffic)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        timing = {
            "wall_s": round(time.monotonic() - wall0, 2),
            "cpu_s": round(time.process_time() - cpu0, 2),
            "simulator_wall_s": round(simulated_s, 2),
        }
        plot = options["plot"] or default_plot_path("rollout_drill")
        plot_rollouts(outcome, plot, title=_title(outcome, config))
        write_result(
            self.stdout,
            _as_json(outcome, config, timing, plot),
            options["json"],
            lambda: self._print(outcome, config, timing, plot),
        )
        if not outcome.passed:
            failed = [c.name for c in outcome.checks if not c.passed]
            raise CommandError(
                f"rollout targets missed: {', '.join(failed)} (see the checks)"
            )

    def _live(self, options: dict[str, Any]) -> None:
        import logging

        from drills.experiment_plots import default_plot_path
        from drills.rollout_live import (
            LIVE_SCENARIOS,
            LiveOutcome,
            LiveRolloutPlan,
            run_live_rollout,
        )

        logging.getLogger("httpx").setLevel(logging.WARNING)
        wanted = options["scenario"]
        names = (
            list(LIVE_SCENARIOS)
            if wanted == "all"
            else [n.strip() for n in wanted.split(",") if n.strip()]
        )
        unknown = sorted(set(names) - set(LIVE_SCENARIOS))
        if unknown or not names:
            raise CommandError(
                f"--live --scenario takes {', '.join(LIVE_SCENARIOS)} or all; got "
                f"{', '.join(unknown) or 'none'}"
            )
        live = LiveRolloutPlan(guard_s=options["guard_seconds"])
        wall0 = time.monotonic()
        outcomes: list[LiveOutcome] = [run_live_rollout(n, live) for n in names]
        wall_s = round(time.monotonic() - wall0, 1)
        checks = _live_checks(outcomes, live.guard_s)
        plot = options["plot"] or default_plot_path("rollout_drill_live")
        plot_live(outcomes, plot)
        data = {
            "mode": "live",
            "guard_s": live.guard_s,
            "bucket_s": live.bucket_s,
            "wall_s": wall_s,
            "scenarios": [{**o.__dict__, "tripped": o.tripped} for o in outcomes],
            "checks": [{"name": n, "passed": ok, "detail": d} for n, ok, d in checks],
            "passed": all(ok for _, ok, _ in checks),
            "plot": str(plot),
        }

        def report() -> None:
            self.stdout.write(
                f"Rollout drill (live): {live.replicas} simulated replicas of v1, the "
                f"candidate's pool beside them, {live.threads} client threads of "
                f"3-turn chats, guards every {live.guard_s:g} s over "
                f"{live.bucket_s} s buckets; {wall_s:g} s wall"
            )
            self.stdout.write(
                f"{'scenario':<9} {'outcome':<12} {'at':<11} {'detected':>9} "
                f"{'promoted':>9} {'convs saw':>9} {'reqs saw':>8} {'requests':>8} "
                f"{'moves rb/other':>14} {'errors':>6}  tripped"
            )
            for o in outcomes:
                self.stdout.write(
                    f"{o.scenario:<9} {o.decision:<12} "
                    f"{o.stage + f' {o.percent:g}%':<11} {_s(o.detection_s, 1):>9} "
                    f"{_s(o.promotion_s, 1):>9} {o.conversations_saw:>9} "
                    f"{o.requests_saw:>8} {o.requests:>8} "
                    f"{f'{o.moves_rollback}/{o.moves_other}':>14} "
                    f"{len(o.errors):>6}  {', '.join(o.tripped) or '-'}"
                )
            for o in outcomes:
                self.stdout.write(f"  {o.scenario}: {o.reason}")
            self.stdout.write("Checks")
            for name, ok, detail in checks:
                self.stdout.write(f"  {'PASS' if ok else 'FAIL'} {name}: {detail}")
            self.stdout.write(f"plot: {plot}")

        write_result(self.stdout, data, options["json"], report, default=str)
        failed = [name for name, ok, _ in checks if not ok]
        if failed:
            raise CommandError(f"live rollout targets missed: {', '.join(failed)}")

    def _print(
        self,
        outcome: DrillOutcome,
        config: FleetConfig,
        timing: dict[str, float],
        plot: Path,
    ) -> None:
        s = outcome.settings
        t = outcome.traffic
        steps = ", ".join(
            f"{step.label} >= {step.min_duration_s:g} s" for step in s.plan.steps
        )
        cycles = outcome.cycles
        self.stdout.write(
            f"Rollout drill (simulated): {s.streams:,} streams = "
            f"{t.arrival_rate:g} requests/s of the seed's chat on {t.replicas} "
            f"{config.profile} replicas (p50/p95 TTFT {_s(t.ttft_p50_s)}/"
            f"{_s(t.ttft_p95_s)}), chats of {s.conversation_turns} turns; "
            f"the simulator ran {t.window_s:g} s"
            + (
                f", replayed in {cycles} cycles (times shifted, conversation ids "
                "offset per cycle)"
                if cycles > 1
                else ""
            )
        )
        self.stdout.write(
            f"Plan: {steps}; guards every {s.guard_period_s:g} s over {s.bucket_s:g} s "
            f"buckets since the step began; the rollout starts {s.lead_s:g} s into "
            f"the traffic. Simulated in {timing['wall_s']:.1f} s wall "
            f"({timing['simulator_wall_s']:.1f} s of it the fleet simulator), "
            f"{timing['cpu_s']:.1f} s CPU"
        )
        self.stdout.write("")
        header = (
            f"{'scenario':<11} {'outcome':<12} {'at':<11} {'detected':>9} "
            f"{'periods':>7} {'convs saw':>9} {'reqs saw':>8} {'shadow':>7} "
            f"{'promoted':>9} {'moves rb/pre/other':>18}  tripped"
        )
        self.stdout.write(header)
        for row in outcome.scenarios:
            self.stdout.write(_row(row, s.guard_period_s))
        self.stdout.write("")
        self.stdout.write("Decisions")
        for row in outcome.scenarios:
            self.stdout.write(
                f"  {row.name} ({row.candidate.description}): {row.reason}"
            )
        self.stdout.write("")
        self.stdout.write(
            "detected: from the candidate's first traffic (a canary request or a "
            "shadow copy) to the rollback; convs/reqs saw: canary answers from the "
            "candidate (shadow answers reach no one); moves: conversations whose "
            "turn went to another version than the one before, at the rollback / "
            "at the first canary step, under way before the gateways remembered "
            "versions / other"
        )
        self.stdout.write("")
        self.stdout.write("Checks (the issue's targets)")
        for check in outcome.checks:
            self.stdout.write(
                f"  {'PASS' if check.passed else 'FAIL'} {check.name}: {check.detail}"
            )
        self.stdout.write(f"plot: {plot}")


def _scenarios(value: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in value.split(",") if name.strip())
    if names == ("all",):
        return SCENARIO_NAMES
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown or not names:
        raise CommandError(
            f"--scenario takes {', '.join(SCENARIO_NAMES)} or all; got "
            f"{', '.join(unknown) or 'none'}"
        )
    return names


def _plan(path: Path | None) -> RolloutPlan:
    if path is None:
        return DEFAULT_PLAN
    try:
        return parse_plan(json.loads(path.read_text(encoding="utf-8")))
    except OSError as exc:
        raise CommandError(f"--plan {path}: {exc.strerror}") from None
    except PlanError as exc:
        raise CommandError(f"--plan {path}: {exc}") from None
    except ValueError as exc:
        raise CommandError(f"--plan {path}: not JSON ({exc})") from None


def _s(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f} s"


def _guard(result: GuardResult) -> str:
    change = result.change
    if change is None:
        return result.name
    if result.name in ("error_rate", "refusal_rate"):
        return f"{result.name} {change:+.1f} pts"
    return f"{result.name} {change * 100:+.1f}%"


def _row(row: ScenarioOutcome, period_s: float) -> str:
    detection = row.detection_s
    periods = "-" if detection is None else f"{detection / period_s:.1f}"
    promoted = "-" if row.promotion_s is None else f"{row.promotion_s:.0f} s"
    at = f"{row.stage} {row.percent:g}%"
    m = row.moves
    moves = f"{m.rollback}/{m.before_memory}/{m.other}"
    tripped = ", ".join(_guard(r) for r in row.tripped) or "-"
    return (
        f"{row.name:<11} {row.decision:<12} {at:<11} "
        f"{'-' if detection is None else f'{detection:.0f} s':>9} {periods:>7} "
        f"{row.conversations_saw:>9} {row.requests_saw:>8} {row.shadow_copies:>7} "
        f"{promoted:>9} {moves:>18}  {tripped}"
    )


def _title(outcome: DrillOutcome, config: FleetConfig) -> str:
    s = outcome.settings
    return (
        f"Rollout drill: {s.streams:,} streams ({outcome.traffic.arrival_rate:g} "
        f"req/s) on {outcome.traffic.replicas} {config.profile} replicas, guards "
        f"every {s.guard_period_s:g} s (seed {config.seed})"
    )


def _finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else value


def _as_json(
    outcome: DrillOutcome,
    config: FleetConfig,
    timing: dict[str, float],
    plot: Path,
) -> dict[str, Any]:
    s = outcome.settings
    t = outcome.traffic
    return {
        "passed": outcome.passed,
        "checks": [check.as_dict() for check in outcome.checks],
        "scenarios": [row.as_dict(s.guard_period_s) for row in outcome.scenarios],
        "traffic": {
            "streams": s.streams,
            "arrival_rate": t.arrival_rate,
            "replicas": t.replicas,
            "profile": config.profile,
            "policy": config.policy,
            "requests_in_window": len(t.turns),
            "window_s": t.window_s,
            "cycles": outcome.cycles,
            "ttft_p50_s": _finite(t.ttft_p50_s),
            "ttft_p95_s": _finite(t.ttft_p95_s),
            "conversation_turns": s.conversation_turns,
            "warmup_s": s.warmup_s,
        },
        "settings": {
            "plan": s.plan.to_json(),
            "guard_period_s": s.guard_period_s,
            "bucket_s": s.bucket_s,
            "lead_s": s.lead_s,
            "after_s": s.after_s,
            "hold_allowance_s": s.hold_allowance_s,
            "seed": config.seed,
        },
        **timing,
        "plot": str(plot),
    }


_CANDIDATE, _LIVE = "#d62728", "#1f77b4"
_GUARD_LABELS = {
    "error_rate": "error rate (%)",
    "p95_ttft": "p95 TTFT (s)",
    "output_length": "mean output (tokens)",
    "refusal_rate": "refusal rate (%)",
}


def _bounds(
    name: str, thresholds: GuardThresholds
) -> tuple[Callable[[float], float], ...]:
    """Where a guard trips, as functions of live's figure (the test aside)."""
    if name == "error_rate":
        return (lambda v: v + thresholds.error_rate_points / 100,)
    if name == "refusal_rate":
        return (lambda v: v + thresholds.refusal_rate_points / 100,)
    if name == "p95_ttft":
        return (lambda v: v * (1 + thresholds.p95_ttft_ratio),)
    return (
        lambda v: v * (1 + thresholds.output_length_ratio),
        lambda v: v * (1 - thresholds.output_length_ratio),
    )


def plot_rollouts(outcome: DrillOutcome, path: Path, *, title: str) -> Path:
    """Per scenario (a row) and guard (a column): the candidate's and the live
    version's figures at each guard evaluation (since the step began), where the
    guard trips (dotted grey; it also needs its test to be significant), the
    steps' starts dotted, a rollback in red, a promotion in green."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = outcome.scenarios
    thresholds = outcome.settings.plan.thresholds
    fig, axes = plt.subplots(
        len(rows),
        len(GUARD_NAMES),
        figsize=(4.2 * len(GUARD_NAMES), 2.8 * len(rows) + 0.6),
        squeeze=False,
        layout="constrained",
    )
    for r, row in enumerate(rows):
        minutes = [tick.at_s / 60 for tick in row.ticks]
        end = max([*minutes, (row.decided_at_s or 0.0) / 60, 1.0])
        for c, name in enumerate(GUARD_NAMES):
            ax = axes[r][c]
            scale = 100.0 if name in ("error_rate", "refusal_rate") else 1.0
            results = [tick.result(name) for tick in row.ticks]
            live = [res.live for res in results]
            ax.plot(
                minutes,
                [math.nan if v is None else v * scale for v in live],
                color=_LIVE,
                linestyle="--",
                marker="o",
                markersize=3,
                markerfacecolor="none",
                label="live",
                zorder=3,
            )
            ax.plot(
                minutes,
                [
                    math.nan if res.candidate is None else res.candidate * scale
                    for res in results
                ],
                color=_CANDIDATE,
                marker=".",
                label="candidate",
                zorder=4,
            )
            for bound in _bounds(name, thresholds):
                ax.plot(
                    minutes,
                    [math.nan if v is None else bound(v) * scale for v in live],
                    color="grey",
                    linestyle=":",
                    linewidth=1.0,
                    marker="_",
                    label="trips past"
                    if bound is _bounds(name, thresholds)[0]
                    else None,
                )
            for at_s, label in row.steps:
                ax.axvline(at_s / 60, color="grey", linestyle=":", linewidth=0.8)
                if c == 0:
                    ax.annotate(
                        label,
                        (at_s / 60, 1.0),
                        xycoords=("data", "axes fraction"),
                        fontsize=7,
                        rotation=90,
                        va="top",
                    )
            if row.decided_at_s is not None:
                colour = "#d62728" if row.promotion_s is None else "#2ca02c"
                ax.axvline(
                    row.decided_at_s / 60,
                    color=colour,
                    linewidth=1.0,
                    alpha=0.6,
                    label="rolled back" if row.promotion_s is None else "promoted",
                )
                tripped = next((t for t in row.tripped if t.name == name), None)
                if tripped is not None and tripped.candidate is not None:
                    ax.scatter(
                        [row.decided_at_s / 60],
                        [tripped.candidate * scale],
                        marker="x",
                        s=80,
                        color="#d62728",
                        zorder=5,
                        label="tripped",
                    )
            ax.set_xlim(-0.5, end + 0.5)
            ax.set_ylim(bottom=0)
            ax.set_xlabel("minutes from the rollout's start")
            ax.set_title(f"{row.name}: {_GUARD_LABELS[name]}", fontsize=9)
            if c == 0:
                ax.legend(loc="lower right", fontsize=7)
    fig.suptitle(title, fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _live_checks(outcomes: list[Any], guard_s: float) -> list[tuple[str, bool, str]]:
    """The issue's targets, on what the live scenarios did."""
    checks: list[tuple[str, bool, str]] = []
    for o in outcomes:
        if o.scenario == "bad":
            ok = (
                o.decision == "rolled_back"
                and o.detection_s is not None
                and o.detection_s <= 2 * guard_s + 1.0
                and "refusal_rate" in o.tripped
            )
            detail = (
                f"{o.decision} {_s(o.detection_s, 1)} after its canary began "
                f"(two periods: {2 * guard_s:g} s, +1 s for the ticks' own work)"
            )
            checks.append(("bad_rolled_back_within_two_guard_periods", ok, detail))
        elif o.scenario == "good":
            ok = o.decision == "promoted" and o.retired and not o.tripped
            detail = f"{o.decision}; old version retired: {o.retired}"
            checks.append(("good_promoted_and_old_retired", ok, detail))
        elif o.scenario == "slow":
            ok = o.decision == "rolled_back" and "p95_ttft" in o.tripped
            checks.append(("slow_trips_ttft_guard", ok, f"tripped {o.tripped}"))
        checks.append(
            (
                f"{o.scenario}_no_caller_error_nor_mid_chat_move",
                not o.errors and o.moves_other == 0,
                f"{len(o.errors)} errors, {o.moves_other} moves (and "
                f"{o.moves_rollback} at the rollback)",
            )
        )
    return checks


def plot_live(outcomes: list[Any], path: Path) -> Path:
    """Draw each live scenario's guard readings, candidate against live, per tick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(outcomes), len(GUARD_NAMES), figsize=(16, 3 * len(outcomes)), squeeze=False
    )
    for row, o in zip(axes, outcomes, strict=True):
        for ax, name in zip(row, GUARD_NAMES, strict=True):
            at, cand, live = [], [], []
            for e in o.evaluations:
                for r in e["report"].get("results", []):
                    if r["name"] == name:
                        at.append(e["at_s"])
                        cand.append(_finite(r.get("candidate")))
                        live.append(_finite(r.get("live")))
            ax.plot(at, live, "o--", label="live")
            ax.plot(at, cand, "o-", label="candidate")
            ax.set_title(f"{o.scenario}: {name}", fontsize=9)
            ax.set_xlabel("s from the rollout's start")
        row[0].legend(fontsize=7)
    fig.suptitle("Rollout drill (live, small scale)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
