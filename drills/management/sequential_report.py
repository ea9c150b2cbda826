"""``rollout_drill --sequential-check``: run, print, plot and write the issue 38
check (``drills.domain.sequential_check``)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from django.core.management.base import CommandError, OutputWrapper

from drills.domain.sequential_check import (
    SequentialOutcome,
    SequentialSettings,
    judge_sequential,
    run_sequential_check,
)
from drills.management.reports import write_result
from rollouts.domain.plan import JudgeSpec, RolloutPlan

__all__ = ["plot_sequential", "run_sequential_command"]


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} s"


def run_sequential_command(
    stdout: OutputWrapper, options: dict[str, Any], *, plan: RolloutPlan
) -> None:
    """Run the check with the command's options; fail the command on a miss."""
    from drills.experiment_plots import default_plot_path

    if options["seeds"] < 1 or options["horizon_hours"] <= 0:
        raise CommandError("--seeds must be at least 1, --horizon-hours above 0")
    if plan.judge is None:
        # The subtly worse version is the judge's to catch: a plan without one
        # gets the drill's (its defaults, the simulated judge model).
        plan = replace(plan, judge=JudgeSpec(model="judge"))
    settings = SequentialSettings(
        seeds=options["seeds"],
        seed=options["seed"],
        horizon_s=options["horizon_hours"] * 3600.0,
        plan=plan,
    )
    wall0, cpu0 = time.monotonic(), time.process_time()
    outcome = run_sequential_check(settings)
    checks = judge_sequential(outcome)
    timing = {
        "wall_s": round(time.monotonic() - wall0, 2),
        "cpu_s": round(time.process_time() - cpu0, 2),
    }
    plot = options["plot"] or default_plot_path("rollout_sequential")
    plot_sequential(outcome, plot)
    data = {
        "settings": {
            "seeds": settings.seeds,
            "seed": settings.seed,
            "guard_period_s": settings.guard_period_s,
            "horizon_s": settings.horizon_s,
            "live_error_rate": settings.live_error_rate,
            "live_refusal_rate": settings.live_refusal_rate,
            "live_quality": settings.live_quality,
            "judge_quality": settings.judge_quality,
            "plan": settings.plan.to_json(),
        },
        "cells": [cell.as_dict() for cell in outcome.cells],
        "checks": [c.as_dict() for c in checks],
        "timing": timing,
        "plot": str(plot),
    }

    def report() -> None:
        stdout.write(
            f"Sequential guards (issue 38): the default plan from canary, "
            f"{settings.seeds} seeds per cell, guard every "
            f"{settings.guard_period_s:g} s, live errors "
            f"{settings.live_error_rate:.1%}, horizon "
            f"{settings.horizon_s / 3600:g} h; live quality "
            f"{settings.live_quality:.0%}, judge quality "
            f"{settings.judge_quality:.0%}; {timing['wall_s']:.1f} s wall, "
            f"{timing['cpu_s']:.1f} s CPU"
        )
        stdout.write(
            f"{'pool':<9} {'req/s':>6} {'version':<8} {'promoted':>8} "
            f"{'rolled back':>11} {'held':>4} {'median decision':>15} "
            f"{'max periods':>11} {'by judge':>8}  first raise"
        )
        for cell in outcome.cells:
            median = cell.median_decision_s()
            worst = cell.max_periods()
            raises = [r.raised[0] for r in cell.runs if r.raised]
            first = f"{min(raises):.3g}..{max(raises):.3g}%" if raises else "-"
            stdout.write(
                f"{cell.pool.name:<9} {cell.pool.rps:>6.1f} "
                f"{cell.version.name:<8} {cell.count('promoted'):>8} "
                f"{cell.count('rolled_back'):>11} {cell.count('pending'):>4} "
                f"{_s(median):>15} "
                f"{'-' if worst is None else f'{worst:.2f}':>11} "
                f"{cell.caught_by_judge():>8}  {first}"
            )
        stdout.write("")
        for check in checks:
            mark = "ok  " if check.passed else "FAIL"
            stdout.write(f"{mark} {check.name}: {check.detail}")
        stdout.write(f"plot: {plot}")

    write_result(stdout, data, options["json"], report)
    failed = [c.name for c in checks if not c.passed]
    if failed:
        raise CommandError(f"sequential targets missed: {', '.join(failed)}")


def plot_sequential(outcome: SequentialOutcome, path: Path) -> Path:
    """Time to a decision against the pool's traffic, per version: each seed a
    dot (rolled back red, promoted green, held grey at the horizon)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    versions = sorted({c.version.name for c in outcome.cells})
    fig, axes = plt.subplots(
        1,
        len(versions),
        figsize=(4.5 * len(versions), 3.8),
        squeeze=False,
        layout="constrained",
    )
    colors = {"rolled_back": "tab:red", "promoted": "tab:green", "pending": "grey"}
    horizon = outcome.settings.horizon_s
    for ax, name in zip(axes[0], versions, strict=True):
        for cell in (c for c in outcome.cells if c.version.name == name):
            for i, run in enumerate(cell.runs):
                at = run.decided_s if run.decided_s is not None else horizon
                jitter = 1.0 + 0.02 * (i - len(cell.runs) / 2) / len(cell.runs)
                ax.scatter(cell.pool.rps * jitter, at, s=10, color=colors[run.decision])
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("pool requests/s (70B peak, 7B 100, 7B 1,000 streams)")
        ax.set_ylabel("seconds to decision")
        ax.set_title(name, fontsize=10)
        ax.axhline(horizon, color="grey", linestyle=":", linewidth=0.8)
    fig.suptitle("Sequential guards: time to a decision against traffic")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
