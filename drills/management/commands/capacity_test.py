"""``manage.py capacity_test --sim``: the seed's capacity-per-version procedure
against one modelled replica."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from drills.domain.capacity_test import (
    CapacityAnswer,
    CapacityCriteria,
    run_capacity_test,
    step_rates,
)
from drills.domain.fleet_config import FleetConfig
from drills.domain.workload import ChatWorkload

# The seed's peak: 1,000 streams at 30 tokens/s.
SEED_PEAK_TOKENS_PER_S = 30_000


class Command(BaseCommand):
    help = (
        "Raise a fixed arrival rate step by step against one modelled replica and "
        "report the highest output tokens/s at which p95 TTFT stays under 1 s and "
        "streams keep 30 tokens/s. The default shape is the profiles' calibration "
        "(650-token prompts, 250-token answers, no shared history); the seed's chat "
        "is --prompt-tokens 1200 --history-tokens 800 --answer-tokens 300."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--sim",
            action="store_true",
            help="run against the simulated replica (the only mode so far)",
        )
        parser.add_argument("--profile", default="a100-8b")
        parser.add_argument("--prompt-tokens", type=int, default=650)
        parser.add_argument("--history-tokens", type=int, default=0)
        parser.add_argument("--answer-tokens", type=int, default=250)
        parser.add_argument("--mode", choices=["seed", "growing"], default="seed")
        parser.add_argument(
            "--start", type=float, help="first step, offered output tokens/s"
        )
        parser.add_argument(
            "--step",
            type=float,
            default=125.0,
            help="offered output tokens/s added per step",
        )
        parser.add_argument(
            "--max", type=float, default=6000.0, help="last step at most (tokens/s)"
        )
        parser.add_argument("--step-seconds", type=float, default=300.0)
        parser.add_argument("--warmup-seconds", type=float, default=30.0)
        parser.add_argument("--stop-after", type=int, default=2)
        parser.add_argument("--ttft-p95-max-s", type=float, default=1.0)
        parser.add_argument("--stream-min-tokens-per-s", type=float, default=30.0)
        parser.add_argument(
            "--stream-quantile",
            type=float,
            default=0.5,
            help="which stream must keep the rate: 0.5 the median, 0.05 all but 5%%",
        )
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--json", action="store_true")
        parser.add_argument(
            "--plot", type=Path, help="PNG file (default .local/drills/)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if not options["sim"]:
            raise CommandError(
                "only the simulated capacity test exists so far: pass --sim"
            )
        from drills.experiment_plots import default_plot_path, plot_capacity

        try:
            answer_tokens = options["answer_tokens"]
            workload = ChatWorkload(
                prompt_tokens=options["prompt_tokens"],
                history_tokens=options["history_tokens"],
                answer_tokens=answer_tokens,
                max_tokens=answer_tokens,
                mode=options["mode"],
            )
            config = FleetConfig(
                replicas=1, profile=options["profile"], seed=options["seed"]
            )
            criteria = CapacityCriteria(
                ttft_p95_max_s=options["ttft_p95_max_s"],
                stream_min_tokens_per_s=options["stream_min_tokens_per_s"],
                stream_quantile=options["stream_quantile"],
            )
            rates = step_rates(
                start_tokens_per_s=options["start"] or options["step"],
                step_tokens_per_s=options["step"],
                max_tokens_per_s=options["max"],
                answer_tokens=answer_tokens,
            )
            started = time.process_time()
            answer = run_capacity_test(
                config,
                workload,
                rates,
                criteria=criteria,
                duration_s=options["step_seconds"],
                warmup_s=options["warmup_seconds"],
                stop_after_failures=options["stop_after"],
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        cpu_s = time.process_time() - started
        plot = options["plot"] or default_plot_path("capacity_test")
        plot_capacity(answer, plot, title=_title(answer, config, workload))
        if options["json"]:
            self.stdout.write(
                json.dumps(
                    _as_json(answer, config, workload, options, cpu_s, plot), indent=2
                )
            )
            return
        self._print(answer, config, workload, options, cpu_s, plot)

    def _print(
        self,
        answer: CapacityAnswer,
        config: FleetConfig,
        workload: ChatWorkload,
        options: dict[str, Any],
        cpu_s: float,
        plot: Path,
    ) -> None:
        criteria = answer.criteria
        self.stdout.write(
            f"Capacity test (simulated): one {config.profile} replica; "
            f"{workload.prompt_tokens}-token prompts ({workload.history_tokens} of "
            f"them shared history), {workload.answer_tokens}-token answers; each "
            f"step {options['warmup_seconds']:g} s warm-up + "
            f"{options['step_seconds']:g} s measured; seed {config.seed}; "
            f"simulated in {cpu_s:.1f} s of CPU"
        )
        self.stdout.write(
            f"{'rate':>7} {'offered':>8} {'requests':>8} {'output':>8} "
            f"{'p95 TTFT':>9} {'stream p50':>10} {'stream p5':>10} {'holds':>6}"
        )
        self.stdout.write(
            f"{'req/s':>7} {'tok/s':>8} {'':>8} {'tok/s':>8} {'s':>9} "
            f"{'tok/s':>10} {'tok/s':>10} {'':>6}"
        )
        for step in answer.steps:
            holds = "yes" if step.holds else "no"
            self.stdout.write(
                f"{step.arrival_rate:>7.2f} {step.offered_tokens_per_s:>8,.0f} "
                f"{step.requests:>8,} {step.output_tokens_per_s:>8,.0f} "
                f"{_num(step.ttft_p95_s, 2):>9} "
                f"{_num(step.stream_tokens_per_s_p50, 1):>10} "
                f"{_num(step.stream_tokens_per_s_p5, 1):>10} {holds:>6}"
                + ("" if step.holds else f"  ({', '.join(step.reasons)})")
            )
        rule = (
            f"p95 TTFT < {criteria.ttft_p95_max_s:g} s and the "
            f"{_quantile_name(criteria.stream_quantile)} stream >= "
            f"{criteria.stream_min_tokens_per_s:g} tokens/s"
        )
        if answer.tokens_per_s is None:
            self.stdout.write(f"Capacity: no step held ({rule})")
        else:
            self.stdout.write(
                f"Capacity: {answer.tokens_per_s:,.0f} output tokens/s per replica "
                f"(at {answer.arrival_rate:.2f} req/s): {rule}"
            )
            self.stdout.write(
                f"  replicas for the seed's peak of {SEED_PEAK_TOKENS_PER_S:,} "
                f"output tokens/s: {_replicas(answer.tokens_per_s)}"
            )
        strict = answer.strict_tokens_per_s
        self.stdout.write(
            f"  stricter, 95% of streams >= {criteria.stream_min_tokens_per_s:g} "
            f"tokens/s: {'none' if strict is None else f'{strict:,.0f} tokens/s'}"
        )
        self.stdout.write(f"plot: {plot}")


def _quantile_name(q: float) -> str:
    return "median" if q == 0.5 else f"p{q * 100:g}"


def _replicas(tokens_per_s: float) -> int:
    return math.ceil(SEED_PEAK_TOKENS_PER_S / tokens_per_s)


def _title(answer: CapacityAnswer, config: FleetConfig, workload: ChatWorkload) -> str:
    found = (
        "none held"
        if answer.tokens_per_s is None
        else f"{answer.tokens_per_s:,.0f} output tokens/s"
    )
    return (
        f"Capacity test: one {config.profile} replica, {workload.prompt_tokens}/"
        f"{workload.answer_tokens}-token prompts/answers: {found} (seed {config.seed})"
    )


def _as_json(
    answer: CapacityAnswer,
    config: FleetConfig,
    workload: ChatWorkload,
    options: dict[str, Any],
    cpu_s: float,
    plot: Path,
) -> dict[str, Any]:
    criteria = answer.criteria
    return {
        "tokens_per_s": answer.tokens_per_s,
        "arrival_rate": answer.arrival_rate,
        "strict_tokens_per_s": answer.strict_tokens_per_s,
        "replicas_for_seed_peak": (
            _replicas(answer.tokens_per_s) if answer.tokens_per_s else None
        ),
        "criteria": {
            "ttft_p95_max_s": criteria.ttft_p95_max_s,
            "stream_min_tokens_per_s": criteria.stream_min_tokens_per_s,
            "stream_quantile": criteria.stream_quantile,
        },
        "steps": [step.as_dict() for step in answer.steps],
        "scenario": {
            "profile": config.profile,
            "replicas": 1,
            "prompt_tokens": workload.prompt_tokens,
            "history_tokens": workload.history_tokens,
            "answer_tokens": workload.answer_tokens,
            "mode": workload.mode,
            "step_seconds": options["step_seconds"],
            "warmup_seconds": options["warmup_seconds"],
            "seed": config.seed,
            "simulator_cpu_s": round(cpu_s, 2),
        },
        "plot": str(plot),
    }


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"
