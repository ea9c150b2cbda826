"""``manage.py capacity_plan``: the seed's capacity arithmetic for any scenario.

``--trace PATH`` takes the workload from a JSONL trace (an export of recorded
traffic, or any trace ``drills.domain.workload.read_trace`` reads) instead of the
seed's figures: the peak arrival rate (busiest minute, times
``--trace-rate-scale``) as streams, the mean prompt and answer, the cacheable
prefix from the block hashes and, where the trace has the replicas' hits, the
measured hit rate (``drills.domain.recorded_trace.trace_workload``). Those keys
are applied after ``--scenario`` and before ``--set``, and printed above the plan.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import yaml
from django.core.management.base import BaseCommand, CommandError, CommandParser

from drills.domain.capacity_plan import (
    ChatReplicaShape,
    EmbeddingPool,
    Figure,
    Plan,
    Scenario,
    ScenarioError,
    plan,
)
from drills.domain.recorded_trace import TraceWorkload, trace_workload
from drills.domain.workload import read_trace
from simengine.domain.embedding_perf import EMBEDDING_PROFILES
from simengine.domain.perf import PROFILES


class Command(BaseCommand):
    help = (
        "Recompute the seed's capacity plan (replicas, GPUs, cost, prefill, KV cache, "
        "cold start, an embedding pool when the scenario has one) from a scenario whose defaults are the seed's figures. "
        "Keys and formulas: docs/capacity-plan.md."
    )
    # Pure arithmetic: it needs neither the database nor the system checks.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--scenario",
            type=Path,
            help="YAML or JSON file of scenario keys (see drills/scenarios/seed.yaml)",
        )
        parser.add_argument(
            "--set",
            dest="overrides",
            action="extend",
            nargs="+",
            default=[],
            metavar="KEY=VALUE",
            help="override a key after the file, e.g. --set big.peak_streams=80",
        )
        parser.add_argument(
            "--profile",
            choices=sorted(PROFILES),
            help="take the replica section (step costs, KV cache) from this fleet "
            "simulator profile (default a100-8b), before the file and --set",
        )
        parser.add_argument(
            "--embedding-profile",
            choices=sorted(EMBEDDING_PROFILES),
            help="take embedding.replica_input_tokens_per_s from this simulated "
            "embedding replica's profile in full batches (default a100-minilm), "
            "before the file and --set",
        )
        parser.add_argument(
            "--trace",
            type=Path,
            help="take the workload (peak rate, prompts, answers, prefix hits) "
            "from this JSONL trace",
        )
        parser.add_argument(
            "--trace-rate-scale",
            type=float,
            default=1.0,
            help="with --trace: plan for this many times the trace's peak rate",
        )
        parser.add_argument("--json", action="store_true", help="print JSON")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            scenario = Scenario()
            if options["scenario"] is not None:
                scenario = Scenario.from_mapping(read_scenario(options["scenario"]))
            if options["profile"] is not None:
                shape = ChatReplicaShape.from_profile(PROFILES[options["profile"]])
                scenario = replace(scenario, replica=shape)
            if options["embedding_profile"] is not None:
                pool = EmbeddingPool.from_profile(
                    EMBEDDING_PROFILES[options["embedding_profile"]]
                )
                scenario = scenario.with_values(
                    {
                        "embedding.replica_input_tokens_per_s": (
                            pool.replica_input_tokens_per_s
                        )
                    }
                )
            derived = None
            if options["trace"] is not None:
                derived = _trace_workload(options["trace"], options["trace_rate_scale"])
                scenario = scenario.with_values(
                    derived.scenario_values(scenario.stream_tokens_per_s)
                )
            scenario = scenario.with_overrides(options["overrides"])
        except ScenarioError as exc:
            raise CommandError(f"invalid scenario: {exc}") from None
        result = plan(scenario)
        if options["json"]:
            data = result.as_dict()
            if derived is not None:
                data["trace_workload"] = {
                    "trace": str(options["trace"]),
                    "rate_scale": options["trace_rate_scale"],
                    **asdict(derived),
                }
            self.stdout.write(json.dumps(data, indent=2))
            return
        if derived is not None:
            self.stdout.write(
                _render_derived(derived, options["trace"], options["trace_rate_scale"])
            )
        self.stdout.write(render_table(result))


def _trace_workload(path: Path, scale: float) -> TraceWorkload:
    try:
        return trace_workload(read_trace(path), rate_scale=scale)
    except OSError as exc:
        raise CommandError(f"cannot read trace {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise CommandError(f"trace {path}: {exc}") from None


def _render_derived(derived: TraceWorkload, path: Path, scale: float) -> str:
    measured = (
        "none recorded (a generated trace): the scenario's prefix_hit_rate stands"
        if derived.measured_hit_rate is None
        else f"{derived.measured_hit_rate:.1%} of the cacheable prefix (the "
        "replicas' recorded hits): prefix_hit_rate"
    )
    return "\n".join(
        [
            f"Workload from trace {path}: {derived.requests:,} requests over "
            f"{derived.span_s:,.0f} s",
            f"  peak rate          {derived.peak_rps:,.2f} requests/s (busiest "
            f"minute x {scale:g})",
            f"  prompt tokens      {derived.prompt_tokens:,.0f} mean, "
            f"{derived.prompt_p95_tokens:,.0f} p95",
            f"  answer tokens      {derived.answer_tokens:,.0f} mean",
            f"  cacheable prefix   {derived.cached_prefix_tokens:,.0f} tokens mean "
            f"(blocks an earlier request produced: {derived.unbounded_hit_rate:.1%} "
            "of prompt tokens)",
            f"  measured hits      {measured}",
            "  between turns      "
            + (
                "one turn per conversation: message_interval_s stands"
                if derived.turn_gap_s is None
                else f"{derived.turn_gap_s:,.1f} s mean: message_interval_s"
            ),
            "",
        ]
    )


def read_scenario(path: Path) -> dict[str, object]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CommandError(f"cannot read scenario file {path}: {exc}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise CommandError(f"scenario file {path} is not valid: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise CommandError(
            f"scenario file {path} must hold a mapping of keys, not "
            f"{type(data).__name__}"
        )
    return data


def render_table(result: Plan) -> str:
    """Return the plan as text: one section per seed section, then the 70B options."""
    changed = result.scenario.overrides()
    lines = [
        "Capacity plan: the seed's scenario"
        + (
            " with " + ", ".join(f"{k}={v:g}" for k, v in changed.items())
            if changed
            else ""
        )
    ]
    names = [f.name for f in result.figures]
    name_w = max(len(n) for n in names)
    value_w = max(len(_value(f)) for f in result.figures)
    unit_w = max(len(f.unit) for f in result.figures)
    section = None
    for figure in result.figures:
        if figure.section != section:
            section = figure.section
            lines += ["", section]
        lines.append(
            f"  {figure.name:<{name_w}}  {_value(figure):>{value_w}}  "
            f"{figure.unit:<{unit_w}}  {figure.how}"
        )
    s = result.scenario
    lines += [
        "",
        f"70B precision options ({s.big_model.params_b:g} B parameters, "
        f"{s.model.gpu_memory_gb:g} GB GPUs, at least "
        f"{s.big_model.min_cache_gb:g} GB of cache)",
    ]
    header = (
        "precision",
        "weights GB",
        "GPUs/replica",
        "cache GB",
        f"cache GB on {s.big.gpus_per_replica} GPUs",
        "70B GPUs",
        "fleet GPUs",
    )
    rows = [
        (
            o.precision,
            f"{o.weights_gb:g}",
            _or_dash(o.gpus_per_replica),
            _or_dash(o.cache_gb_left),
            f"{o.cache_gb_at_fleet_gpus:g}",
            _or_dash(o.big_gpus_total),
            _or_dash(o.fleet_gpus_total),
        )
        for o in result.precision_options
    ]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        lines.append(
            "  "
            + "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    if result.warnings:
        lines += ["", "Warnings"]
        lines += [f"  - {warning}" for warning in result.warnings]
    return "\n".join(lines)


def _value(figure: Figure) -> str:
    if isinstance(figure.value, int):
        return f"{figure.value:,}"
    return f"{figure.value:,.{figure.places}f}"


def _or_dash(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"
