"""One seed of ``manage.py twin_check``: the live window against its replay.

Public surface: ``check_seed``.

``check_seed`` runs the live window (``drills.twin_live``), writes its export as
a JSONL trace, replays it through ``read_trace``/``trace_arrivals`` in the fleet
simulator configured as the live pool (``drills.domain.twin_check``), and
compares the two sides' figures: the replicas from the replay whose autoscaler
decides, the rest from the replay on the live pool's fleet (``followed_fleet``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from drills.domain.twin_check import (
    ReplicaPoint,
    compare,
    figures_of,
    first_turn_hit_share,
    followed_fleet,
    paired_figures,
    replay,
    twin_fleet_config,
)
from drills.domain.workload import TeamSpec, read_trace, trace_arrivals
from drills.fleet_settings import platform_fleet_config
from drills.twin_live import PROFILE, TEAM, TwinPlan, run_live_window
from models_registry.domain.autoscaler import ScalingSettings
from routing.domain.traffic import salted_id
from routing.traffic import traffic_salt
from simengine.domain.perf import PROFILES

__all__ = ["check_seed"]


def _sizes(points: list[ReplicaPoint]) -> str:
    """The size asked for over time, as 't s: n' at each change."""
    out, last = [], None
    for p in points:
        if p.desired != last:
            out.append(f"{p.at:.0f}s:{p.desired}")
            last = p.desired
    return " ".join(out)


def check_seed(
    plan: TwinPlan,
    *,
    out_dir: Path,
    tolerance: float,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run one seed's live window, replay its export in the fleet simulator
    configured as the live pool, and compare; return every figure."""
    window = run_live_window(plan, log=log)
    path = out_dir / f"twin-seed{plan.load.seed}.jsonl"
    path.write_text(
        "".join(
            json.dumps(line, separators=(",", ":")) + "\n" for line in window.trace
        ),
        encoding="utf-8",
    )
    start_s = window.replica_start_s if window.replica_start_s is not None else 2.0
    # The trace's clock starts at its first arrival; the live one at the load's.
    shift = min((s.at for s in window.served), default=0.0)
    frontend_s = PROFILES[PROFILE].frontend_ms / 1000.0
    # What the simulator does not model: the gateway (and the client) under the
    # window's load, as the probes sent during it read it; idle if none answered.
    overhead_s = (
        window.gateway_overhead_load_s
        if window.gateway_overhead_load_s is not None
        else window.gateway_overhead_s
    )
    # And the replica's own time per request beyond its profile, read at idle.
    # The replay holds each request that long between admission and the replica:
    # its first token comes later and its tokens are in flight longer, as live.
    offset_s = frontend_s + overhead_s + window.replica_residual_s
    config = twin_fleet_config(
        platform_fleet_config(),
        settings=ScalingSettings(**plan.scaling_changes()),
        replica_tokens_in_flight=plan.replica_tokens_in_flight,
        profile=PROFILE,
        interval_s=plan.interval_s,
        start_s=start_s,
        seed=plan.load.seed,
        tick_times=[t - shift for t in window.ticks],
        route_delay_s=offset_s,
    )
    team = TeamSpec("team-" + salted_id(TEAM, traffic_salt()), guaranteed_share=1.0)
    trace = read_trace(path)  # the export as written, read back once
    scaled_served, predicted_points, twin_changes = replay(
        trace_arrivals(trace),
        config,
        window_s=window.window_s,
        teams=[team],
    )
    followed, events = followed_fleet(
        config, window.replicas, start_s=start_s, shift_s=shift
    )
    # Each request on the replica that served it live (the trace's), so the
    # engine model meets the cache state live met; and, beside it, the twin's
    # own placement on the same fleet (reported, not gated).
    predicted_served, _, _ = replay(
        trace_arrivals(trace),
        replace(followed, follow_placement=True),
        window_s=window.window_s,
        teams=[team],
        events=events,
    )
    placed_served, _, _ = replay(
        trace_arrivals(trace),
        followed,
        window_s=window.window_s,
        teams=[team],
        events=events,
    )
    predicted_points = [
        ReplicaPoint(p.at + shift, p.serving, p.desired) for p in predicted_points
    ]
    measured = figures_of(window.served, window.replicas, window_s=window.window_s)
    predicted = figures_of(predicted_served, predicted_points, window_s=window.window_s)
    comparison = compare(predicted, measured, tolerance=tolerance)
    scaled = figures_of(scaled_served, predicted_points, window_s=window.window_s)
    placed = figures_of(placed_served, predicted_points, window_s=window.window_s)
    paired = paired_figures(window.served, window.trace, predicted_served)
    gateway_mean = (
        sum(t for _, t in window.gateway_tokens_in_flight)
        / len(window.gateway_tokens_in_flight)
        if window.gateway_tokens_in_flight
        else None
    )
    return {
        "seed": plan.load.seed,
        "comparison": comparison,
        "live_requests": len(window.served),
        "live_failed": window.failed,
        "trace_requests": len(window.trace),
        "trace_skipped": window.trace_skipped,
        "trace": str(path),
        "window_s": window.window_s,
        "gateway_overhead_ms": overhead_s * 1000.0,
        "gateway_overhead_idle_ms": window.gateway_overhead_s * 1000.0,
        "load_probes": window.load_probes,
        "replica_residual_ms": window.replica_residual_s * 1000.0,
        "frontend_ms": frontend_s * 1000.0,
        "replica_start_s": start_s,
        "gateway_tokens_in_flight_mean": gateway_mean,
        "live_first_turn_hit_share": first_turn_hit_share(window.trace),
        "followed_scale_ups": [[e.at + shift, e.count] for e in events],
        # The gated replay against live, request by request.
        "paired": asdict(paired),
        "own_placement_twin": {
            "requests": placed.requests,
            "ttft_p95_s": placed.ttft_p95_s,
            "hit_rate": placed.hit_rate,
        },
        "autoscaled_twin": {
            "requests": scaled.requests,
            "ttft_p95_s": scaled.ttft_p95_s,
            "hit_rate": scaled.hit_rate,
            "tokens_in_flight_mean": scaled.tokens_in_flight_mean,
        },
        "live_sizes": _sizes(window.replicas),
        "twin_sizes": _sizes(predicted_points),
        "decisions": window.decisions,
        # The twin's own autoscaler's, on the live clock.
        "twin_decisions": [
            {**change, "at_s": change["at_s"] + shift} for change in twin_changes
        ],
        "wall_s": round(window.wall_s, 1),
        "series": {
            "live_ttft_s": [s.ttft_s for s in window.served],
            "twin_ttft_s": [s.ttft_s for s in predicted_served],
            "live_replicas": [[p.at, p.serving, p.desired] for p in window.replicas],
            "twin_replicas": [[p.at, p.serving, p.desired] for p in predicted_points],
            "gateway_tokens_in_flight": window.gateway_tokens_in_flight,
        },
    }
