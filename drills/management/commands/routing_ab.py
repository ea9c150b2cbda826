"""``manage.py routing_ab``: the seed's routing A/B in the fleet simulator."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from drills.domain.fleet_config import FleetConfig
from drills.domain.routing_ab import POLICY_ORDER, generate_arrivals, run_routing_ab
from drills.domain.workload import ChatWorkload, read_trace, trace_arrivals


class Command(BaseCommand):
    help = (
        "Replay one workload three times (round robin, least tokens in flight, prefix "
        "affinity with bounded load) through the simulated fleet; print per policy "
        "the prefix hit rate, p95 TTFT, imbalance and uncached prefill tokens/s."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--replicas", type=int, default=12)
        parser.add_argument("--minutes", type=float, default=10.0)
        parser.add_argument("--warmup-minutes", type=float, default=2.0)
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument(
            "--rate", type=float, default=100.0, help="requests/s (seed: 100)"
        )
        parser.add_argument("--mode", choices=["seed", "growing"], default="seed")
        parser.add_argument("--profile", default="a100-8b")
        parser.add_argument(
            "--load-factor",
            type=float,
            default=1.25,
            help="prefix affinity's bound over the pool average (seed: 1.25)",
        )
        parser.add_argument(
            "--trace", type=Path, help="replay this JSONL trace instead"
        )
        parser.add_argument("--json", action="store_true")
        parser.add_argument(
            "--plot", type=Path, help="PNG file (default .local/drills/)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        warmup_s = options["warmup_minutes"] * 60
        duration_s = options["minutes"] * 60
        try:
            config = FleetConfig(
                replicas=options["replicas"],
                profile=options["profile"],
                seed=options["seed"],
                load_factor=options["load_factor"],
                min_bound_tokens=settings.PLATFORM_AFFINITY_MIN_BOUND_TOKENS,
                replica_tokens_in_flight=settings.PLATFORM_DEFAULT_REPLICA_TOKENS_IN_FLIGHT,
            )
            if options["trace"]:
                arrivals = list(trace_arrivals(read_trace(options["trace"])))
                scenario: dict[str, Any] = {"trace": str(options["trace"])}
            else:
                workload = ChatWorkload(
                    arrival_rate=options["rate"], mode=options["mode"]
                )
                arrivals = generate_arrivals(
                    workload, warmup_s + duration_s, seed=options["seed"]
                )
                scenario = {
                    "arrival_rate": workload.arrival_rate,
                    "users": workload.users,
                    "message_interval_s": workload.message_interval_s,
                    "prompt_tokens": workload.prompt_tokens,
                    "history_tokens": workload.history_tokens,
                    "answer_tokens": workload.answer_tokens,
                    "mode": workload.mode,
                }
        except (OSError, ValueError) as exc:
            raise CommandError(str(exc)) from None
        started = time.process_time()
        outcomes = run_routing_ab(
            config, arrivals, duration_s=duration_s, warmup_s=warmup_s
        )
        cpu_s = time.process_time() - started
        scenario.update(
            replicas=config.replicas,
            profile=config.profile,
            block_size=config.block_size,
            load_factor=config.load_factor,
            min_bound_tokens=config.min_bound_tokens,
            minutes=options["minutes"],
            warmup_minutes=options["warmup_minutes"],
            seed=config.seed,
            requests=len(arrivals),
            simulator_cpu_s=round(cpu_s, 2),
        )
        plot = options["plot"] or _default_plot()
        from drills.experiment_plots import plot_routing_ab

        title = (
            f"Routing A/B: {config.replicas} x {config.profile}, "
            f"{scenario.get('arrival_rate', 'trace')} req/s, "
            f"{options['minutes']:g} min (seed {config.seed})"
        )
        plot_routing_ab(outcomes, plot, title=title)
        if options["json"]:
            self.stdout.write(
                json.dumps(
                    {
                        "policies": [o.row() for o in outcomes],
                        "scenario": scenario,
                        "plot": str(plot),
                    },
                    indent=2,
                )
            )
            return
        self.stdout.write(
            f"Routing A/B: {config.replicas} replicas ({config.profile}), "
            f"{len(arrivals):,} requests over {options['warmup_minutes']:g} + "
            f"{options['minutes']:g} min, seed {config.seed}; "
            f"simulated in {cpu_s:.1f} s of CPU"
        )
        self.stdout.write(
            f"{'policy':<16} {'hit rate':>9} {'p50 TTFT':>9} {'p95 TTFT':>9} "
            f"{'TPOT':>8} {'imb mean':>9} {'imb peak':>9} {'uncached prefill':>17} "
            f"{'output':>10}"
        )
        self.stdout.write(
            f"{'':<16} {'':>9} {'s':>9} {'s':>9} {'ms':>8} {'x':>9} {'x':>9} "
            f"{'tokens/s':>17} {'tokens/s':>10}"
        )
        for o in outcomes:
            self.stdout.write(
                f"{o.policy:<16} {_pct(o.prefix_hit_rate):>9} {_num(o.ttft_p50_s, 2):>9} "
                f"{_num(o.ttft_p95_s, 2):>9} {_num(o.tpot_p50_s and o.tpot_p50_s * 1000, 1):>8} "
                f"{_num(o.imbalance_mean, 3):>9} {_num(o.imbalance_peak, 3):>9} "
                f"{o.uncached_prefill_tokens_per_s:>17,.0f} {o.output_tokens_per_s:>10,.0f}"
            )
        self.stdout.write(f"plot: {plot}")


def _default_plot() -> Path:
    from drills.experiment_plots import default_plot_path

    return default_plot_path("routing_ab")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


__all__ = ["POLICY_ORDER", "Command"]
