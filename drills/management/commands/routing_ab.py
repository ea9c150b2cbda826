"""``manage.py routing_ab``: the seed's routing A/B in the fleet simulator.

``--engine sglang`` runs the replicas with SGLang's radix cache instead of vLLM's
block pool; ``--compare-engines`` replays the same arrivals with both and prints
one table, a row per policy and engine (``drills.domain.routing_ab.run_engine_ab``).
``--workload shared|agent`` replays one of ``drills.domain.workload.WORKLOADS``
instead of the seed's chat (whose shape the ``--mode``/``--*-tokens`` flags set).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from drills.domain.cache_sweep import (
    plan_scenario_for,
    run_cache_sweep,
    smallest_carried,
)
from drills.domain.capacity_plan import Plan, Scenario, estimate_chat_fleet, plan
from drills.domain.fleet_config import ENGINES, FleetConfig
from drills.domain.planned_fleet import SEED_NAME, FleetSize
from drills.domain.recorded_trace import scale_trace
from drills.domain.routing_ab import (
    POLICY_ORDER,
    generate_arrivals,
    run_engine_ab,
)
from drills.domain.workload import (
    WORKLOADS,
    Arrival,
    ChatWorkload,
    check_block_size,
    read_trace,
    trace_arrivals,
    workload_preset,
)
from drills.management.fleet_size import planned_fleet_size


class Command(BaseCommand):
    help = (
        "Replay one workload once per routing policy (round robin, least tokens in "
        "flight, prefix affinity with bounded load, cache aware) through the "
        "simulated fleet; print per policy the prefix hit rate, p95 TTFT, imbalance "
        "and uncached prefill tokens/s."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--replicas",
            type=int,
            help="chat replicas (default: the capacity plan's for one region "
            "carrying the replayed workload, regions_lost respected: 14 for the "
            "seed's chat; the seed's plan for a --trace)",
        )
        parser.add_argument("--minutes", type=float, default=10.0)
        parser.add_argument("--warmup-minutes", type=float, default=2.0)
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument(
            "--rate",
            type=float,
            help="requests/s (default: the workload's; the seed's chat: 100)",
        )
        parser.add_argument(
            "--workload",
            choices=WORKLOADS,
            default="seed",
            help="seed: the seed's chat (shaped by --mode and the --*-tokens flags); "
            "shared: behind 16 shared prefixes; agent: tool loops up to 32k tokens",
        )
        parser.add_argument(
            "--shared-prefixes",
            type=int,
            default=16,
            help="--workload shared: how many shared prefixes (default 16)",
        )
        parser.add_argument("--mode", choices=["seed", "growing"], default="seed")
        defaults = ChatWorkload()
        parser.add_argument(
            "--prompt-tokens",
            type=int,
            default=defaults.prompt_tokens,
            help=f"prompt length (seed: {defaults.prompt_tokens}; growing: the "
            "first prompt is prompt - history new tokens)",
        )
        parser.add_argument(
            "--history-tokens",
            type=int,
            default=defaults.history_tokens,
            help=f"of the prompt, the conversation's history (seed: "
            f"{defaults.history_tokens})",
        )
        parser.add_argument(
            "--answer-tokens",
            type=int,
            default=defaults.answer_tokens,
            help=f"answer length and max_tokens (seed: {defaults.answer_tokens})",
        )
        parser.add_argument(
            "--engine",
            choices=list(ENGINES),
            default="vllm",
            help="the replicas' engine: vllm (block pool) or sglang (radix cache)",
        )
        parser.add_argument(
            "--compare-engines",
            action="store_true",
            help="replay the same arrivals with every engine (vllm, sglang)",
        )
        parser.add_argument(
            "--policies",
            type=_names(POLICY_ORDER),
            default=POLICY_ORDER,
            help=f"comma-separated routing policies (default {','.join(POLICY_ORDER)})",
        )
        block_size = FleetConfig().block_size
        parser.add_argument(
            "--block-size",
            type=int,
            default=block_size,
            help="the simulated vLLM KV block in tokens (default "
            f"{block_size}: faster; vLLM's is 16)",
        )
        parser.add_argument("--profile", default="a100-8b")
        parser.add_argument(
            "--load-factor",
            type=float,
            default=1.25,
            help="prefix affinity's bound over the pool average (seed: 1.25)",
        )
        parser.add_argument(
            "--prefill-gap-tokens",
            type=int,
            default=FleetConfig().prefill_gap_tokens,
            help="cache aware: prefill a warm replica may owe over the fastest",
        )
        parser.add_argument(
            "--cache-load-factor",
            type=float,
            default=FleetConfig().cache_load_factor,
            help="cache aware: a warm replica's ceiling over the pool average",
        )
        parser.add_argument(
            "--kv-event-delay-ms",
            type=float,
            default=FleetConfig().kv_event_delay_s * 1000,
            help="cache aware: KV events reach the gateway's index this much later",
        )
        parser.add_argument(
            "--host-offload-gib",
            type=float,
            default=0.0,
            help="CPU offload tier per replica in GiB (vLLM --kv-offloading-size)",
        )
        parser.add_argument(
            "--ring-choices",
            type=int,
            help="prefix affinity tries this many ring nodes, then the least loaded "
            "(0: the whole ring; default PLATFORM_AFFINITY_RING_CHOICES)",
        )
        parser.add_argument(
            "--owner-wait-ms",
            type=float,
            default=0.0,
            help="an experiment: a request whose warm replica is over the bound waits "
            "up to this long for it (0: none, as the gateway)",
        )
        parser.add_argument(
            "--sweep-replicas",
            type=_numbers(int),
            help="run the cache sweep instead: prefix affinity on these fleet sizes "
            "(e.g. 10,12,14) times --sweep-offload",
        )
        parser.add_argument(
            "--sweep-offload",
            type=_numbers(float),
            default=(0.0,),
            help="host-offload sizes in GiB for the sweep (e.g. 0,64,128)",
        )
        parser.add_argument(
            "--trace", type=Path, help="replay this JSONL trace instead"
        )
        parser.add_argument(
            "--trace-rate-scale",
            type=float,
            default=1.0,
            help="with --trace: replay X times the trace's conversations (each "
            "cloned with its own history, shared prefixes kept shared: "
            "drills.domain.recorded_trace.scale_trace)",
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
                # A placeholder until the workload is known: _fleet_size plans it.
                replicas=options["replicas"] or 1,
                profile=options["profile"],
                seed=options["seed"],
                load_factor=options["load_factor"],
                min_bound_tokens=settings.PLATFORM_AFFINITY_MIN_BOUND_TOKENS,
                replica_tokens_in_flight=settings.PLATFORM_DEFAULT_REPLICA_TOKENS_IN_FLIGHT,
                host_offload_gib=options["host_offload_gib"],
                ring_choices=(
                    settings.PLATFORM_AFFINITY_RING_CHOICES
                    if options["ring_choices"] is None
                    else options["ring_choices"]
                ),
                owner_wait_s=options["owner_wait_ms"] / 1000,
                engine=options["engine"],
                block_size=options["block_size"],
                prefill_gap_tokens=options["prefill_gap_tokens"],
                cache_load_factor=options["cache_load_factor"],
                kv_event_delay_s=options["kv_event_delay_ms"] / 1000,
            )
            workload: ChatWorkload | None = None
            if options["trace"]:
                trace = scale_trace(
                    read_trace(options["trace"]),
                    options["trace_rate_scale"],
                    seed=options["seed"],
                )
                arrivals = list(trace_arrivals(trace))
                check_block_size(arrivals, config.block_size)
                scenario: dict[str, Any] = {
                    "trace": str(options["trace"]),
                    "trace_rate_scale": options["trace_rate_scale"],
                }
            elif options["workload"] != "seed":
                workload = workload_preset(
                    options["workload"],
                    arrival_rate=options["rate"],
                    shared_prefixes=options["shared_prefixes"],
                )
            else:
                workload = ChatWorkload(
                    arrival_rate=options["rate"] or 100.0,
                    mode=options["mode"],
                    prompt_tokens=options["prompt_tokens"],
                    history_tokens=options["history_tokens"],
                    answer_tokens=options["answer_tokens"],
                    max_tokens=options["answer_tokens"],
                )
            if workload is not None:
                arrivals = generate_arrivals(
                    workload, warmup_s + duration_s, seed=options["seed"]
                )
                scenario = {
                    "workload": options["workload"],
                    "arrival_rate": workload.arrival_rate,
                    "users": workload.users,
                    "message_interval_s": workload.message_interval_s,
                    "prompt_tokens": workload.prompt_tokens,
                    "history_tokens": workload.history_tokens,
                    "answer_tokens": workload.answer_tokens,
                    "mode": workload.mode,
                    "shared_prefixes": workload.shared_prefixes,
                    "max_context_tokens": workload.max_context_tokens,
                }
        except (OSError, ValueError) as exc:
            raise CommandError(str(exc)) from None
        if options["sweep_replicas"]:
            if workload is None or options["workload"] != "seed":
                raise CommandError("the cache sweep replays the seed's workload only")
            if options["compare_engines"]:
                raise CommandError("the cache sweep runs one engine: use --engine")
            if config.engine == "sglang" and max(options["sweep_offload"]) > 0:
                raise CommandError(
                    "--sweep-offload: the host tier is vLLM's; SGLang's "
                    "hierarchical cache is not modelled"
                )
            if min(options["sweep_replicas"]) < 1:
                raise CommandError(
                    "--sweep-replicas: a fleet needs at least one replica"
                )
            self._sweep(config, arrivals, workload, scenario, options)
            return
        size = _fleet_size(options, workload, config)
        config = replace(config, replicas=size.replicas)
        engines = list(ENGINES) if options["compare_engines"] else [config.engine]
        if "sglang" in engines and workload is not None and workload.shared_prefixes:
            raise CommandError(
                "--workload shared: shared prefixes are modelled with vllm's block "
                "cache only"
            )
        if "sglang" in engines and config.host_offload_gib > 0:
            raise CommandError(
                "--host-offload-gib: the host tier is vLLM's; SGLang's hierarchical "
                "cache is not modelled"
            )
        started = time.process_time()
        outcomes = run_engine_ab(
            config,
            arrivals,
            engines=engines,
            duration_s=duration_s,
            warmup_s=warmup_s,
            policies=options["policies"],
        )
        cpu_s = time.process_time() - started
        scenario.update(
            _run_figures(config, options, len(arrivals), cpu_s),
            replicas=config.replicas,
            replicas_source=size.source,
            host_offload_gib=config.host_offload_gib,
            owner_wait_s=config.owner_wait_s,
            engines=engines,
            prefill_gap_tokens=config.prefill_gap_tokens,
            cache_load_factor=config.cache_load_factor,
            kv_event_delay_s=config.kv_event_delay_s,
        )
        plot = options["plot"] or _default_plot()
        from drills.experiment_plots import plot_routing_ab

        title = (
            f"Routing A/B: {config.replicas} x {config.profile} "
            f"({', '.join(engines)}), "
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
            f"Routing A/B: {config.replicas} replicas ({size.source}; "
            f"{config.profile}, "
            f"{' and '.join(_engine_label(e, config) for e in engines)}), "
            f"{len(arrivals):,} requests over {options['warmup_minutes']:g} + "
            f"{options['minutes']:g} min, seed {config.seed}; "
            f"simulated in {cpu_s:.1f} s of CPU"
        )
        self.stdout.write(
            f"{'policy':<16} {'engine':<7} {'hit rate':>9} {'hist hits':>9} "
            f"{'p50 TTFT':>9} {'p95 TTFT':>9} "
            f"{'TPOT':>8} {'imb mean':>9} {'imb peak':>9} {'uncached prefill':>17} "
            f"{'output':>10}"
        )
        self.stdout.write(
            f"{'':<16} {'':<7} {'':>9} {'to token':>9} {'s':>9} {'s':>9} {'ms':>8} "
            f"{'x':>9} {'x':>9} {'tokens/s':>17} {'tokens/s':>10}"
        )
        for o in outcomes:
            self.stdout.write(
                f"{o.policy:<16} {o.engine:<7} {_pct(o.prefix_hit_rate):>9} "
                f"{_pct(o.history_hit_rate):>9} {_num(o.ttft_p50_s, 2):>9} "
                f"{_num(o.ttft_p95_s, 2):>9} {_num(o.tpot_p50_s and o.tpot_p50_s * 1000, 1):>8} "
                f"{_num(o.imbalance_mean, 3):>9} {_num(o.imbalance_peak, 3):>9} "
                f"{o.uncached_prefill_tokens_per_s:>17,.0f} {o.output_tokens_per_s:>10,.0f}"
            )
        self.stdout.write(f"plot: {plot}")

    def _sweep(
        self,
        config: FleetConfig,
        arrivals: list[Arrival],
        workload: ChatWorkload,
        scenario: dict[str, Any],
        options: dict[str, Any],
    ) -> None:
        warmup_s = options["warmup_minutes"] * 60
        duration_s = options["minutes"] * 60
        base = plan_scenario_for(workload, config)
        started = time.process_time()
        points = run_cache_sweep(
            config,
            arrivals,
            replicas=options["sweep_replicas"],
            host_offload_gib=options["sweep_offload"],
            duration_s=duration_s,
            warmup_s=warmup_s,
            estimate=lambda n, gib: estimate_chat_fleet(
                base.with_values({"host_offload_gib": gib}), n
            ),
        )
        cpu_s = time.process_time() - started
        smallest = smallest_carried(points, min_hit_rate=0.8)
        plans = {
            gib: plan(base.with_values({"host_offload_gib": gib}))
            for gib in options["sweep_offload"]
        }
        scenario.update(_run_figures(config, options, len(arrivals), cpu_s))
        from drills.experiment_plots import default_plot_path, plot_cache_sweep

        plot = options["plot"] or default_plot_path("cache_sweep")
        plot_cache_sweep(
            points,
            plot,
            title=(
                f"Cache sweep: {config.profile}, {workload.arrival_rate:g} req/s, "
                f"prefix affinity at {config.load_factor:g}, "
                f"{options['minutes']:g} min (seed {config.seed})"
            ),
        )
        plan_rows: dict[str, dict[str, Any]] = {
            f"{gib:g}": {
                "chat_replicas_per_region_with_prefill": _figure(
                    p, "chat_replicas_per_region_with_prefill"
                ),
                "prefix_hit_rate_expected": _figure(p, "prefix_hit_rate_expected"),
                "usd_per_month_with_prefill": _figure(p, "usd_per_month_with_prefill"),
            }
            for gib, p in plans.items()
        }
        smallest_row: dict[str, Any] | None = None
        if smallest is not None:
            cost = plan(
                base.with_values({"host_offload_gib": smallest.host_offload_gib})
            )
            gpus = cost.scenario.regions * (
                smallest.replicas
                + cost["big_replicas_per_region"] * cost.scenario.big.gpus_per_replica
            )
            smallest_row = {
                **smallest.row(),
                "gpus_total": gpus,
                "usd_per_month": round(
                    gpus * cost.scenario.gpu_hour_usd * cost.scenario.hours_per_month, 2
                ),
                "seed_usd_per_month": cost["usd_per_month"],
            }
        if options["json"]:
            self.stdout.write(
                json.dumps(
                    {
                        "points": [p.row() for p in points],
                        "plan": plan_rows,
                        "smallest_at_80_percent": smallest_row,
                        "scenario": scenario,
                        "plot": str(plot),
                    },
                    indent=2,
                )
            )
            return
        self.stdout.write(
            f"Cache sweep: prefix affinity, {len(arrivals):,} requests over "
            f"{options['warmup_minutes']:g} + {options['minutes']:g} min, seed "
            f"{config.seed}; simulated in {cpu_s:.1f} s of CPU"
        )
        self.stdout.write(
            f"{'replicas':>8} {'offload':>8} {'hit rate':>9} {'host':>6} "
            f"{'p50 TTFT':>9} {'p95 TTFT':>9} {'TPOT':>7} {'uncached':>10} "
            f"{'carried':>8} {'plan hit':>9} {'plan TPOT':>10} {'plan':>6}"
        )
        self.stdout.write(
            f"{'':>8} {'GiB':>8} {'':>9} {'':>6} {'s':>9} {'s':>9} {'ms':>7} "
            f"{'tokens/s':>10} {'':>8} {'':>9} {'ms':>10} {'':>6}"
        )
        for point in points:
            estimate = point.plan
            # The cache model's hit rate means nothing where queues grow.
            steady = None if estimate is None or estimate.step_ms is None else estimate
            self.stdout.write(
                f"{point.replicas:>8} {point.host_offload_gib:>8g} "
                f"{_pct(point.prefix_hit_rate):>9} {_pct(point.host_hit_rate):>6} "
                f"{_num(point.ttft_p50_s, 2):>9} {_num(point.ttft_p95_s, 2):>9} "
                f"{_num(point.tpot_p50_s and point.tpot_p50_s * 1000, 1):>7} "
                f"{point.uncached_prefill_tokens_per_s:>10,.0f} "
                f"{'yes' if point.carried else 'no':>8} "
                f"{_pct(None if steady is None else steady.hit_rate):>9} "
                f"{_num(None if estimate is None else estimate.step_ms, 1):>10} "
                f"{'yes' if estimate and estimate.is_carried(30.0) else 'no':>6}"
            )
        for gib, row in plan_rows.items():
            self.stdout.write(
                f"plan at {gib} GiB: {row['chat_replicas_per_region_with_prefill']} "
                f"replicas per region, hit rate "
                f"{_pct(row['prefix_hit_rate_expected'])}, "
                f"{row['usd_per_month_with_prefill']} USD/month"
            )
        if smallest_row is None:
            self.stdout.write("no point carried the peak at an 80% hit rate or more")
        else:
            self.stdout.write(
                f"smallest carried at >= 80% hits: {smallest_row['replicas']} replicas "
                f"x {smallest_row['host_offload_gib']:g} GiB: hit rate "
                f"{_pct(smallest_row['prefix_hit_rate'])}, p95 TTFT "
                f"{_num(smallest_row['ttft_p95_s'], 2)} s; "
                f"{smallest_row['gpus_total']} GPUs, "
                f"{smallest_row['usd_per_month']:,.0f} USD/month (seed: "
                f"{smallest_row['seed_usd_per_month']:,.0f})"
            )
        self.stdout.write(f"plot: {plot}")


def _fleet_size(
    options: dict[str, Any], workload: ChatWorkload | None, config: FleetConfig
) -> FleetSize:
    """Return ``--replicas``, else the plan's fleet for one region carrying the
    replayed workload (``plan_scenario_for``), or the seed's for a trace."""
    if workload is None:
        return planned_fleet_size(Scenario(), SEED_NAME, replicas=options["replicas"])
    return planned_fleet_size(
        plan_scenario_for(workload, config),
        f"the {options['workload']} workload at {workload.arrival_rate:g} req/s",
        replicas=options["replicas"],
    )


