"""What the autoscaling drill measures in one run of the fleet simulator.

Public surface: ``LATENCY_TIERS``, ``CaseFigures``, ``Series``, ``measure_case``.

The TTFT target is judged per minute on the latency tiers (interactive and
standard): a minute is *outside the target* when the p95 TTFT of the latency-tier
requests that arrived in it exceeds ``ttft_target_s`` (1 s), counting a request
that got no first token (a 429, a 503, a drain error, unfinished) as over the
target. Batch runs only on idle capacity and waits by design; its sheds are
reported per tier with the others.

From ``change_s`` (when the load began to change): ``first_serving_s``, until the
first replica the autoscaler started after it serves; ``scaled_s``, until the
serving count first reached the largest it reached in the run; ``recovered_s``,
until the end of the last 10 s bin whose latency-tier p95 TTFT was over the target
(0 when none was). GPU-hours are billed over the measured window
(``ScalingLog.gpu_hours``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from drills.domain.fleet_result import FleetResult
from drills.domain.fleet_scaling import ReplicaStart, ScalingTick
from drills.domain.replica import FleetRequest
from drills.domain.timeline import bin_starts, percentile_in_bins
from routing.domain.tiers import Tier
from simengine.domain.percentiles import percentile

__all__ = ["LATENCY_TIERS", "CaseFigures", "Series", "measure_case"]

LATENCY_TIERS = (Tier.INTERACTIVE.value, Tier.STANDARD.value)
_TIERS = tuple(tier.value for tier in Tier)
_RECOVERY_BIN_S = 10.0


@dataclass(frozen=True, slots=True)
class Series:
    """The run over time, for the plot: per autoscaler tick (``at_s``), and the
    latency tiers' p95 TTFT per minute (``minute_s``)."""

    at_s: tuple[float, ...]
    serving: tuple[int, ...]
    starting: tuple[int, ...]
    utilisation: tuple[float | None, ...]  # (in flight + queued) / serving capacity
    minute_s: tuple[float, ...]
    ttft_p95_s: tuple[float | None, ...]


@dataclass(frozen=True, slots=True)
class CaseFigures:
    """One case's figures (see the module docstring); None where not applicable."""

    requests: int
    tier_requests: dict[str, int]
    shed: dict[str, int]
    rate_limited: dict[str, int]
    errors: int
    first_serving_s: float | None
    scaled_s: float | None
    recovered_s: float | None
    peak_queue_depth: int
    minutes: int
    minutes_outside: int
    ttft_p95_s: float | None
    gpu_hours: float
    warm_gpu_hours: float
    peak_replicas: int
    starts: int
    warm_starts: int
    drains: int
    drain_errors: int
    arrival_utilisation: tuple[float, ...]
    series: Series

    def as_dict(self) -> dict[str, object]:
        return {
            "requests": self.requests,
            "tier_requests": self.tier_requests,
            "shed": self.shed,
            "rate_limited": self.rate_limited,
            "errors": self.errors,
            "first_serving_s": self.first_serving_s,
            "scaled_s": self.scaled_s,
            "recovered_s": self.recovered_s,
            "peak_queue_depth": self.peak_queue_depth,
            "minutes": self.minutes,
            "minutes_outside": self.minutes_outside,
            "ttft_p95_s": self.ttft_p95_s,
            "gpu_hours": self.gpu_hours,
            "warm_gpu_hours": self.warm_gpu_hours,
            "peak_replicas": self.peak_replicas,
            "starts": self.starts,
            "warm_starts": self.warm_starts,
            "drains": self.drains,
            "drain_errors": self.drain_errors,
            "arrival_utilisation": list(self.arrival_utilisation),
        }


def _ttft_or_miss(request: FleetRequest) -> float:
    if request.outcome == "ok" and request.ttft_s is not None:
        return request.ttft_s
    return math.inf  # no first token: over any target


