"""A pool's live figures, read from its ``pool`` role figures over a window.

Public surface: ``PoolLive``, ``pool_live``, ``usd_per_million_served``.

The gateways add every request a pool (version and region) serves to its role
``pool`` figures (``metering.domain.figures``), rollout or not; the flusher writes
them to rows beside the guards'. The pool state, the console and ``/metrics`` read
them through ``pool_live`` alone, so the three always agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from metering.domain.figures import VersionFigures

__all__ = ["PoolLive", "pool_live", "usd_per_million_served"]


@dataclass(frozen=True, slots=True)
class PoolLive:
    """What a pool did over the window: latency quantiles in ms (None without a
    sample), cached over prompt tokens, and what a million tokens served cost."""

    requests: int
    ttft_p95_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p95_ms: float | None
    prefix_hit_rate: float | None
    usd_per_million_tokens: float | None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 1)


def usd_per_million_served(
    *, usd_per_hour: float, window_s: float, tokens: int
) -> float | None:
    """Return what a million tokens (prompt and output) cost when ``tokens`` were
    served over ``window_s`` by GPUs costing ``usd_per_hour``; None without tokens.
    """
    if tokens <= 0 or window_s <= 0:
        return None
    return round(usd_per_hour * window_s / 3600.0 / tokens * 1_000_000, 4)


def pool_live(
    figures: VersionFigures, *, usd_per_hour: float, window_s: float
) -> PoolLive:
    """Return a pool's live figures from its ``pool`` figures over ``window_s``,
    its GPUs costing ``usd_per_hour`` (those it holds now)."""
    return PoolLive(
        requests=figures.requests,
        ttft_p95_ms=_ms(figures.ttft_quantile(0.95)),
        ttft_p99_ms=_ms(figures.ttft_quantile(0.99)),
        tpot_p50_ms=_ms(figures.tpot_quantile(0.5)),
        tpot_p95_ms=_ms(figures.tpot_quantile(0.95)),
        prefix_hit_rate=figures.prefix_hit_rate,
        usd_per_million_tokens=usd_per_million_served(
            usd_per_hour=usd_per_hour,
            window_s=window_s,
            tokens=figures.prompt_tokens + figures.output_tokens,
        ),
    )
