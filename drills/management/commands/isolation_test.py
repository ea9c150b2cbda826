"""``manage.py isolation_test``: the seed's isolation test, live at reduced scale or
(``--sim``) at full scale in the fleet simulator."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from drills.domain.fleet_config import FleetConfig
from drills.domain.isolation import judge, summarise
from drills.domain.isolation_sim import IsolationOutcome, IsolationScenario
from drills.domain.planned_fleet import FleetSize
from drills.domain.workload import ChatWorkload
from drills.isolation import IsolationPlan, run_isolation
from drills.management.fleet_size import (
    add_scenario_argument,
    capacity_scenario,
    planned_fleet_size,
)


class Command(BaseCommand):
    help = (
        "One team sends 10x its token limit while the others work normally; prints "
        "each team's p95 TTFT without and with the flood and who saw 429s. Live "
        "against a gateway by default; --sim runs the full-scale fleet simulator."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--flood-factor", type=float, default=10.0)
        parser.add_argument("--tolerance", type=float, default=0.10)
        parser.add_argument("--json", action="store_true")
        live = parser.add_argument_group("live mode")
        live.add_argument("--phase-s", type=float, default=20.0)
        live.add_argument("--quiet-streams", type=int, default=4)
        live.add_argument("--noisy-tokens-per-minute", type=int, default=3_000)
        sim = parser.add_argument_group("simulated mode (--sim)")
        sim.add_argument(
            "--sim", action="store_true", help="run in the fleet simulator"
        )
        sim.add_argument(
            "--replicas",
            type=int,
            help="chat replicas (default: the capacity plan's for one region of "
            "the scenario, regions_lost respected: 14 for the seed)",
        )
        add_scenario_argument(sim)
        sim.add_argument(
            "--teams", type=int, default=5, help="teams including the noisy one"
        )
        sim.add_argument(
            "--rate",
            type=float,
            help="requests/s of all teams before the flood (default 5 per replica)",
        )
        sim.add_argument("--minutes", type=float, default=10.0)
        sim.add_argument("--warmup-minutes", type=float, default=1.0)
        sim.add_argument(
            "--flood-start-minutes",
            type=float,
            default=0.0,
            help="when the flood starts (0: from the start of the warm-up)",
        )
        sim.add_argument(
            "--no-limits",
            action="store_true",
            help="give no team a token limit (the test should then fail)",
        )
        sim.add_argument("--profile", default="a100-8b")
        sim.add_argument("--seed", type=int, default=0)
        sim.add_argument("--plot", type=Path, help="PNG file (default .local/drills/)")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["sim"]:
            self._simulate(options)
        else:
            self._live(options)

    # -- live ------------------------------------------------------------------------

    def _live(self, options: dict[str, Any]) -> None:
        plan = IsolationPlan(
            phase_s=options["phase_s"],
            quiet_streams=options["quiet_streams"],
            flood_factor=options["flood_factor"],
            noisy_tokens_per_minute=options["noisy_tokens_per_minute"],
        )
        rows = summarise(run_isolation(plan))
        verdict = judge(rows, noisy_team="iso-noisy", tolerance=options["tolerance"])
        if options["json"]:
            self.stdout.write(
                json.dumps(
                    {
                        "rows": [asdict(row) for row in rows],
                        "passed": verdict.passed,
                        "reasons": list(verdict.reasons),
                    },
                    indent=2,
                )
            )
        else:
            self.stdout.write(
                f"{'team':<12} {'phase':<9} {'requests':>8} {'ok':>6} {'429':>6} "
                f"{'other':>6} {'p50 TTFT ms':>12} {'p95 TTFT ms':>12}"
            )
            for row in rows:
                self.stdout.write(
                    f"{row.team:<12} {row.phase:<9} {row.requests:>8} {row.ok:>6} "
                    f"{row.rate_limited:>6} {row.other_errors:>6} "
                    f"{_ms(row.p50_ttft_ms):>12} {_ms(row.p95_ttft_ms):>12}"
                )
            self.stdout.write("PASS" if verdict.passed else "FAIL")
            for reason in verdict.reasons:
                self.stdout.write(f"  - {reason}")
        if not verdict.passed:
            raise CommandError("the quiet teams were not isolated from the flood")

    # -- simulated ---------------------------------------------------------------------

    def _simulate(self, options: dict[str, Any]) -> None:
        from drills.domain.isolation_sim import run_isolation_sim
        from drills.experiment_plots import default_plot_path, plot_isolation
        from drills.fleet_settings import platform_fleet_config

        capacity, name = capacity_scenario(options["capacity_scenario"])
        size = planned_fleet_size(capacity, name, replicas=options["replicas"])
        replicas = size.replicas
        rate = options["rate"] or 5.0 * replicas
        try:
            config = platform_fleet_config(
                replicas=replicas,
                profile=options["profile"],
                seed=options["seed"],
                admission=True,
            )
            scenario = IsolationScenario(
                teams=options["teams"],
                flood_factor=options["flood_factor"],
                has_limits=not options["no_limits"],
                flood_start_s=options["flood_start_minutes"] * 60,
                duration_s=options["minutes"] * 60,
                warmup_s=options["warmup_minutes"] * 60,
                tolerance=options["tolerance"],
                workload=ChatWorkload(arrival_rate=rate),
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        started = time.process_time()
        outcome = run_isolation_sim(config, scenario)
        cpu_s = time.process_time() - started
        plot = options["plot"] or default_plot_path("isolation_test")
        plot_isolation(outcome, plot, title=_title(outcome, config.replicas))
        if options["json"]:
            self.stdout.write(
                json.dumps(_as_json(outcome, config, size, cpu_s, plot), indent=2)
            )
        else:
            self._print_table(outcome, size, config.profile, cpu_s, plot)
        if not outcome.verdict.passed:
            raise CommandError("the quiet teams were not isolated from the flood")

    def _print_table(
        self,
        outcome: IsolationOutcome,
        size: FleetSize,
        profile: str,
        cpu_s: float,
        plot: Path,
    ) -> None:
        s = outcome.scenario
        w = s.workload
        self.stdout.write(
            f"Isolation test (simulated): {size.replicas} x {profile} "
            f"({size.source}), {s.teams} teams at "
            f"{w.arrival_rate:g} req/s together ({s.team_rate:g} each, "
            f"{w.prompt_tokens}-token prompts, {w.answer_tokens}-token answers); "
            f"the noisy team sends {s.flood_factor:g}x its limit; "
            f"{s.warmup_s / 60:g} + {s.duration_s / 60:g} min; simulated in "
            f"{cpu_s:.1f} s of CPU"
        )
        self.stdout.write(
            f"{'team':<8} {'role':<6} {'limit':>10} {'offered':>10} {'offered':>10} "
            f"{'requests':>8} {'requests':>8} {'p95 TTFT':>9} {'p95 TTFT':>9} "
            f"{'change':>7} {'429s':>6} {'429s':>7} {'other':>6}"
        )
        self.stdout.write(
            f"{'':<8} {'':<6} {'tok/min':>10} {'base':>10} {'noise':>10} "
            f"{'base':>8} {'noise':>8} {'base ms':>9} {'noise ms':>9} "
            f"{'':>7} {'base':>6} {'noise':>7} {'errors':>6}"
        )
        for row in outcome.rows:
            change = row.p95_change
            self.stdout.write(
                f"{row.team:<8} {'noisy' if row.is_noisy else 'quiet':<6} "
                f"{_tokens(row.tokens_per_minute):>10} "
                f"{row.offered_tokens_per_minute_baseline:>10,} "
                f"{row.offered_tokens_per_minute_noisy:>10,} "
                f"{row.requests_baseline:>8,} {row.requests_noisy:>8,} "
                f"{_ms(row.p95_ttft_ms_baseline):>9} {_ms(row.p95_ttft_ms_noisy):>9} "
                f"{'-' if change is None else f'{change:+.1%}':>7} "
                f"{row.rate_limited_baseline:>6,} {row.rate_limited_noisy:>7,} "
                f"{row.other_errors_baseline + row.other_errors_noisy:>6,}"
            )
        verdict = outcome.verdict
        self.stdout.write(
            f"{'PASS' if verdict.passed else 'FAIL'}: quiet teams' p95 TTFT within "
            f"{s.tolerance:.0%} of baseline, 429s only for the noisy team"
        )
        for reason in verdict.reasons:
            self.stdout.write(f"  - {reason}")
        self.stdout.write(f"plot: {plot}")


def _title(outcome: IsolationOutcome, replicas: int) -> str:
    s = outcome.scenario
    return (
        f"Isolation test: {replicas} replicas, {s.teams} teams at "
        f"{s.workload.arrival_rate:g} req/s, noisy team at {s.flood_factor:g}x its "
        f"limit ({'PASS' if outcome.verdict.passed else 'FAIL'})"
    )


def _as_json(
    outcome: IsolationOutcome,
    config: FleetConfig,
    size: FleetSize,
    cpu_s: float,
    plot: Path,
) -> dict[str, Any]:
    s = outcome.scenario
    w = s.workload
    return {
        "passed": outcome.verdict.passed,
        "reasons": list(outcome.verdict.reasons),
        "teams": [row.as_dict() for row in outcome.rows],
        "scenario": {
            "replicas": config.replicas,
            "replicas_source": size.source,
            "profile": config.profile,
            "policy": config.policy,
            "admission": config.admission,
            "teams": s.teams,
            "arrival_rate": w.arrival_rate,
            "team_rate": s.team_rate,
            "prompt_tokens": w.prompt_tokens,
            "history_tokens": w.history_tokens,
            "answer_tokens": w.answer_tokens,
            "flood_factor": s.flood_factor,
            "noisy_rate_factor": s.noisy_factor,
            "flood_start_s": s.flood_start_s,
            "has_limits": s.has_limits,
            "tolerance": s.tolerance,
            "minutes": s.duration_s / 60,
            "warmup_minutes": s.warmup_s / 60,
            "seed": config.seed,
            "simulator_cpu_s": round(cpu_s, 2),
        },
        "plot": str(plot),
    }


def _tokens(value: int) -> str:
    return "none" if value == 0 else f"{value:,}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
