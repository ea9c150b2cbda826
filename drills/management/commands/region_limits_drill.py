"""``manage.py region_limits_drill``: one team limit across two regions, in the
fleet simulator's virtual time (``drills.domain.region_limits``), driving the
share tick the live loop runs. Prints a table, writes a plot and ``--json``, and
fails when a target is missed.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from control.region_limits import share_settings
from drills.domain.region_limits import (
    RegionLimitsReport,
    RegionLimitsScenario,
    run_region_limits,
)
from drills.management.reports import add_result_arguments, write_result


class Command(BaseCommand):
    help = (
        "Two teams at three times their limit: one drives both regions (half each, "
        "then 90% east), one only east; then west is lost. Check: at most 110% of "
        "the limit per minute in total, at least 95% for the one-region team, the "
        "whole limit to the survivor within 10 s."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument(
            "--duration", type=float, default=300.0, help="virtual seconds"
        )
        add_result_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        from drills.experiment_plots import default_plot_path, plot_region_limits

        wall0 = time.monotonic()
        duration = options["duration"]
        scenario = RegionLimitsScenario(
            seed=options["seed"],
            duration_s=duration,
            shift_at_s=duration * 0.4,
            loss_at_s=duration * 0.8,
            options=share_settings(),
        )
        report = run_region_limits(scenario)
        plot = options["plot"] or default_plot_path("region_limits_drill")
        plot_region_limits(report, plot, title="One team limit across two regions")
        data = {
            "scenario": {
                "tokens_per_minute": scenario.tokens_per_minute,
                "overdrive": scenario.overdrive,
                "shift_at_s": scenario.shift_at_s,
                "loss_at_s": scenario.loss_at_s,
                "duration_s": scenario.duration_s,
                "seed": scenario.seed,
                **{f"shares_{k}": v for k, v in asdict(scenario.options).items()},
            },
            **report.as_dict(),
            "wall_s": round(time.monotonic() - wall0, 2),
            "plot": str(plot),
        }
        write_result(
            self.stdout,
            data,
            options["json"],
            lambda: self._print(report, plot),
        )
        if not report.passed:
            raise CommandError("region limit targets missed (see the checks)")

    def _print(self, report: RegionLimitsReport, plot: object) -> None:
        write = self.stdout.write
        write(f"{'check':<72} {'measured':>9} {'target':>8}  ok")
        for check in report.checks:
            mark = "yes" if check.passed else "NO"
            write(f"{check.name:<72} {check.measured:>9} {check.target:>8}  {mark}")
        write(f"plot: {plot}")
