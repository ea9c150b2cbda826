"""``manage.py twin_check``: the traffic twin checked against a live window.

    manage.py twin_check --seeds 0 1 2 --json /tmp/twin.json --plot /tmp/twin.png

For each seed: a small live window (gateway, node agent, simulated replicas, the
autoscaler's tick; ``drills.twin_live``) under a compressed day of conversations,
recorded by the traffic twin and exported; the export replayed in the fleet
simulator configured as the live pool (``drills.domain.twin_check``, ``drills.twin_compare``); then
predicted against measured: p95 TTFT, prefix hit rate, mean tokens in flight and
the replicas the autoscaler chose, with the relative error. The replicas are
the replay's own autoscaler's; the other figures are the replay's on the fleet
the live pool had (its scale-ups followed) with each request on the replica
that served it live (the trace's), and the replay placing by its own ring on
that fleet and the replay with its own autoscaler are printed after (p95 and hit
rate), with the gated replay lined up against live request by request
(``paired_figures``: pairs, hits that differ, the TTFT error). The simulator's TTFT
gets the replica's frontend time (the shared profile's ``frontend_ms``) and the
gateway's overhead, which it does not model, as paired probes (through the
gateway, straight to a replica) read it during the load (their records leave
the trace), and the replica's own time beyond its profile (idle probes of the
load's prompt size straight to a replica, less the profile's TTFT for them).
Fails when p95 TTFT or the hit rate of any seed is off by more than
``--tolerance`` (15%). Traces go to ``--out-dir``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from drills.domain.twin_check import TOLERANCE, TwinComparison, TwinLoad
from drills.management.reports import add_result_arguments, write_result

_LABELS = {
    "requests": ("requests", 1.0, "{:.0f}"),
    "ttft_p50_s": ("p50 TTFT ms", 1000.0, "{:.1f}"),
    "ttft_p95_s": ("p95 TTFT ms", 1000.0, "{:.1f}"),
    "hit_rate": ("prefix hit rate", 1.0, "{:.3f}"),
    "tokens_in_flight_mean": ("tokens in flight (mean)", 1.0, "{:.0f}"),
    "replicas_mean": ("replicas serving (mean)", 1.0, "{:.2f}"),
    "replicas_peak": ("replicas serving (peak)", 1.0, "{:.0f}"),
    "desired_changes": ("autoscaler size changes", 1.0, "{:.0f}"),
    "decode_s_per_token": ("decode ms per token", 1000.0, "{:.2f}"),
    "request_s_mean": ("request s, arrival to end", 1.0, "{:.3f}"),
}


class Command(BaseCommand):
    help = (
        "Run a small live window (gateway, agent, simulated replicas, autoscaler) "
        "under a day of conversations, record it with the traffic twin, replay the "
        "export in the fleet simulator and print predicted against measured: p95 "
        "TTFT, hit rate, tokens in flight, replicas. Fails past --tolerance."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--seeds", type=int, nargs="+", default=[0])
        parser.add_argument("--duration", type=float, default=150.0, help="seconds")
        parser.add_argument("--peak-rps", type=float, default=5.0)
        parser.add_argument("--trough-rps", type=float, default=0.5)
        parser.add_argument("--max-replicas", type=int, default=3)
        parser.add_argument(
            "--replica-tokens", type=int, default=1000, help="load-tested capacity"
        )
        parser.add_argument("--tolerance", type=float, default=TOLERANCE)
        parser.add_argument("--out-dir", type=Path, default=Path("/tmp/twin-check"))
        add_result_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        from drills.experiment_plots import default_plot_path, plot_twin
        from drills.twin_compare import check_seed
        from drills.twin_live import TwinPlan

        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)
        wall0 = time.monotonic()
        quiet = options["json"] == "-"
        log = (lambda _: None) if quiet else self.stdout.write
        out_dir: Path = options["out_dir"]
        out_dir.mkdir(parents=True, exist_ok=True)
        seeds = []
        for seed in options["seeds"]:
            plan = TwinPlan(
                load=TwinLoad(
                    seed=seed,
                    duration_s=options["duration"],
                    peak_rps=options["peak_rps"],
                    trough_rps=options["trough_rps"],
                ),
                max_replicas=options["max_replicas"],
                replica_tokens_in_flight=options["replica_tokens"],
            )
            log(f"seed {seed}: live window of {plan.load.duration_s:.0f} s")
            seeds.append(
                check_seed(
                    plan,
                    out_dir=out_dir,
                    tolerance=options["tolerance"],
                    log=log,
                )
            )
        plot = options["plot"] or default_plot_path("twin_check")
        plot_twin(seeds, plot)
        passed = all(s["comparison"].passed for s in seeds)
        data = {
            "passed": passed,
            "tolerance": options["tolerance"],
            "seeds": [_seed_dict(s) for s in seeds],
            "wall_s": round(time.monotonic() - wall0, 1),
            "plot": str(plot),
        }
        write_result(
            self.stdout,
            data,
            options["json"],
            lambda: _print(self.stdout.write, seeds, plot, passed=passed),
        )
        if not passed:
            raise CommandError(
                "the twin's p95 TTFT or hit rate is off by more than "
                f"{options['tolerance']:.0%} of the live window's"
            )


def _seed_dict(seed: dict[str, Any]) -> dict[str, Any]:
    comparison: TwinComparison = seed["comparison"]
    return {
        **{k: v for k, v in seed.items() if k not in ("comparison", "series")},
        "passed": comparison.passed,
        "figures": [asdict(row) for row in comparison.rows],
        "series": seed["series"],
    }


def _cell(name: str, value: float | None) -> str:
    if value is None:
        return "-"
    _, scale, form = _LABELS[name]
    return form.format(value * scale)


def _print(
    write: Any, seeds: list[dict[str, Any]], plot: Path, *, passed: bool
) -> None:
    for seed in seeds:
        comparison: TwinComparison = seed["comparison"]
        write("")
        write(
            f"seed {seed['seed']}: {seed['live_requests']} live requests "
            f"(failed: {seed['live_failed'] or 'none'}), trace {seed['trace_requests']} lines, "
            f"window {seed['window_s']:.0f} s, gateway overhead "
            f"{seed['gateway_overhead_ms']:.1f} ms under the load "
            f"({seed['load_probes']} probes; idle "
            f"{seed['gateway_overhead_idle_ms']:.1f}) + replica frontend "
            f"{seed['frontend_ms']:.1f} ms + replica beyond its profile "
            f"{seed['replica_residual_ms']:.1f} ms held between admission and the "
            "replica in the replay, replica start "
            f"{seed['replica_start_s']:.1f} s"
        )
        write(f"{'figure':<26} {'predicted':>10} {'measured':>10} {'error':>8}")
        for row in comparison.rows:
            error = "-" if row.relative_error is None else f"{row.relative_error:+.1%}"
            mark = (" ok" if row.is_within else " OFF") if row.is_gated else ""
            write(
                f"{_LABELS[row.name][0]:<26} {_cell(row.name, row.predicted):>10} "
                f"{_cell(row.name, row.measured):>10} {error:>8}{mark}"
            )
        shared = seed["live_first_turn_hit_share"]
        if shared is not None:
            write(
                f"live hits on first turns (system prompts shared across "
                f"conversations): {shared:.3f} of prompt tokens"
            )
        paired = seed["paired"]
        write(
            f"request by request: {paired['pairs']} of {paired['live']} live lined "
            f"up with the replay; hits differ on {paired['hit_differs']}; TTFT "
            f"replayed less live {_ms(paired['ttft_error_p50_s'])} ms (median), "
            f"within {_cell('ttft_p95_s', paired['ttft_abs_error_p95_s'])} ms on 95%"
        )
        placed = seed["own_placement_twin"]
        write(
            f"the twin placing by its own ring: p95 TTFT "
            f"{_cell('ttft_p95_s', placed['ttft_p95_s'])} ms, hit rate "
            f"{_cell('hit_rate', placed['hit_rate'])}"
        )
        own = seed["autoscaled_twin"]
        write(
            f"the twin on its own autoscaler: {own['requests']} requests, p95 TTFT "
            f"{_cell('ttft_p95_s', own['ttft_p95_s'])} ms, hit rate "
            f"{_cell('hit_rate', own['hit_rate'])}"
        )
        write(f"live sizes: {seed['live_sizes']}")
        write(f"twin sizes: {seed['twin_sizes']}")
        write(f"live decisions: {_decisions(seed['decisions'])}")
        write(f"twin decisions: {_decisions(seed['twin_decisions'])}")
    write("")
    write(f"passed: {'yes' if passed else 'NO'}")
    write(f"plot: {plot}")


def _ms(seconds: float | None) -> str:
    """A signed difference in ms ("-" for none); sizes go through ``_cell``."""
    return "-" if seconds is None else f"{seconds * 1000:+.1f}"


def _decisions(rows: list[dict[str, Any]]) -> str:
    """Each change of size as 't s a->b reason (utilisation, queued requests)'."""

    def one(row: dict[str, Any]) -> str:
        utilisation = row["utilisation"]
        queue = row["queue_depth"]
        return (
            f"{row['at_s']:.0f}s {row['from']}->{row['to']} {row['reason']} "
            f"(u {'-' if utilisation is None else f'{utilisation:.2f}'}, "
            f"q {'-' if queue is None else f'{queue:.0f}'})"
        )

    return "; ".join(one(row) for row in rows) or "none"
