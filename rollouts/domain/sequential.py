"""Anytime-valid confidence sequences for the rollout guards (issue 38).

Pure math, no I/O. The guards look at a canary every guard period; a
fixed-sample test looked at that often trips on chance far more often than its
alpha, and a fixed sample size cannot follow a pool's traffic. A confidence
sequence holds at every look at once: with probability at least ``1 - alpha``
the true difference is inside *every* interval the sequence ever gives, so a
rule that acts the first time an interval clears a threshold keeps its error
rate at ``alpha`` however often it looks (docs/rollouts.md#sequential-guards).

The construction is the mixture SPRT of Johari et al. (2017, the one Statsig and
Optimizely run): for an estimate with (estimated) variance ``V`` and a normal
mixture of scale ``tau`` over the effect, the likelihood ratio
``sqrt(V / (V + tau^2)) * exp(tau^2 r^2 / (2 V (V + tau^2)))`` at a distance
``r`` is a martingale under the null, and Ville's inequality bounds its ever
reaching ``1 / alpha`` by ``alpha``. A single ``tau`` is tuned to one effect
size; the guards must catch a 100-point refusal jump on ten requests and a
0.6-point error rise on thousands, so the ratio is averaged over a grid of
scales (an average of martingales is one; the grid costs ``log`` of its size).
The radius solves ``mean ratio = 1 / alpha``.

Rates are smoothed by half a count on each side, ``(k + 1/2) / (n + 1)``, so a
side with no event (or only events) still has a variance: ten refusals in ten
answers against none in ten is evidence, not a zero-variance division.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Interval",
    "always_valid_p",
    "difference_interval",
    "largest_variance",
    "mixture_radius",
    "proportion_variance",
    "rate_scales",
    "samples_to_decide",
]

# The smallest and largest mixture scale relative to the guard's threshold, as
# powers of two: from half the threshold up to a whole (100%) rate.
_GRID_BELOW = 1


@dataclass(frozen=True, slots=True)
class Interval:
    """A confidence-sequence interval around ``estimate`` (``lower``..``upper``),
    from an estimate of ``variance``."""

    estimate: float
    lower: float
    upper: float
    variance: float


def rate_scales(threshold: float, top: float = 1.0) -> tuple[float, ...]:
    """Return the mixture scales for a guard of ``threshold``: doubling up to ``top``.

    ``threshold`` and ``top`` in the estimate's units (fractions for rates).
    """
    base = max(threshold, 1e-4) / 2**_GRID_BELOW
    scales = [base]
    while scales[-1] < top:
        scales.append(scales[-1] * 2.0)
    return tuple(scales)


def _log_ratio(radius: float, variance: float, scales: Sequence[float]) -> float:
    """log of the mixture likelihood ratio at ``radius``, averaged over ``scales``."""
    r2 = radius * radius
    terms = [
        0.5 * math.log(variance / (variance + t2))
        + t2 * r2 / (2.0 * variance * (variance + t2))
        for t2 in (tau * tau for tau in scales)
    ]
    top = max(terms)
    total = 0.0
    for term in terms:
        total += math.exp(term - top)
    return top + math.log(total / len(terms))


def mixture_radius(variance: float, alpha: float, scales: Sequence[float]) -> float:
    """Return the interval's half-width for an estimate of ``variance`` at ``alpha``.

    Infinite for a variance that is not positive and finite (nothing observed).
    """
    if not variance > 0.0 or not math.isfinite(variance) or not scales:
        return math.inf
    target = math.log(1.0 / alpha)
    low, high = 0.0, math.sqrt(variance)
    while _log_ratio(high, variance, scales) < target:
        high *= 2.0
    for _ in range(45):
        mid = (low + high) / 2.0
        if _log_ratio(mid, variance, scales) < target:
            low = mid
        else:
            high = mid
    return high


def always_valid_p(distance: float, variance: float, scales: Sequence[float]) -> float:
    """Return ``1 / ratio`` at ``distance`` from the null (at most 1): the
    always-valid p-value of this look (Johari et al.)."""
    if not variance > 0.0 or not math.isfinite(variance) or not scales:
        return 1.0
    return min(1.0, math.exp(-_log_ratio(abs(distance), variance, scales)))


def proportion_variance(k: int, n: int) -> float:
    """Return the smoothed variance of ``k / n``: ``p (1 - p) / n``, ``p`` shrunk."""
    if n <= 0:
        return math.inf
    p = (k + 0.5) / (n + 1.0)
    return p * (1.0 - p) / n


def difference_interval(
    k_candidate: int,
    n_candidate: int,
    k_live: int,
    n_live: int,
    *,
    alpha: float,
    scales: Sequence[float],
) -> Interval:
    """Return the candidate's rate minus live's, with its confidence sequence.

    Rates as fractions; the estimate is the raw difference, the variance the
    smoothed one (module docstring). Infinite bounds when a side is empty.
    """
    if n_candidate <= 0 or n_live <= 0:
        return Interval(0.0, -math.inf, math.inf, math.inf)
    estimate = k_candidate / n_candidate - k_live / n_live
    variance = proportion_variance(k_candidate, n_candidate) + proportion_variance(
        k_live, n_live
    )
    radius = mixture_radius(variance, alpha, scales)
    return Interval(estimate, estimate - radius, estimate + radius, variance)


def largest_variance(gap: float, *, alpha: float, scales: Sequence[float]) -> float:
    """Return the largest estimate variance whose interval is at most ``gap``
    wide on each side (a bisection on its log); 0 for no gap."""
    if gap <= 0.0 or not scales:
        return 0.0
    target = math.log(1.0 / alpha)
    low, high = -80.0, 5.0  # log variance
    for _ in range(50):
        mid = (low + high) / 2.0
        if _log_ratio(gap, math.exp(mid), scales) >= target:
            low = mid
        else:
            high = mid
    return math.exp(low)


def samples_to_decide(
    rate_candidate: float,
    rate_live: float,
    threshold: float,
    *,
    alpha: float,
    scales: Sequence[float],
    live_per_candidate: float = 1.0,
    limit: int = 10_000_000,
) -> int | None:
    """Return the candidate samples at which rates like these would be decided.

    The smallest ``n`` (with ``live_per_candidate * n`` on live) whose interval
    around ``rate_candidate - rate_live`` clears ``threshold`` on one side: the
    expected exposure, not a guarantee. None when the gap to the threshold is
    too small to clear within ``limit`` samples.

    Solved in the variance, not in ``n``: the largest variance at which the gap
    clears (a bisection on its log), then the smallest ``n`` whose smoothed
    variance is below it (a bisection on ``n``).
    """
    gap = abs(rate_candidate - rate_live - threshold)
    if gap <= 0.0 or not scales:
        return None
    most = largest_variance(gap, alpha=alpha, scales=scales)
    ratio = max(live_per_candidate, 1e-9)

    def variance(n: float) -> float:
        n_l = n * ratio
        p_c = (rate_candidate * n + 0.5) / (n + 1.0)
        p_l = (rate_live * n_l + 0.5) / (n_l + 1.0)
        return p_c * (1.0 - p_c) / n + p_l * (1.0 - p_l) / n_l

    if variance(float(limit)) > most:
        return None
    lo_n, hi_n = 1, limit  # variance falls as n grows
    while lo_n < hi_n:
        mid_n = (lo_n + hi_n) // 2
        if variance(float(mid_n)) <= most:
            hi_n = mid_n
        else:
            lo_n = mid_n + 1
    return lo_n