def _run_figures(
    config: FleetConfig, options: dict[str, Any], requests: int, cpu_s: float
) -> dict[str, Any]:
    """Return what both reports say of the run: the fleet, routing and replay."""
    return {
        "profile": config.profile,
        "block_size": config.block_size,
        "engine": config.engine,
        "load_factor": config.load_factor,
        "min_bound_tokens": config.min_bound_tokens,
        "ring_choices": config.ring_choices,
        "minutes": options["minutes"],
        "warmup_minutes": options["warmup_minutes"],
        "seed": config.seed,
        "requests": requests,
        "simulator_cpu_s": round(cpu_s, 2),
    }


def _engine_label(engine: str, config: FleetConfig) -> str:
    if engine == "sglang":
        return "sglang radix cache"
    return f"vllm {config.block_size}-token blocks"


def _names(known: tuple[str, ...]) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(item.strip() for item in text.split(",") if item.strip())
        unknown = [name for name in names if name not in known]
        if not names or unknown:
            raise argparse.ArgumentTypeError(
                f"expected some of {','.join(known)}, not {text!r}"
            )
        return names

    return parse


def _figure(result: Plan, name: str) -> float | int | None:
    try:
        return result[name]
    except KeyError:
        return None


def _numbers(kind: type) -> Any:
    def parse(text: str) -> tuple[Any, ...]:
        try:
            values = tuple(kind(item) for item in text.split(",") if item.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated numbers, not {text!r}"
            ) from None
        if not values or min(values) < 0:
            raise argparse.ArgumentTypeError(
                f"expected non-negative numbers, not {text!r}"
            )
        return values

    return parse


def _default_plot() -> Path:
    from drills.experiment_plots import default_plot_path

    return default_plot_path("routing_ab")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


__all__ = ["POLICY_ORDER", "Command"]
