"""The cache sweep: one replay through fleets of several sizes and host-offload sizes.

Public surface: ``SweepPoint``, ``run_cache_sweep``, ``is_carried``,
``smallest_carried``, ``plan_scenario_for``.

Every point replays the same arrivals (``routing_ab.generate_arrivals``) through a
fresh fleet under prefix affinity, so the points differ in nothing but replicas and
``host_offload_gib``. A point **carries** the peak when p95 TTFT is under
``ttft_p95_target_s`` (1 s) and the median stream gets ``stream_tokens_per_s`` (30):
the capacity plan's criterion, measured. Beside each point, the capacity plan's own
estimate for it (``drills.domain.replica_load``), so the two can be read side by side.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from drills.domain.capacity_plan import ChatReplicaShape, Scenario
from drills.domain.fleet import FleetSim
from drills.domain.fleet_config import FleetConfig
from drills.domain.replica_load import FleetEstimate
from drills.domain.workload import Arrival, ChatWorkload

__all__ = [
    "SweepPoint",
    "is_carried",
    "plan_scenario_for",
    "run_cache_sweep",
    "smallest_carried",
]

TTFT_P95_TARGET_S = 1.0
STREAM_TOKENS_PER_S = 30.0


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One fleet of the sweep: what the simulator measured, and the plan's estimate."""

    replicas: int
    host_offload_gib: float
    prefix_hit_rate: float | None
    host_hit_rate: float | None
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    tpot_p50_s: float | None
    imbalance_mean: float | None
    uncached_prefill_tokens_per_s: float
    requests: int
    carried: bool
    plan: FleetEstimate | None = None

    def row(self) -> dict[str, object]:
        """Return the JSON row."""
        plan = self.plan
        return {
            "replicas": self.replicas,
            "host_offload_gib": self.host_offload_gib,
            "prefix_hit_rate": self.prefix_hit_rate,
            "host_hit_rate": self.host_hit_rate,
            "ttft_p50_s": self.ttft_p50_s,
            "ttft_p95_s": self.ttft_p95_s,
            "tpot_p50_s": self.tpot_p50_s,
            "imbalance_mean": self.imbalance_mean,
            "uncached_prefill_tokens_per_s": self.uncached_prefill_tokens_per_s,
            "requests": self.requests,
            "carried": self.carried,
            "plan_hit_rate": None
            if plan is None or plan.step_ms is None
            else plan.hit_rate,
            "plan_step_ms": None if plan is None else plan.step_ms,
            "plan_carried": None
            if plan is None
            else plan.is_carried(STREAM_TOKENS_PER_S),
        }


def is_carried(
    ttft_p95_s: float | None,
    tpot_p50_s: float | None,
    *,
    ttft_p95_target_s: float = TTFT_P95_TARGET_S,
    stream_tokens_per_s: float = STREAM_TOKENS_PER_S,
) -> bool:
    """Whether a run carried its load: p95 TTFT under target, streams at speed."""
    return (
        ttft_p95_s is not None
        and tpot_p50_s is not None
        and ttft_p95_s < ttft_p95_target_s
        and tpot_p50_s <= 1.0 / stream_tokens_per_s
    )


def run_cache_sweep(
    config: FleetConfig,
    arrivals: Sequence[Arrival],
    *,
    replicas: Iterable[int],
    host_offload_gib: Iterable[float],
    duration_s: float,
    warmup_s: float = 0.0,
    estimate: Callable[[int, float], FleetEstimate | None] | None = None,
    ttft_p95_target_s: float = TTFT_P95_TARGET_S,
    stream_tokens_per_s: float = STREAM_TOKENS_PER_S,
) -> list[SweepPoint]:
    """Replay ``arrivals`` through every (replicas, offload) pair, in that order.

    ``estimate(replicas, gib)``, when given, is the plan's estimate for the point.
    """
    offloads = tuple(host_offload_gib)
    points = []
    for count in replicas:
        for gib in offloads:
            point_config = replace(
                config, replicas=count, host_offload_gib=gib, policy="prefix_affinity"
            )
            result = FleetSim(point_config, arrivals=arrivals).run(
                duration_s, warmup_s=warmup_s
            )
            summary = result.summary()
            points.append(
                SweepPoint(
                    replicas=count,
                    host_offload_gib=gib,
                    prefix_hit_rate=summary["prefix_hit_rate"],
                    host_hit_rate=summary["host_hit_rate"],
                    ttft_p50_s=summary["ttft_p50_s"],
                    ttft_p95_s=summary["ttft_p95_s"],
                    tpot_p50_s=summary["tpot_p50_s"],
                    imbalance_mean=summary["imbalance_mean"],
                    uncached_prefill_tokens_per_s=summary[
                        "uncached_prefill_tokens_per_s"
                    ],
                    requests=summary["requests"],
                    carried=is_carried(
                        summary["ttft_p95_s"],
                        summary["tpot_p50_s"],
                        ttft_p95_target_s=ttft_p95_target_s,
                        stream_tokens_per_s=stream_tokens_per_s,
                    ),
                    plan=None if estimate is None else estimate(count, gib),
                )
            )
    return points


def smallest_carried(
    points: Iterable[SweepPoint], *, min_hit_rate: float = 0.0
) -> SweepPoint | None:
    """Return the carried point with the fewest replicas, then the least offload,
    whose hit rate is at least ``min_hit_rate``; None if there is none."""
    fits = [
        p for p in points if p.carried and (p.prefix_hit_rate or 0.0) >= min_hit_rate
    ]
    return min(fits, key=lambda p: (p.replicas, p.host_offload_gib), default=None)


def plan_scenario_for(workload: ChatWorkload, config: FleetConfig) -> Scenario:
    """Return the capacity plan's scenario of the simulated workload and replica:
    the history in whole simulated blocks (what the simulator can hit)."""
    profile = config.perf_profile
    shape = ChatReplicaShape.from_profile(profile)
    history = workload.history_tokens // config.block_size * config.block_size
    base = Scenario(replica=shape)
    stream_tokens_per_s = base.stream_tokens_per_s
    return base.with_values(
        {
            "peak_streams": workload.arrival_rate
            * workload.answer_tokens
            / stream_tokens_per_s,
            "answer_tokens": workload.answer_tokens,
            "prompt_tokens": workload.prompt_tokens,
            "cached_prefix_tokens": history,
            "message_interval_s": workload.message_interval_s,
        }
    )
