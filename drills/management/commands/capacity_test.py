"""``manage.py capacity_test --sim``: the seed's capacity-per-version procedure
against one modelled replica.

With ``--trace PATH`` the steps replay that JSONL trace (the load-test gate's
replay: ``drills.domain.capacity_test.run_trace_capacity_test``) instead of the
workload flags, so the modelled answer can be set beside the live gate's on the
same input; ``--rates`` gives the arrival rates outright (as the gate may).

``--versus PATH`` (with ``--trace``) runs the same steps on a second trace and
prints the two side by side, step by offered tokens/s: p95 TTFT, prefix hit rate
and whether the step holds, then each capacity: a recorded trace (an export, or
``make_recorded_trace``'s generated one) beside the synthetic
``platform/traces/chat-650-250.jsonl``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from drills.domain.capacity_test import (
    CapacityAnswer,
    CapacityCriteria,
    CapacityStep,
    ReplayRequest,
    mean_output_tokens,
    read_replay_trace,
    run_capacity_test,
    run_trace_capacity_test,
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
        "is --prompt-tokens 1200 --history-tokens 800 --answer-tokens 300. "
        "--trace replays a JSONL trace instead (platform/traces/chat-650-250.jsonl "
        "is the load-test gate's)."
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
            "--trace",
            type=Path,
            help="replay this JSONL trace (messages or prompts) instead of the "
            "workload flags",
        )
        parser.add_argument(
            "--versus",
            type=Path,
            help="with --trace: run the same steps on this second trace and print "
            "the two side by side",
        )
        parser.add_argument(
            "--rates",
            help="arrival rates (req/s, comma-separated) instead of --start/--step/"
            "--max",
        )
        parser.add_argument(
            "--block-size",
            type=int,
            help="simulated KV block (default: 16 with --trace, as the replica "
            "serving a replay, else the fleet simulator's 64)",
        )
        parser.add_argument(
            "--drain-seconds",
            type=float,
            default=120.0,
            help="how long a step waits, arrivals going on, for its requests to end",
        )
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

        if options["versus"] and not options["trace"]:
            raise CommandError("--versus compares two traces: give --trace as well")
        try:
            trace = _read_trace(options["trace"]) if options["trace"] else None
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
            block_size = options["block_size"] or (16 if trace else None)
            if block_size:
                config = replace(config, block_size=block_size)
            criteria = CapacityCriteria(
                ttft_p95_max_s=options["ttft_p95_max_s"],
                stream_min_tokens_per_s=options["stream_min_tokens_per_s"],
                stream_quantile=options["stream_quantile"],
            )
            rates = _rates(
                options, mean_output_tokens(trace) if trace else answer_tokens
            )
            started = time.process_time()

            def replay(
                trace: list[ReplayRequest], rates: list[float]
            ) -> CapacityAnswer:
                return run_trace_capacity_test(
                    config,
                    trace,
                    rates,
                    criteria=criteria,
                    duration_s=options["step_seconds"],
                    warmup_s=options["warmup_seconds"],
                    drain_s=options["drain_seconds"],
                    stop_after_failures=options["stop_after"],
                    seed=options["seed"],
                )

            if trace is not None:
                answer = replay(trace, rates)
                if options["versus"]:
                    other = _read_trace(options["versus"])
                    versus = replay(other, _rates(options, mean_output_tokens(other)))
                    self._side_by_side(
                        (options["trace"], trace, answer),
                        (options["versus"], other, versus),
                    )
                    return
            else:
                answer = run_capacity_test(
                    config,
                    workload,
                    rates,
                    criteria=criteria,
                    duration_s=options["step_seconds"],
                    warmup_s=options["warmup_seconds"],
                    drain_s=options["drain_seconds"],
                    stop_after_failures=options["stop_after"],
                )
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        cpu_s = time.process_time() - started
        shape = _shape(workload, trace, options["trace"])
        plot = options["plot"] or default_plot_path("capacity_test")
        plot_capacity(answer, plot, title=_title(answer, config, shape))
        if options["json"]:
            self.stdout.write(
                json.dumps(
                    _as_json(answer, config, shape, options, cpu_s, plot), indent=2
                )
            )
            return
        self._print(answer, config, shape, options, cpu_s, plot)

    def _print(
        self,
        answer: CapacityAnswer,
        config: FleetConfig,
        shape: dict[str, Any],
        options: dict[str, Any],
        cpu_s: float,
        plot: Path,
    ) -> None:
        criteria = answer.criteria
        self.stdout.write(
            f"Capacity test (simulated): one {config.profile} replica; "
            f"{_describe(shape)}; each "
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

    def _side_by_side(
        self,
        left: tuple[Path, list[ReplayRequest], CapacityAnswer],
        right: tuple[Path, list[ReplayRequest], CapacityAnswer],
    ) -> None:
        """Print two traces' steps by offered tokens/s, and their capacities."""
        names = [path.name for path, _, _ in (left, right)]
        self.stdout.write(f"Load-test gate (simulated), side by side: A {names[0]}")
        self.stdout.write(f"{'':>40}B {names[1]}")
        for label, (_path, trace, _answer) in zip("AB", (left, right), strict=True):
            shape = _shape(ChatWorkload(), trace, _path)
            self.stdout.write(f"  {label}: {_describe(shape)}")
        self.stdout.write(
            f"{'offered':>8} | {'p95 TTFT s':^15} | {'prefix hit':^15} | {'holds':^11}"
        )
        self.stdout.write(
            f"{'tok/s':>8} | {'A':>7} {'B':>7} | {'A':>7} {'B':>7} | {'A':>5} {'B':>5}"
        )
        steps = [
            {round(s.offered_tokens_per_s): s for s in answer.steps}
            for _p, _t, answer in (left, right)
        ]
        for offered in sorted(set(steps[0]) | set(steps[1])):
            a, b = steps[0].get(offered), steps[1].get(offered)
            self.stdout.write(
                f"{offered:>8,} | {_num(a.ttft_p95_s if a else None, 2):>7} "
                f"{_num(b.ttft_p95_s if b else None, 2):>7} | "
                f"{_pct(a.prefix_hit_rate if a else None):>7} {_pct(b.prefix_hit_rate if b else None):>7}"
                f" | {_holds(a):>5} {_holds(b):>5}"
            )
        for label, (_path, _trace, answer) in zip("AB", (left, right), strict=True):
            found = (
                "no step held"
                if answer.tokens_per_s is None
                else f"{answer.tokens_per_s:,.0f} output tokens/s per replica "
                f"(at {answer.arrival_rate:.2f} req/s; 95% of streams: "
                f"{_num(answer.strict_tokens_per_s, 0)})"
            )
            self.stdout.write(f"Capacity {label}: {found}")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _holds(step: CapacityStep | None) -> str:
    return "-" if step is None else ("yes" if step.holds else "no")


