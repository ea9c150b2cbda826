"""The platform's one percentile: nearest rank, over unsorted values.

Public surface: ``percentile``.

``percentile(values, 0.95)`` is the smallest value with at least 95% of the values
at or below it: the value of rank ``ceil(fraction * n)`` (at least 1) in sorted
order, with no interpolation, so it is always one of the values. Every figure the
platform reports is computed with it: the engine model's load results, the drills'
judges and tables, and the benchmarks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["percentile"]


def percentile(values: Iterable[float], fraction: float) -> float | None:
    """Return the nearest-rank ``fraction`` percentile of ``values`` (None if empty).

    ``fraction`` is in [0, 1]: 0.5 for the median, 0.99 for p99.
    """
    ordered = sorted(values)
    if not ordered:
        return None
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]
