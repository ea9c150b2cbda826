"""What a fleet simulation measured: every request of the window, and samples.

Public surface: ``OUTCOMES``, ``Sample``, ``FleetResult``, ``FleetSummary``,
``GroupFigures``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict

from drills.domain.fleet_config import FleetConfig
from drills.domain.fleet_scaling import ScalingLog
from drills.domain.replica import FleetRequest
from simengine.domain.percentiles import percentile

__all__ = ["OUTCOMES", "FleetResult", "FleetSummary", "GroupFigures", "Sample"]

# "unfinished": still running when the drain after the window ran out.
OUTCOMES = (
    "ok",
    "error",
    "rate_limited",
    "shed",
    "no_replica",
    "too_large",
    "unfinished",
)


class FleetSummary(TypedDict):
    """``FleetResult.summary()``: the headline figures of a run (None: no data)."""

    duration_s: float
    requests: int
    outcomes: dict[str, int]
    prefix_hit_rate: float | None
    host_hit_rate: float | None
    cached_token_share: float | None
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p95_s: float | None
    output_tokens_per_s: float
    prefill_tokens_per_s: float
    uncached_prefill_tokens_per_s: float
    imbalance_mean: float | None
    imbalance_peak: float | None


class GroupFigures(TypedDict):
    """``FleetResult.by()``: one team's or tier's requests, one count per outcome
    (the keys of ``OUTCOMES``, in its order) and TTFT percentiles."""

    requests: int
    ok: int
    error: int
    rate_limited: int
    shed: int
    no_replica: int
    too_large: int
    unfinished: int
    ttft_p50_s: float | None
    ttft_p95_s: float | None


@dataclass(slots=True)
class Sample:
    """The fleet at one sampling instant."""

    at: float
    replicas: int
    tokens_in_flight: list[int]
    queued: dict[str, int]
    engine_waiting: int

    @property
    def imbalance(self) -> float | None:
        """Highest tokens in flight over the pool average (None when idle)."""
        if not self.tokens_in_flight:
            return None
        mean = sum(self.tokens_in_flight) / len(self.tokens_in_flight)
        return max(self.tokens_in_flight) / mean if mean > 0 else None


@dataclass(slots=True)
class FleetResult:
    """Requests that arrived inside the measured window, and the samples;
    ``scaling`` is the autoscaler's log of the whole run (None without it)."""

    config: FleetConfig
    started_at: float
    ended_at: float
    block_size: int
    requests: list[FleetRequest] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    generated_tokens: int = 0
    prefill_tokens: int = 0
    events: list[tuple[float, str]] = field(default_factory=list)
    scaling: ScalingLog | None = None

    @property
    def duration_s(self) -> float:
        return self.ended_at - self.started_at

    def summary(self) -> FleetSummary:
        """Return the headline figures of the run (see the module docstring)."""
        ok = [r for r in self.requests if r.outcome == "ok"]
        cacheable = sum(r.cacheable_tokens(self.block_size) for r in ok)
        cached = sum(
            min(r.cached_tokens, r.cacheable_tokens(self.block_size)) for r in ok
        )
        host = sum(min(r.host_tokens, r.cacheable_tokens(self.block_size)) for r in ok)
        prompt = sum(r.prompt_tokens for r in ok)
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
        imbalances = [s.imbalance for s in self.samples if s.imbalance is not None]
        duration = max(self.duration_s, 1e-9)
        outcomes = {name: 0 for name in OUTCOMES}
        for request in self.requests:
            outcomes[request.outcome] = outcomes.get(request.outcome, 0) + 1
        return {
            "duration_s": self.duration_s,
            "requests": len(self.requests),
            "outcomes": outcomes,
            "prefix_hit_rate": cached / cacheable if cacheable else None,
            # Of those hits, the share loaded from the host tier (CPU offload).
            "host_hit_rate": host / cacheable if cacheable else None,
            "cached_token_share": sum(r.cached_tokens for r in ok) / prompt
            if prompt
            else None,
            "ttft_p50_s": percentile(ttfts, 0.50),
            "ttft_p95_s": percentile(ttfts, 0.95),
            "ttft_p99_s": percentile(ttfts, 0.99),
            "tpot_p50_s": percentile(tpots, 0.50),
            "tpot_p95_s": percentile(tpots, 0.95),
            "output_tokens_per_s": self.generated_tokens / duration,
            "prefill_tokens_per_s": sum(r.prompt_tokens for r in ok) / duration,
            "uncached_prefill_tokens_per_s": sum(
                r.prompt_tokens - r.cached_tokens for r in ok
            )
            / duration,
            "imbalance_mean": sum(imbalances) / len(imbalances) if imbalances else None,
            "imbalance_peak": max(imbalances) if imbalances else None,
        }

    def by(self, attribute: str) -> dict[str, GroupFigures]:
        """Return per-team or per-tier figures: requests, outcomes, TTFT p50/p95."""
        groups: dict[str, list[FleetRequest]] = {}
        for request in self.requests:
            groups.setdefault(getattr(request, attribute), []).append(request)
        table: dict[str, GroupFigures] = {}
        for name, requests in sorted(groups.items()):
            ttfts = [r.ttft_s for r in requests if r.outcome == "ok" and r.ttft_s]
            counts = {outcome: 0 for outcome in OUTCOMES}
            for request in requests:
                counts[request.outcome] += 1
            table[name] = {
                "requests": len(requests),
                "ok": counts["ok"],
                "error": counts["error"],
                "rate_limited": counts["rate_limited"],
                "shed": counts["shed"],
                "no_replica": counts["no_replica"],
                "too_large": counts["too_large"],
                "unfinished": counts["unfinished"],
                "ttft_p50_s": percentile(ttfts, 0.50),
                "ttft_p95_s": percentile(ttfts, 0.95),
            }
        return table
