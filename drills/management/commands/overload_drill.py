"""``manage.py overload_drill``: arrivals step past the pool's capacity with every
tier, in the fleet simulator; the seed's shedding order is checked."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from drills.domain.fleet_config import FleetConfig
from drills.domain.overload import (
    TIERS,
    OverloadOutcome,
    OverloadScenario,
    planned_capacity_rps,
    run_overload,
)
from drills.domain.planned_fleet import FleetSize, region_peak_rps
from drills.domain.workload import ChatWorkload
from drills.management.fleet_size import (
    add_scenario_argument,
    capacity_scenario,
    planned_fleet_size,
)


class Command(BaseCommand):
    help = (
        "Step arrivals past the pool's capacity (x0.8, x1.0, x1.3, x1.6 by default) "
        "with interactive, standard and batch teams; print sheds (503), 429s and "
        "p95 TTFT per tier, queue depth and sheds per 10 s, and check the seed's "
        "order: batch pauses first, then over-share teams get 429, then standard "
        "queues; interactive inside its guarantee is never shed."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--replicas",
            type=int,
            help="chat replicas (default: the capacity plan's for one region of "
            "the scenario, regions_lost respected: 14 for the seed)",
        )
        add_scenario_argument(parser)
        parser.add_argument(
            "--minutes",
            type=float,
            default=8.0,
            help="measured minutes, split evenly over the steps",
        )
        parser.add_argument("--warmup-minutes", type=float, default=1.0)
        parser.add_argument(
            "--factors",
            default="0.8,1.0,1.3,1.6",
            help="arrival rate steps as multiples of the capacity",
        )
        parser.add_argument(
            "--capacity-rps",
            type=float,
            help="what x1.0 means in requests/s (default: the peak the plan "
            "sizes a region for; with --replicas, replicas x "
            "--replica-tokens-per-s / answer tokens)",
        )
        parser.add_argument(
            "--replica-tokens-per-s",
            type=float,
            default=2500.0,
            help="(with --replicas) output tokens/s a replica carries",
        )
        parser.add_argument("--bin-s", type=float, default=10.0)
        parser.add_argument("--profile", default="a100-8b")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--json", action="store_true")
        parser.add_argument(
            "--plot", type=Path, help="PNG file (default .local/drills/)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        from drills.experiment_plots import default_plot_path, plot_overload
        from drills.fleet_settings import platform_fleet_config

        capacity, name = capacity_scenario(options["capacity_scenario"])
        size = planned_fleet_size(capacity, name, replicas=options["replicas"])
        try:
            factors = tuple(float(f) for f in options["factors"].split(",") if f)
            workload = ChatWorkload()
            capacity_rps = options["capacity_rps"] or (
                region_peak_rps(capacity)
                if size.is_planned
                else planned_capacity_rps(
                    size.replicas,
                    options["replica_tokens_per_s"],
                    workload.answer_tokens,
                )
            )
            config = platform_fleet_config(
                replicas=size.replicas,
                profile=options["profile"],
                seed=options["seed"],
                admission=True,
            )
            scenario = OverloadScenario(
                capacity_rps=capacity_rps,
                factors=factors,
                step_s=options["minutes"] * 60 / max(1, len(factors)),
                warmup_s=options["warmup_minutes"] * 60,
                bin_s=options["bin_s"],
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        started = time.process_time()
        outcome = run_overload(config, scenario)
        cpu_s = time.process_time() - started
        plot = options["plot"] or default_plot_path("overload_drill")
        plot_overload(outcome, plot, title=_title(outcome, config))
        if options["json"]:
            self.stdout.write(
                json.dumps(_as_json(outcome, config, size, cpu_s, plot), indent=2)
            )
        else:
            self._print(outcome, config, size, cpu_s, plot)
        if not outcome.passed:
            failed = [c.name for c in outcome.checks if not c.passed]
            raise CommandError(f"the seed's overload order broke: {', '.join(failed)}")

    def _print(
        self,
        outcome: OverloadOutcome,
        config: FleetConfig,
        size: FleetSize,
        cpu_s: float,
        plot: Path,
    ) -> None:
        s = outcome.scenario
        pool = config.replicas * config.replica_tokens_in_flight
        self.stdout.write(
            f"Overload drill (simulated): {config.replicas} x {config.profile} "
            f"({size.source}), admission on (pool {pool:,} tokens in flight, batch below "
            f"{config.batch_ceiling:.0%}, queue {config.max_queue}, wait "
            f"{config.max_wait_s:g} s); x1.0 = {s.capacity_rps:,.1f} req/s; steps "
            f"{' '.join(f'x{f:g}' for f in s.factors)} of {s.step_s / 60:g} min "
            f"after {s.warmup_s / 60:g} min at x{s.factors[0]:g}; simulated in "
            f"{cpu_s:.1f} s of CPU"
        )
        self.stdout.write("")
        self.stdout.write("Per tier and team, whole window")
        self.stdout.write(
            f"{'name':<12} {'tier':<12} {'share':>6} {'requests':>9} {'ok':>8} "
            f"{'429':>7} {'503':>7} {'waited':>7} {'p50 TTFT':>9} {'p95 TTFT':>9} "
            f"{'p95 wait':>9}"
        )
        self.stdout.write(
            f"{'':<12} {'':<12} {'':>6} {'':>9} {'':>8} {'':>7} {'':>7} {'':>7} "
            f"{'s':>9} {'s':>9} {'s':>9}"
        )
        shares = {team.name: team.guaranteed_share for team in s.workload.teams}
        for row in (*outcome.tiers, *outcome.teams):
            share = shares.get(row.name)
            self.stdout.write(
                f"{row.name:<12} {row.tier:<12} "
                f"{'' if share is None else f'{share:.0%}':>6} {row.requests:>9,} "
                f"{row.ok:>8,} {row.rate_limited:>7,} {row.shed:>7,} "
                f"{row.waited:>7,} {_s(row.ttft_p50_s):>9} {_s(row.ttft_p95_s):>9} "
                f"{_s(row.wait_p95_s):>9}"
            )
        self.stdout.write("")
        self.stdout.write("Per step and tier")
        self.stdout.write(
            f"{'step':>4} {'factor':>6} {'offered':>8} {'tier':<12} {'requests':>9} "
            f"{'429':>7} {'503':>7} {'max queued':>10} {'p95 TTFT':>9}"
        )
        self.stdout.write(
            f"{'':>4} {'':>6} {'req/s':>8} {'':<12} {'':>9} {'':>7} {'':>7} "
            f"{'':>10} {'s':>9}"
        )
        for step in outcome.steps:
            self.stdout.write(
                f"{step.step:>4} {f'x{step.factor:g}':>6} {step.offered_rps:>8,.1f} "
                f"{step.tier:<12} {step.requests:>9,} {step.rate_limited:>7,} "
                f"{step.shed:>7,} {step.max_queued:>10,} {_s(step.ttft_p95_s):>9}"
            )
        self.stdout.write("")
        bins = outcome.bins
        self.stdout.write(
            f"Per {s.bin_s:g} s (tiers: interactive/standard/batch; queued is the "
            f"most waiting at a 1 s sample)"
        )
        self.stdout.write(
            f"{'t':>6} {'factor':>6} {'queued':>14} {'503':>14} {'429':>14} "
            f"{'p95 TTFT s':>20}"
        )
        for index, start in enumerate(bins.starts_s):

            def triple(series: dict[str, list[Any]], i: int = index) -> str:
                return "/".join(str(series[tier][i]) for tier in TIERS)

            ttfts = "/".join(_s(bins.ttft_p95_s[tier][index]) for tier in TIERS)
            self.stdout.write(
                f"{start:>6.0f} {f'x{bins.factors[index]:g}':>6} "
                f"{triple(bins.queued_max):>14} {triple(bins.shed):>14} "
                f"{triple(bins.rate_limited):>14} {ttfts:>20}"
            )
        self.stdout.write("")
        self.stdout.write("Checks (the seed's order under overload)")
        for check in outcome.checks:
            self.stdout.write(
                f"  {'PASS' if check.passed else 'FAIL'} {check.name}: {check.detail}"
            )
        self.stdout.write(f"plot: {plot}")


def _title(outcome: OverloadOutcome, config: FleetConfig) -> str:
    s = outcome.scenario
    return (
        f"Overload drill: {config.replicas} x {config.profile}, arrivals "
        f"{' → '.join(f'x{f:g}' for f in s.factors)} of {s.capacity_rps:,.0f} req/s "
        f"(seed {config.seed})"
    )


def _as_json(
    outcome: OverloadOutcome,
    config: FleetConfig,
    size: FleetSize,
    cpu_s: float,
    plot: Path,
) -> dict[str, Any]:
    s = outcome.scenario
    w = s.workload
    return {
        "passed": outcome.passed,
        "checks": [check.as_dict() for check in outcome.checks],
        "tiers": [row.as_dict() for row in outcome.tiers],
        "teams": [row.as_dict() for row in outcome.teams],
        "steps": [row.as_dict() for row in outcome.steps],
        "bins": {"bin_s": s.bin_s, **outcome.bins.as_dict()},
        "scenario": {
            "replicas": config.replicas,
            "replicas_source": size.source,
            "profile": config.profile,
            "policy": config.policy,
            "pool_tokens_in_flight": config.replicas * config.replica_tokens_in_flight,
            "batch_ceiling": config.batch_ceiling,
            "max_queue": config.max_queue,
            "max_wait_s": config.max_wait_s,
            "capacity_rps": s.capacity_rps,
            "factors": list(s.factors),
            "step_s": s.step_s,
            "warmup_s": s.warmup_s,
            "prompt_tokens": w.prompt_tokens,
            "history_tokens": w.history_tokens,
            "answer_tokens": w.answer_tokens,
            "teams": [
                {
                    "name": team.name,
                    "tier": team.tier,
                    "weight": team.weight,
                    "guaranteed_share": team.guaranteed_share,
                }
                for team in w.teams
            ],
            "inside_guarantee_teams": list(s.inside_guarantee_teams()),
            "seed": config.seed,
            "simulator_cpu_s": round(cpu_s, 2),
        },
        "plot": str(plot),
    }


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