def measure_case(
    result: FleetResult,
    *,
    change_s: float | None,
    replica_tokens_in_flight: int,
    ttft_target_s: float,
    minute_s: float = 60.0,
) -> CaseFigures:
    """Return the drill's figures of one run (its ``scaling`` log is required)."""
    log = result.scaling
    if log is None:
        raise ValueError("the run has no autoscaling log")
    start, end = result.started_at, result.ended_at
    latency = [r for r in result.requests if r.tier in LATENCY_TIERS]
    points = [(r.arrived_at, _ttft_or_miss(r)) for r in latency]
    per_minute = percentile_in_bins(points, start, end, minute_s, 0.95)
    outside = sum(1 for p in per_minute if p is not None and p > ttft_target_s)
    ticks = [t for t in log.ticks if start <= t.decision.at <= end]
    serving = [int(t.decision.signals["serving"]) for t in ticks]
    gpu, warm = log.gpu_hours(start, end)
    requests = result.requests
    figures_from = change_s if change_s is not None else start
    starts = [s for s in log.starts if start <= s.at <= end]
    joined = [s for s in starts if s.replica_id not in log.cancelled]
    first = next((s for s in joined if s.at >= figures_from), None)
    peak = max(serving, default=0)
    reached = next(
        (t.decision.at for t, n in zip(ticks, serving, strict=True) if n == peak), None
    )
    by_tier = result.by("tier")
    groups = [(tier, by_tier.get(tier)) for tier in _TIERS]
    return CaseFigures(
        requests=len(requests),
        tier_requests={t: g["requests"] if g else 0 for t, g in groups},
        shed={t: g["shed"] if g else 0 for t, g in groups},
        rate_limited={t: g["rate_limited"] if g else 0 for t, g in groups},
        errors=sum(g["error"] + g["no_replica"] for g in by_tier.values()),
        first_serving_s=None
        if first is None or change_s is None
        else first.ready_at - change_s,
        scaled_s=None
        if change_s is None or reached is None or not joined
        else max(0.0, reached - change_s),
        recovered_s=None
        if change_s is None
        else _recovered_s(points, change_s, end, ttft_target_s),
        peak_queue_depth=max(
            (sum(s.queued.values()) for s in result.samples), default=0
        ),
        minutes=len(per_minute),
        minutes_outside=outside,
        ttft_p95_s=percentile([p for _, p in points], 0.95),
        gpu_hours=gpu + warm,
        warm_gpu_hours=warm,
        peak_replicas=peak,
        starts=len(joined),
        warm_starts=sum(1 for s in joined if s.is_warm),
        drains=sum(1 for d in log.drains if start <= d.at <= end),
        drain_errors=sum(d.errors for d in log.drains if start <= d.at <= end),
        arrival_utilisation=_arrival_utilisation(
            log.ticks, joined, figures_from, replica_tokens_in_flight
        ),
        series=Series(
            at_s=tuple(t.decision.at for t in ticks),
            serving=tuple(serving),
            starting=tuple(int(t.decision.signals["starting"]) for t in ticks),
            utilisation=tuple(
                _utilisation(t.decision.signals, replica_tokens_in_flight)
                for t in ticks
            ),
            minute_s=tuple(bin_starts(start, end, minute_s)),
            ttft_p95_s=tuple(None if p is None else min(p, 1e3) for p in per_minute),
        ),
    )


def _utilisation(signals: dict[str, float], per_replica: int) -> float | None:
    serving = signals["serving"]
    if serving <= 0:
        return None
    demand = signals["tokens_in_flight"] + signals["queued_tokens"]
    return demand / (serving * per_replica)


def _recovered_s(
    points: Sequence[tuple[float, float]], change_s: float, end: float, target: float
) -> float:
    bins = percentile_in_bins(points, change_s, end, _RECOVERY_BIN_S, 0.95)
    over = [i for i, p in enumerate(bins) if p is not None and p > target]
    return (over[-1] + 1) * _RECOVERY_BIN_S if over else 0.0


def _arrival_utilisation(
    ticks: Sequence[ScalingTick],
    joined: Sequence[ReplicaStart],
    since: float,
    per_replica: int,
) -> tuple[float, ...]:
    """Utilisation of the serving replicas at the last tick before each new replica
    joined: what the seed's arithmetic (0.94) predicts for a 5%-a-minute ramp."""
    found = []
    index = 0
    for start in joined:
        if start.at < since:
            continue
        while index + 1 < len(ticks) and ticks[index + 1].decision.at < start.ready_at:
            index += 1
        if ticks and ticks[index].decision.at < start.ready_at:
            value = _utilisation(ticks[index].decision.signals, per_replica)
            if value is not None:
                found.append(round(value, 3))
    return tuple(found)
