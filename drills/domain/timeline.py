"""Fixed-width time bins over a simulated run: counts, maxima and percentiles.

Public surface: ``bin_starts``, ``count_in_bins``, ``max_in_bins``,
``percentile_in_bins``.

Every function takes the same ``(start_s, end_s, bin_s)`` window; bin ``i`` covers
``[start_s + i * bin_s, start_s + (i + 1) * bin_s)``, the last bin is cut at
``end_s``, and points outside the window are ignored.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from simengine.domain.percentiles import percentile

__all__ = ["bin_starts", "count_in_bins", "max_in_bins", "percentile_in_bins"]


def bin_starts(start_s: float, end_s: float, bin_s: float) -> list[float]:
    """Return the start time of every bin of the window."""
    if bin_s <= 0 or end_s < start_s:
        raise ValueError("bin_s must be positive and end_s not before start_s")
    count = math.ceil((end_s - start_s) / bin_s - 1e-9)
    return [start_s + i * bin_s for i in range(count)]


def _index(at: float, start_s: float, end_s: float, bin_s: float) -> int | None:
    if not start_s <= at < end_s:
        return None
    return int((at - start_s) // bin_s)


def count_in_bins(
    times: Iterable[float], start_s: float, end_s: float, bin_s: float
) -> list[int]:
    """Return how many of ``times`` fall in each bin."""
    counts = [0] * len(bin_starts(start_s, end_s, bin_s))
    for at in times:
        index = _index(at, start_s, end_s, bin_s)
        if index is not None:
            counts[index] += 1
    return counts


def _group(
    points: Iterable[tuple[float, float]], start_s: float, end_s: float, bin_s: float
) -> list[list[float]]:
    groups: list[list[float]] = [[] for _ in bin_starts(start_s, end_s, bin_s)]
    for at, value in points:
        index = _index(at, start_s, end_s, bin_s)
        if index is not None:
            groups[index].append(value)
    return groups


def max_in_bins(
    points: Iterable[tuple[float, float]], start_s: float, end_s: float, bin_s: float
) -> list[float | None]:
    """Return the largest value of the ``(time, value)`` points in each bin."""
    return [max(g) if g else None for g in _group(points, start_s, end_s, bin_s)]


def percentile_in_bins(
    points: Iterable[tuple[float, float]],
    start_s: float,
    end_s: float,
    bin_s: float,
    q: float,
) -> list[float | None]:
    """Return the nearest-rank ``q`` quantile of the points in each bin."""
    return [percentile(g, q) for g in _group(points, start_s, end_s, bin_s)]