def _quantile_name(q: float) -> str:
    return "median" if q == 0.5 else f"p{q * 100:g}"


def _replicas(tokens_per_s: float) -> int:
    return math.ceil(SEED_PEAK_TOKENS_PER_S / tokens_per_s)


def _title(answer: CapacityAnswer, config: FleetConfig, shape: dict[str, Any]) -> str:
    found = (
        "none held"
        if answer.tokens_per_s is None
        else f"{answer.tokens_per_s:,.0f} output tokens/s"
    )
    what = (
        f"trace {Path(shape['trace']).name}"
        if "trace" in shape
        else f"{shape['prompt_tokens']}/{shape['answer_tokens']}-token prompts/answers"
    )
    return (
        f"Capacity test: one {config.profile} replica, {what}: {found} "
        f"(seed {config.seed})"
    )


def _read_trace(path: Path) -> list[ReplayRequest]:
    try:
        return read_replay_trace(path)
    except OSError as exc:
        raise CommandError(f"cannot read trace {path}: {exc.strerror}") from None


def _rates(options: dict[str, Any], answer_tokens: float) -> list[float]:
    if options["rates"]:
        try:
            return [float(rate) for rate in options["rates"].split(",") if rate]
        except ValueError:
            raise ValueError(f"--rates: not numbers: {options['rates']!r}") from None
    return step_rates(
        start_tokens_per_s=options["start"] or options["step"],
        step_tokens_per_s=options["step"],
        max_tokens_per_s=options["max"],
        answer_tokens=answer_tokens,
    )


def _shape(
    workload: ChatWorkload, trace: list[ReplayRequest] | None, path: Path | None
) -> dict[str, Any]:
    """Return what the steps were fed: the workload's figures or the trace's."""
    if trace is None or path is None:
        return {
            "prompt_tokens": workload.prompt_tokens,
            "history_tokens": workload.history_tokens,
            "answer_tokens": workload.answer_tokens,
            "mode": workload.mode,
        }
    n = len(trace)
    return {
        "trace": str(path),
        "trace_requests": n,
        "prompt_tokens": round(sum(r.prompt_tokens for r in trace) / n, 1),
        "history_tokens": round(sum(r.history_tokens for r in trace) / n, 1),
        "answer_tokens": round(mean_output_tokens(trace), 1),
    }


def _describe(shape: dict[str, Any]) -> str:
    if "trace" in shape:
        return (
            f"replay of {shape['trace']} ({shape['trace_requests']} requests: "
            f"{shape['prompt_tokens']:g}-token prompts on average, "
            f"{shape['history_tokens']:g} of them shared with the previous turn, "
            f"{shape['answer_tokens']:g}-token answers)"
        )
    return (
        f"{shape['prompt_tokens']}-token prompts ({shape['history_tokens']} of "
        f"them shared history), {shape['answer_tokens']}-token answers"
    )


def _as_json(
    answer: CapacityAnswer,
    config: FleetConfig,
    shape: dict[str, Any],
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
        "criteria": criteria.as_dict(),
        "steps": [step.as_dict() for step in answer.steps],
        "scenario": {
            "profile": config.profile,
            "replicas": 1,
            **shape,
            "block_size": config.block_size,
            "step_seconds": options["step_seconds"],
            "warmup_seconds": options["warmup_seconds"],
            "seed": config.seed,
            "simulator_cpu_s": round(cpu_s, 2),
        },
        "plot": str(plot),
    }


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"
